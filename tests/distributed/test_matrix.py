"""The options users combine, pairwise: processes x precision x accumulation x packing x LoRA x strategy x
gradient checkpointing, each row a real launch (torchrun, gloo, DS_ACCELERATOR=cpu), 6 steps of 8 examples.

Every row keeps the same 8 examples per optimizer step (micro-batch = 8 / processes / accumulation steps), so
what must be equal is: every fp32 row trains the weights of the plain one-process fp32 run of the same tuning
(full or LoRA) within 1e-5, and its loss at every step and its final eval loss within 1e-5. That holds
accumulation 2 x micro-batch 4 against accumulation 1 x micro-batch 8 (under DDP and ZeRO-2), packed rows against
padded ones, gradient checkpointing against none, ZeRO-2/3 against DDP, 2 processes against 1. bf16 rows (autocast;
fp32 weights, or DeepSpeed's fp32 master weights) follow the fp32 loss within 0.02 at every step.
"""

import itertools
import json

import pytest
from safetensors.torch import load_file

from tests.helpers import assert_succeeded, run_command, run_once, torchrun

WORKER = "tests/distributed/ddp_worker.py"
FACTORS = {
    "processes": (1, 2),
    "dtype": ("fp32", "bf16"),
    "accumulation": (1, 2),
    "packing": (False, True),
    "tuning": ("full", "lora"),
    "strategy": ("ddp", "zero2", "zero3"),
    "checkpointing": (False, True),
}
# The first two rows are the references; the next two the equalities the issue names; the last five cover every
# pair of values (the fewest: given the four above, no four rows cover bf16, packing and checkpointing both ways).
ROWS = [
    (1, "fp32", 1, False, "full", "ddp", False),
    (1, "fp32", 1, False, "lora", "ddp", False),
    (2, "fp32", 2, False, "full", "ddp", False),
    (2, "fp32", 2, False, "full", "zero2", False),
    (2, "fp32", 1, True, "full", "zero3", True),
    (2, "bf16", 1, True, "lora", "ddp", True),
    (1, "bf16", 1, True, "lora", "zero2", True),
    (1, "bf16", 2, False, "full", "zero3", True),
    (2, "bf16", 2, True, "lora", "zero3", False),
]
EXAMPLES_PER_STEP, STEPS = 8, 6
FP32_TOLERANCE, BF16_LOSS_TOLERANCE = 1e-5, 0.02


def row_id(row) -> str:
    values = dict(zip(FACTORS, row, strict=True))
    parts = [f"{values['processes']}proc", values["dtype"], f"acc{values['accumulation']}", values["tuning"]]
    parts += [values["strategy"], *(["packed"] * values["packing"]), *(["ckpt"] * values["checkpointing"])]
    return "-".join(parts)


def test_rows_cover_every_pair_of_values():
    names = list(FACTORS)
    wanted = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in FACTORS[a] for y in FACTORS[b]}
    rows = [dict(zip(names, row, strict=True)) for row in ROWS]
    covered = {((a, row[a]), (b, row[b])) for row in rows for a, b in itertools.combinations(names, 2)}
    assert wanted <= covered, sorted(wanted - covered)


def flags(row) -> list[str]:
    processes, dtype, accumulation, packing, tuning, strategy, checkpointing = row
    micro_batch = EXAMPLES_PER_STEP // processes // accumulation
    result = ["--max_steps", str(STEPS), "--logging_steps", "1", "--per_device_train_batch_size", str(micro_batch)]
    result += ["--gradient_accumulation_steps", str(accumulation), "--use_cpu", "true", "--save_final"]
    if dtype == "bf16":
        result += ["--bf16", "true"]
    if packing:
        result.append("--packing")
    if tuning == "lora":
        result.append("--lora")
    if strategy != "ddp":
        result += ["--zero_preset", strategy]
    if checkpointing:
        result += ["--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
    return result


@pytest.fixture(scope="session")
def runs(shared_dir, tiny_model_dir):
    """`runs(row)`: that row run once in this test run (the references are shared by every test that compares with
    them, across pytest-xdist workers): rank 0's report and weights."""

    def launch(folder, row) -> None:
        command = torchrun(WORKER, "--output_dir", str(folder), *flags(row), processes=row[0])
        result = run_command(command, timeout=400)
        assert_succeeded(result, row_id(row) + result.stdout[-2000:] + result.stderr[-4000:])

    def run(row):
        folder = run_once(shared_dir, f"matrix-{row_id(row)}", lambda folder: launch(folder, row))
        return json.loads((folder / "rank0.json").read_text()), load_file(folder / "rank0.safetensors")

    return run


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS[2:], ids=row_id)
def test_row_trains_as_the_plain_fp32_run_does(runs, row):
    report, weights = runs(row)
    reference = next(r for r in ROWS[:2] if r[4] == row[4])  # the plain run of the same tuning
    reference_report, reference_weights = runs(reference)
    assert report["world_size"] == row[0] and report["effective_batch_size"] == EXAMPLES_PER_STEP
    assert len(report["losses"]) == STEPS
    assert reference_report["losses"][-1] < reference_report["losses"][0]  # the reference learns
    loss_gap = max(abs(a - b) for a, b in zip(report["losses"], reference_report["losses"], strict=True))
    if row[1] == "bf16":
        assert loss_gap <= BF16_LOSS_TOLERANCE, (report["losses"], reference_report["losses"])
        return
    assert loss_gap <= FP32_TOLERANCE, (report["losses"], reference_report["losses"])
    assert report["final_eval_loss"] == pytest.approx(reference_report["final_eval_loss"], abs=FP32_TOLERANCE)
    assert weights.keys() == reference_weights.keys()
    gaps = {name: (weights[name] - reference_weights[name]).abs().max().item() for name in weights}
    assert max(gaps.values()) <= FP32_TOLERANCE, sorted(gaps.items(), key=lambda item: -item[1])[:3]
    assert report["end_digest"] != report["start_digest"]  # it trained (a run that trains nothing matches nothing)
