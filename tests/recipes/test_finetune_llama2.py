"""The recipe end to end on the embedded tiny default, launched as a user launches it."""

import json
import re
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.templates import ALPACA
from hf_scale.evaluation import greedy_exact_match
from hf_scale.tiny import generate_tasks
from tests.helpers import SHARED_DATA, assert_succeeded, python_bin, run_command, torchrun

RECIPE = "recipes/finetune_llama2.py"
pytestmark = pytest.mark.slow


def test_recipe_learns_the_held_out_task_and_saves_a_loadable_model(tmp_path, hf_scale_cache):
    output_dir = tmp_path / "run"
    result = run_command(
        [python_bin("accelerate"), "launch", "--num_processes", "1", RECIPE, "--output_dir", str(output_dir)],
        timeout=600,
        OMP_NUM_THREADS="2",
    )
    assert_succeeded(result, result.stderr[-3000:])
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["eval_before_exact_match"] <= 0.02
    assert metrics["eval_after_exact_match"] >= 0.8
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"] / 4
    assert "held-out exact match: 0.0" in result.stdout
    assert (output_dir / "loss_curve.png").stat().st_size > 10_000
    assert (output_dir / "learning_rate.png").stat().st_size > 5_000

    # The saved folder is a normal HF model folder: reload it and score unseen records again.
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    _, held_out = generate_tasks()
    reloaded = greedy_exact_match(model, tokenizer, held_out[:200], ALPACA, max_new_tokens=8)
    assert reloaded >= 0.8


def test_resume_continues_from_the_newest_checkpoint(tmp_path, hf_scale_cache):
    output_dir = tmp_path / "run"
    common = [
        sys.executable,
        RECIPE,
        "--output_dir",
        str(output_dir),
        "--exact_match_samples",
        "0",
        "--save_strategy",
        "steps",
        "--save_steps",
        "10",
        "--logging_steps",
        "5",
        "--save_total_limit",
        "3",
    ]
    first = run_command([*common, "--max_steps", "20"], timeout=300)
    assert_succeeded(first, first.stderr[-3000:])
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]

    second = run_command([*common, "--max_steps", "30", "--resume"], timeout=300)
    assert_succeeded(second, second.stderr[-3000:])
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 30
    steps_logged = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert steps_logged == [5, 10, 15, 20, 25, 30]  # the first 20 steps come from the checkpoint, not a rerun


def test_recipe_under_torchrun_is_real_ddp(tmp_path, hf_scale_cache):
    output_dir = tmp_path / "run"
    flags = ["--output_dir", str(output_dir), "--max_steps", "30", "--exact_match_samples", "40"]
    result = run_command(torchrun(RECIPE, *flags), timeout=400)
    assert_succeeded(result, result.stderr[-3000:])
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["effective_batch_size"] == 64  # 32 per device x 2 processes
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"]
    assert "effective batch 64 = 32 per device x 2 data-parallel process(es) x 1 accumulation step(s)" in result.stdout


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_recipe_on_real_chinese_alpaca_with_packing(tmp_path, hf_scale_cache):
    output_dir = tmp_path / "run"
    flags = [
        "--dataset",
        str(SHARED_DATA / "alpaca_zh_demo.json"),
        "--template",
        "alpaca_zh",
        "--packing",
        "true",
        "--max_length",
        "256",
        "--truncation",
        "drop",
        "--max_steps",
        "10",
        "--exact_match_samples",
        "8",
        "--eval_strategy",
        "no",
        "--output_dir",
        str(output_dir),
    ]
    result = run_command([sys.executable, RECIPE, *flags], timeout=300)
    assert_succeeded(result, result.stderr[-3000:])
    summary = next(line for line in result.stdout.splitlines() if line.startswith("train: "))
    kept, dropped = re.search(r"-> (\d+) examples.*?; (\d+) dropped", summary).groups()
    assert int(kept) + int(dropped) == 950  # 1000 records, 5 % held out: every record kept or counted
    assert "batching: packing, 0.0% of the batch tokens are padding" in summary
    assert "### 回答:\n⟦" in result.stdout  # the rendered example shows the Chinese template and the trained span
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"]


# The README's launch lines (accelerate, torchrun, the DeepSpeed launcher, two nodes; ZeRO-1 and ZeRO-3 with
# offload, saved whole) run on 2 CPU processes in tests/test_readme.py.
