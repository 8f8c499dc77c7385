"""The planner's bytes per GPU match what a real DeepSpeed engine holds on each rank (2 processes, bf16, CPU)."""

import json

import pytest

from hf_scale.hardware import get_gpu
from hf_scale.memory import Workload, estimate
from hf_scale.model_shapes import model_shape
from tests.helpers import assert_succeeded, run_command, torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("preset", ["zero1", "zero2", "zero3"])
def test_planner_matches_the_engines_tensors(tmp_path, tiny_model_dir, preset):
    result = run_command(
        torchrun("tests/distributed/zero_memory_worker.py", preset, str(tmp_path)), timeout=400, OMP_NUM_THREADS="1"
    )
    assert_succeeded(result, result.stderr[-3000:])
    # The GPU only sets the fits/time columns; model states depend on parameters and processes alone.
    planned = estimate(model_shape(str(tiny_model_dir)), Workload(gpu=get_gpu("a100-80g"), gpus_per_node=2), preset)
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind in ("parameters", "gradients", "optimizer_states"):
            assert held[kind] == pytest.approx(getattr(planned, kind), rel=0.05), (rank, kind, held)
