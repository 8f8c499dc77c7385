"""Preference tuning on 2 real processes (torchrun, gloo; DDP, ZeRO-2 and ZeRO-3) trains what one process with
accumulation 2 trains: the same 4 pairs per optimizer step, ln 2 before the first step, the loss at every step and
the trained weights within 1e-5 (fp32). Under ZeRO-3 the reference is precomputed through the engine."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from tests.helpers import assert_succeeded, run_command, torchrun

WORKER = "tests/preference/preference_worker.py"
pytestmark = pytest.mark.slow
TOLERANCE = 1e-5


def run(folder, processes: int, *flags: str):
    common = ["--output_dir", str(folder), "--max_steps", "4", "--logging_steps", "1", "--learning_rate", "1e-4"]
    common += ["--warmup_steps", "0", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true"]
    accumulation = 2 // processes
    common += ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", str(accumulation)]
    return run_command(torchrun(WORKER, *common, *flags, processes=processes), timeout=400)


def launch(folder, processes: int, *flags: str) -> tuple[list[float], dict]:
    result = run(folder, processes, *flags)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-4000:])
    report = json.loads((folder / "losses.json").read_text())
    return report, load_file(folder / "trained.safetensors")


FULL = ["--reference", "precomputed"]
LORA = ["--lora_r", "8", "--lora_dropout", "0"]  # no dropout: each process would draw its own masks
QLORA = [*LORA, "--quantization", "nf4"]


@pytest.mark.parametrize(
    ("flags", "strategy", "reference"),
    [
        (FULL, "ddp", "precomputed"),
        (["--reference", "model"], "ddp", "model"),
        ([*LORA, "--reference", "precomputed"], "ddp", "precomputed"),
        (LORA, "ddp", "adapters_off"),
        (QLORA, "ddp", "adapters_off"),
        (FULL, "zero2", "precomputed"),
        (LORA, "zero2", "adapters_off"),
        (FULL, "zero3", "precomputed"),
        (LORA, "zero3", "precomputed"),
    ],
    ids=[
        "full-ddp",
        "full-ref-model-ddp",
        "lora-precomputed-ddp",
        "lora-ddp",
        "qlora-ddp",
        "full-zero2",
        "lora-zero2",
        "full-zero3",
        "lora-zero3",
    ],
)
def test_two_processes_train_as_one_with_accumulation_2(tmp_path, tiny_model_dir, flags, strategy, reference):
    """2 processes (DDP, or ZeRO-2) against the plain single process with accumulation 2."""
    one, one_weights = launch(tmp_path / "one", 1, *flags)
    zero = [] if strategy == "ddp" else ["--zero_preset", strategy]
    two, two_weights = launch(tmp_path / "two", 2, *flags, *zero)
    one_process = "adapters_off" if "--lora_r" in flags and "--reference" not in flags else reference
    assert two["reference"] == reference and one["reference"] == one_process
    for report in (one, two):  # before the first step the policy is its reference
        assert abs(report["step0"]["eval_loss"] - math.log(2)) < 1e-5, report["step0"]
        assert abs(report["step0"]["eval_rewards/margins"]) < 1e-5
    assert len(one["losses"]) == len(two["losses"]) == 4
    gap = max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True))
    assert gap <= TOLERANCE, (one["losses"], two["losses"])
    assert one_weights.keys() == two_weights.keys() and one_weights
    gaps = {key: (one_weights[key] - two_weights[key]).abs().max().item() for key in one_weights}
    assert max(gaps.values()) <= TOLERANCE, sorted(gaps.items(), key=lambda item: -item[1])[:3]


def test_reference_model_and_adapters_off_are_refused_under_zero3_before_any_step(tmp_path, tiny_model_dir):
    result = run(tmp_path, 2, *LORA, "--zero_preset", "zero3", "--reference", "adapters_off")
    assert result.returncode != 0
    assert "reference: adapters_off does not run under ZeRO-3" in result.stderr
    assert not (tmp_path / "losses.json").exists()
