"""Every way users start a run, crossed with the features: one process without a launcher, torchrun, accelerate
launch, DeepSpeed's launcher (2 processes each) and parallel trials (2 workers).

`COVERAGE` names, for each launch mode and each value of each feature, the test that runs that cell; the cells no
other test runs are the rows below, each a real launch of the recipe on the tiny default (6 steps) or a 2-trial
search. A training row must lower the held-out loss and save a model that loads; a search row must complete its
trials and save its best model. Combinations refused before any work (QLoRA with a ZeRO preset, parallel trials
under a launcher) are checked in-process by the tests COVERAGE names. The README's compatibility table shows the
same cells (test_readme_shows_every_cell).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hf_scale.export import export_run
from hf_scale.hpo.policy import NOT_RUN
from hf_scale.hpo.report import load_study
from tests.helpers import REPO_ROOT, SHARED_DATA, assert_succeeded, free_port, python_bin, run_command, torchrun

MODES = ("one process", "torchrun", "accelerate launch", "deepspeed", "parallel_trials")
FEATURES = {
    "preset": ("none", "zero2", "zero3", "offload"),
    "tuning": ("full", "LoRA", "QLoRA"),
    "packing": ("packing",),
    "bf16": ("bf16",),
    "accumulation": ("accumulation",),
    "early stopping": ("early stopping",),
    "search": ("search",),
}
RECIPE = "recipes/finetune_llama2.py"
SEARCH_RECIPE = "recipes/search_llama2.py"
SHORT = ["--max_steps", "6", "--eval_steps", "3", "--save_steps", "3", "--logging_steps", "1", "--eval_ratio", "0.1"]
SHORT += ["--per_device_train_batch_size", "8", "--exact_match_samples", "0"]
SEARCH = ["--n_trials", "2", "--max_steps", "4", "--eval_steps", "4", "--per_device_batches", "4"]
SEARCH += ["--effective_batch_min", "8", "--effective_batch_max", "16", "--report", "false"]
FLAGS = {
    "zero2": ["--zero_preset", "zero2"],
    "zero3": ["--zero_preset", "zero3"],
    "offload": ["--zero_preset", "zero2_offload"],
    "LoRA": ["--lora_r", "8"],
    "QLoRA": ["--lora_r", "8", "--quantization", "nf4"],
    "packing": ["--packing", "true"],
    "bf16": ["--bf16", "true"],
    "accumulation": ["--gradient_accumulation_steps", "2"],
    "early stopping": ["--early_stopping_patience", "2"],
}

# The cells that only this file launches: (mode, features); every row also trains or searches as said.
ROWS = [
    ("one process", ("zero2", "LoRA", "packing", "early stopping")),
    ("one process", ("zero3", "bf16", "accumulation")),
    ("one process", ("offload", "packing", "bf16")),
    ("one process", ("none", "QLoRA", "accumulation", "early stopping")),
    ("accelerate launch", ("zero3", "packing", "early stopping")),
    ("accelerate launch", ("none", "early stopping", "packing")),
    ("deepspeed", ("zero2", "LoRA", "packing", "bf16", "search")),
    ("deepspeed", ("zero3", "accumulation", "early stopping")),
    ("deepspeed", ("none", "QLoRA", "packing")),
    ("deepspeed", ("offload", "bf16")),
    ("parallel_trials", ("zero2", "packing", "early stopping", "search")),
    ("parallel_trials", ("zero3", "bf16", "search")),
    ("parallel_trials", ("offload", "LoRA", "search")),
    ("parallel_trials", ("none", "QLoRA", "search")),
]
HERE = "recipes/test_launch_modes.py"
MATRIX = "distributed/test_matrix.py"
CONFIGS = "recipes/test_configs_as_shipped.py"
REFUSED = "refused: test_bad_input.py"  # QLoRA trains with data parallelism only: one line before any work
# The cells other tests run (paths under tests/), beside this file's rows.
ELSEWHERE = {
    ("one process", "none"): "recipes/test_finetune_llama2.py",
    ("one process", "full"): "recipes/test_finetune_llama2.py",
    ("one process", "search"): "hpo/test_search.py",
    ("torchrun", "none"): MATRIX,
    ("torchrun", "offload"): "distributed/test_zero.py (zero2_offload and zero3_offload against DDP)",
    ("torchrun", "zero2"): MATRIX,
    ("torchrun", "zero3"): MATRIX,
    ("torchrun", "full"): MATRIX,
    ("torchrun", "LoRA"): MATRIX,
    ("torchrun", "QLoRA"): f"{CONFIGS} (7B 1x4090 QLoRA)",
    ("torchrun", "packing"): MATRIX,
    ("torchrun", "bf16"): MATRIX,
    ("torchrun", "accumulation"): MATRIX,
    ("torchrun", "early stopping"): "callbacks/test_early_stopping.py",
    ("torchrun", "search"): "hpo/test_distributed.py",
    ("accelerate launch", "zero2"): f"{CONFIGS} (13B ZeRO-2)",
    ("accelerate launch", "offload"): f"{CONFIGS} (7B 4x4090 ZeRO-2 offload)",
    ("accelerate launch", "full"): f"{CONFIGS} (7B ZeRO-1)",
    ("accelerate launch", "LoRA"): f"{CONFIGS} (7B 4x4090 LoRA)",
    ("accelerate launch", "QLoRA"): f"{CONFIGS} (13B 4x4090 QLoRA)",
    ("accelerate launch", "bf16"): f"{CONFIGS} (13B ZeRO-2)",
    ("accelerate launch", "accumulation"): f"{CONFIGS} (every config: 2 steps)",
    ("accelerate launch", "search"): f"{CONFIGS} (the LoRA search)",
    ("deepspeed", "full"): "test_readme.py (7B ZeRO-1)",
    ("parallel_trials", "full"): "hpo/test_parallel.py",
    ("parallel_trials", "bf16"): "hpo/test_parallel.py (the shipped LoRA search)",
    ("parallel_trials", "accumulation"): "hpo/test_parallel.py (the batch searched)",
}


def coverage() -> dict[tuple[str, str], str]:
    """(mode, feature value) -> where that cell runs, or how it is refused."""
    cells = dict(ELSEWHERE)
    for mode, features in ROWS:
        for value in features:
            cells.setdefault((mode, value), HERE)
        tuning = next((value for value in features if value in FEATURES["tuning"]), "full")
        cells.setdefault((mode, tuning), HERE)
    for mode in MODES:
        for preset in ("zero2", "zero3", "offload"):
            cells[(mode, f"QLoRA with {preset}")] = REFUSED
    return cells


def test_every_launch_mode_meets_every_feature():
    cells = coverage()
    missing = [(mode, value) for mode in MODES for values in FEATURES.values() for value in values]
    assert [cell for cell in missing if cell not in cells] == []
    for where in set(cells.values()) - {REFUSED}:
        assert (REPO_ROOT / "tests" / where.split(" (")[0]).is_file(), where


def test_readme_shows_every_cell():
    """The README's launch-mode table is this file's coverage, cell for cell."""
    readme = (REPO_ROOT / "README.md").read_text()
    cells = coverage()
    for mode in MODES:
        row = re.search(rf"^\| {re.escape(mode)} \|(.*)\|$", readme, re.MULTILINE)
        assert row, f"README: no launch-mode row for {mode}"
        shown = [cell.strip() for cell in row.group(1).split("|")]
        values = [value for values in FEATURES.values() for value in values]
        assert shown == [f"`{Path(cells[(mode, value)].split(' (')[0]).name}`" for value in values], mode
    assert "QLoRA with a ZeRO preset is refused in every launch mode" in readme


def launch_line(mode: str, script: str, port: int) -> list[str]:
    if mode == "one process":
        return [python_bin("python"), script]
    if mode == "torchrun":
        return torchrun(script)
    if mode == "accelerate launch":
        # The shipped config, as the README launches it (without one, accelerate starts one process on a CPU machine).
        config = ["--config_file", "recipes/accelerate/1node_4gpu.yaml", "--num_processes", "2"]
        return [python_bin("accelerate"), "launch", *config, "--main_process_port", str(port), script]
    if mode == "deepspeed":
        return [python_bin("deepspeed"), "--num_gpus", "2", "--master_port", str(port), script]
    return [python_bin("python"), script, "--parallel_trials", "2"]


def row_id(row) -> str:
    mode, features = row
    return f"{mode.replace(' ', '_')}-{'-'.join(value.replace(' ', '_') for value in features)}"


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize("row", ROWS, ids=[row_id(row) for row in ROWS])
def test_launch_mode_with_features(row, tmp_path, tiny_model_dir, alpaca_sample):
    mode, features = row
    searching = "search" in features
    output_dir = tmp_path / "run"
    flags = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(output_dir)]
    flags += ["--dataset", str(alpaca_sample("alpaca_en_demo.json"))]  # 200 records: a few seconds of evaluation
    flags += [flag for value in features for flag in FLAGS.get(value, [])]
    script = SEARCH_RECIPE if searching else RECIPE
    command = [*launch_line(mode, script, free_port()), *flags, *(SEARCH if searching else SHORT)]
    result = run_command(command, timeout=400)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-4000:])
    if searching:
        check_search(output_dir, features)
    else:
        check_training(output_dir, features, tiny_model_dir, processes=1 if mode == "one process" else 2)


def check_training(output_dir: Path, features: tuple[str, ...], tiny_model_dir: Path, processes: int) -> None:
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == processes
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"], metrics
    training = json.loads((output_dir / "run_config.json").read_text())["training"]
    assert training["bf16"] == ("bf16" in features)
    assert training["gradient_accumulation_steps"] == (2 if "accumulation" in features else 1)
    deepspeed_ran = (output_dir / "checkpoint-6" / "global_step6").is_dir()
    assert deepspeed_ran == any(preset in features for preset in ("zero2", "zero3", "offload"))
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert (state["best_model_checkpoint"] is not None) == ("early stopping" in features)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if "LoRA" in features or "QLoRA" in features:
        trained = PeftModel.from_pretrained(base, output_dir).merge_and_unload().state_dict()
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    else:
        trained = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()  # whole, also from ZeRO-3
    weights = base.state_dict()
    assert trained.keys() == weights.keys() and any(not torch.equal(trained[key], weights[key]) for key in weights)


def check_search(output_dir: Path, features: tuple[str, ...]) -> None:
    journal, database = output_dir / "optuna_journal.log", output_dir / "optuna_study.db"  # parallel or not
    study_file = journal if journal.exists() else database
    study = load_study(str(study_file))
    ran = [t for t in study.trials if NOT_RUN not in t.user_attrs]
    assert [t.state.name for t in ran] == ["COMPLETE", "COMPLETE"], [(t.state.name, t.user_attrs) for t in ran]
    best = json.loads((output_dir / "best_run.json").read_text())
    assert (int(best["best_trial"]), best["objective"]) == (study.best_trial.number, study.best_value)
    saved = json.loads((output_dir / "best-model" / "hpo_best_trial.json").read_text())
    assert saved["number"] == study.best_trial.number
    adapters = (output_dir / "best-model" / "adapter_model.safetensors").is_file()
    assert adapters == ("LoRA" in features or "QLoRA" in features)
    assert adapters or (output_dir / "best-model" / "model.safetensors").is_file()
    # The search's run_config.json says how the base was loaded: the best model merges as it was trained, unasked.
    model = json.loads((output_dir / "run_config.json").read_text())["model"]
    assert model["quantization"] == ("nf4" if "QLoRA" in features else None)
    if adapters:
        merged = export_run(output_dir / "best-model", output_dir.parent / "merged", merge_lora=True)
        assert (merged / "model.safetensors").is_file()
