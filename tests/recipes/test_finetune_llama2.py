"""The recipe end to end on the embedded tiny default, launched as a user launches it."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.templates import ALPACA
from hf_scale.evaluation import greedy_exact_match
from hf_scale.tiny import generate_conversation_tasks, generate_tasks
from tests.helpers import SHARED_DATA, assert_same_weights, assert_succeeded, python_bin, run_command, torchrun

RECIPE = "recipes/finetune_llama2.py"
pytestmark = pytest.mark.slow


def test_recipe_learns_the_held_out_task_and_saves_a_loadable_model(trained_tiny_run):
    """`make demo`: `accelerate launch recipes/finetune_llama2.py` (the session's shared run, tests/conftest.py)."""
    output_dir, stdout = trained_tiny_run, trained_tiny_run.with_suffix(".log").read_text()
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["eval_before_exact_match"] <= 0.02
    assert metrics["eval_after_exact_match"] >= 0.8
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"] / 4
    assert "held-out exact match: 0.0" in stdout
    assert (output_dir / "loss_curve.png").stat().st_size > 10_000
    assert (output_dir / "learning_rate.png").stat().st_size > 5_000

    # The saved folder is a normal HF model folder: reload it and score unseen records again.
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    _, held_out = generate_tasks()
    reloaded = greedy_exact_match(model, tokenizer, held_out[:200], ALPACA, max_new_tokens=8)
    assert reloaded >= 0.8


def test_multi_turn_default_learns_the_turn_that_depends_on_the_first(tmp_path, hf_scale_cache):
    """tiny_chat_cpu as shipped, through `hf-scale train`: the last turn ("now add one to that") is answered from the
    model's own first answer, and the saved tokenizer's chat template prompts the saved model as training did."""
    output_dir = tmp_path / "run"
    command = [python_bin("hf-scale"), "train", "--config", "tiny_chat_cpu", "--output_dir", str(output_dir)]
    result = run_command(command, timeout=900)
    assert_succeeded(result, result.stderr[-3000:])
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["eval_before_exact_match"] <= 0.02
    assert metrics["eval_after_exact_match"] >= 0.8
    assert "[/INST]⟦" in result.stdout  # the rendered example: LLaMA-2 chat, the assistant's answer trained

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    _, held_out = generate_conversation_tasks()
    correct = 0
    for turns in held_out[:40]:
        prompt = tokenizer.apply_chat_template(turns[:-1], add_generation_prompt=True, return_dict=True)
        prompt_ids = torch.tensor([prompt["input_ids"]])
        generated = model.generate(prompt_ids, max_new_tokens=8, do_sample=False)
        answer = tokenizer.decode(generated[0, prompt_ids.shape[1] :], skip_special_tokens=True)
        correct += answer.strip() == turns[-1]["content"]
    assert correct >= 32, f"{correct}/40 last turns right with the saved chat template"


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


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_two_processes_train_on_a_packed_mixture_of_alpaca_records_and_conversations(tmp_path, hf_scale_cache):
    """The English Alpaca set and Chinese conversations (the Chinese set chained into 2-4 turns, as ShareGPT), mixed
    2:1 by weight and packed, on 2 processes: what each source gave and what the mix took from it is printed."""
    from hf_scale.data.conversations import chain_conversations
    from hf_scale.data.loading import load_records

    records, _ = load_records(str(SHARED_DATA / "alpaca_zh_demo.json"))
    sharegpt = tmp_path / "zh_chats.jsonl"
    speaker = {"user": "human", "assistant": "gpt"}
    with sharegpt.open("w") as out:
        for turns in chain_conversations(records):
            chat = [{"from": speaker[turn["role"]], "value": turn["content"]} for turn in turns]
            out.write(json.dumps({"conversations": chat}, ensure_ascii=False) + "\n")
    english = str(SHARED_DATA / "alpaca_en_demo.json")
    datasets = [{"path": english, "weight": 2}, {"path": str(sharegpt), "data_format": "sharegpt", "weight": 1}]
    output_dir = tmp_path / "run"
    flags = ["--datasets", json.dumps(datasets), "--template", "llama2_chat", "--packing", "true"]
    flags += ["--max_length", "512", "--truncation", "drop", "--max_steps", "6", "--per_device_train_batch_size", "4"]
    flags += ["--exact_match_samples", "4", "--eval_strategy", "no", "--output_dir", str(output_dir)]
    result = run_command(torchrun(RECIPE, *flags), timeout=600)
    assert_succeeded(result, result.stderr[-3000:])
    lines = result.stdout.splitlines()
    english_train = next(line for line in lines if line.startswith(f"train from {english}: "))
    chats_train = next(line for line in lines if line.startswith(f"train from {sharegpt}: "))
    records_in, english_examples = map(int, re.search(r": (\d+) records -> (\d+) examples", english_train).groups())
    assert records_in == 949  # 999 records, 5 % held out
    chats_in, chat_examples = map(int, re.search(r": (\d+) conversations -> (\d+) examples", chats_train).groups())
    assert 950 // 4 <= chats_in <= 950 // 2 and chat_examples <= chats_in
    assert re.search(r"\d+ tokens of which \d+ trained on", english_train + chats_train)
    mixture = next(line for line in lines if line.startswith("mixture (interleave, seed 42): "))
    drawn = [int(n) for n in re.findall(r"(\d+) of \d+ examples", mixture)]
    assert f"{english}: {drawn[0]} of {english_examples} examples" in mixture
    assert f"{sharegpt}: {drawn[1]} of {chat_examples} examples" in mixture
    assert drawn[1] == chat_examples and drawn[0] / drawn[1] == pytest.approx(2, rel=0.25)  # 2:1 until chats run out
    assert f"train: {sum(drawn)} examples; batching: packing, 0.0% of the batch tokens are padding" in result.stdout
    assert lines.count(mixture) == 1  # printed once, by the main process
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["train_loss"] > 0


def test_qlora_with_packing_accumulation_checkpointing_and_early_stopping(trained_tiny_qlora_run):
    """The options combined on a 4-bit base (the session's QLoRA run): the run stops early and ends with, and saves,
    the best checkpoint's adapter (no copy of the base anywhere)."""
    output_dir = trained_tiny_qlora_run
    printed = output_dir.with_suffix(".log").read_text()
    assert "batching: packing, 0.0% of the batch tokens are padding" in printed
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] < 60  # stopped: no evaluation improved by 100
    best = Path(state["best_model_checkpoint"])
    assert_same_weights(best / "adapter_model.safetensors", output_dir / "adapter_model.safetensors", atol=0)
    assert not list(output_dir.rglob("model.safetensors"))  # adapters only, in the run and its checkpoints


# The README's launch lines (accelerate, torchrun, the DeepSpeed launcher, two nodes; ZeRO-1 and ZeRO-3 with
# offload, saved whole) run on 2 CPU processes in tests/test_readme.py; every launch mode with the presets, LoRA,
# QLoRA and the other options (ZeRO on one process without a launcher among them) in tests/recipes/test_launch_modes.py.


def test_lora_adapters_start_from_the_seed_whatever_the_process_drew_before(tmp_path, hf_scale_cache):
    """LoRA's A matrices are drawn when the model is built, before the Trainer seeds: two runs with one seed, in
    processes whose torch generator stood elsewhere (a fresh interpreter, a forked one), trained different adapters,
    and a killed run resumed by a new process could not reach the run that was never killed (the real-model test)."""
    from safetensors.torch import load_file

    from hf_scale.recipes.finetune_llama2 import main

    flags = ["--lora_r", "8", "--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no"]
    flags += ["--exact_match_samples", "0"]
    adapters = []
    for state in (1, 2):
        torch.manual_seed(state)
        main([*flags, "--output_dir", str(tmp_path / str(state))])
        adapters.append(load_file(tmp_path / str(state) / "adapter_model.safetensors"))
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        assert torch.equal(tensor, adapters[1][name]), name
