"""bench/gpu_throughput.py runs end to end on CPU with --size tiny, without DeepSpeed, and writes its table as JSON."""

import json
import sys

import pytest

from tests.helpers import SHARED_DATA, assert_succeeded, run_command, run_once

pytestmark = pytest.mark.slow

MODES = ("a_trainer_padded", "b_scale_padded", "c_scale_packed", "d_scale_packed_checkpointing")
# The GPU machine has no deepspeed: hide it (find_spec then answers None, as when it is not installed).
WITHOUT_DEEPSPEED = (
    "import runpy, sys; sys.modules['deepspeed'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.fixture(scope="session")
def result(shared_dir):
    """One bench run (about 20 s alone, 40 s on two busy cores), read by every test here."""

    def bench(folder):
        folder.mkdir()
        command = [sys.executable, "-c", WITHOUT_DEEPSPEED, "bench/gpu_throughput.py", "--size", "tiny"]
        command += ["--steps", "3", "--warmup-steps", "1", "--batch-size", "4", "--max-length", "128"]
        completed = run_command([*command, "--output", str(folder / "gpu_throughput.json")], timeout=300)
        assert_succeeded(completed, completed.stderr[-3000:])
        (folder / "stdout.log").write_text(completed.stdout)

    folder = run_once(shared_dir, "bench-gpu-throughput", bench)
    return json.loads((folder / "gpu_throughput.json").read_text()), (folder / "stdout.log").read_text()


def test_all_four_modes_are_measured(result):
    recorded, _ = result
    assert list(recorded["rows"]) == list(MODES)
    for row in recorded["rows"].values():
        assert "error" not in row, row
        assert row["real_tokens_per_second"] > 0
        assert row["steps"] == 3
        # real tokens never exceed the tokens of the batches, and packing has no padding at all
        assert row["real_tokens_per_second"] <= row["batch_tokens_per_second"] * (1 + 1e-9)
        assert row["tflops"] == pytest.approx(row["real_tokens_per_second"] * row["flops_per_token"] / 1e12)
        assert row["mfu"] == pytest.approx(row["tflops"] / recorded["peak_tflops_measured"])
        assert row["planner_peak_gib"] > row["planner_allocated_gib"] > 0
        assert row["peak_memory_gib"] is None  # CUDA max allocated: not measured on CPU
        assert row["model_freed"] is True  # nothing keeps a mode's model (and its GPU memory) alive
    rows = recorded["rows"]
    assert rows["c_scale_packed"]["real_tokens_per_second"] == pytest.approx(
        rows["c_scale_packed"]["batch_tokens_per_second"]
    )
    assert rows["a_trainer_padded"]["trainer"] == "Trainer"
    assert rows["d_scale_packed_checkpointing"]["gradient_checkpointing"] is True
    # (a) and (b) see the same batches in the same order; so do (c) and (d)
    assert rows["a_trainer_padded"]["real_tokens"] == rows["b_scale_padded"]["real_tokens"]
    assert rows["c_scale_packed"]["real_tokens"] == rows["d_scale_packed_checkpointing"]["real_tokens"]
    assert rows["a_trainer_padded"]["largest_micro_batch"][0] == 4
    assert rows["c_scale_packed"]["largest_micro_batch"][0] == 1


def test_ratios_are_computed(result):
    recorded, _ = result
    rows, ratios = recorded["rows"], recorded["ratios"]

    def tokens(mode):
        return rows[mode]["real_tokens_per_second"]

    assert ratios["b_over_a"] == pytest.approx(tokens("b_scale_padded") / tokens("a_trainer_padded"))
    assert ratios["c_over_a"] == pytest.approx(tokens("c_scale_packed") / tokens("a_trainer_padded"))
    assert ratios["d_over_c"] == pytest.approx(tokens("d_scale_packed_checkpointing") / tokens("c_scale_packed"))
    assert isinstance(recorded["criteria"]["b_over_a >= 0.98"], bool)
    assert recorded["criteria"]["mfu_c >= 0.5 (H100/H200)"] is None  # no GPU here
    assert recorded["criteria"]["planner within 10 % (a, c, d)"] is None


def test_it_runs_without_deepspeed_on_real_data_and_prints_the_table_last(result):
    recorded, stdout = result
    assert recorded["deepspeed_imported"] is False
    if SHARED_DATA.is_dir():
        assert recorded["data"]["source"].endswith("alpaca_en_demo.json")
        assert recorded["data"]["records"] == 999  # examples: fewer, those whose prompt fills 128 tokens drop
    last_lines = stdout.strip().splitlines()[-5:]
    assert last_lines[0].startswith("mode")
    assert [line.split()[0] for line in last_lines[1:]] == list(MODES)
