"""Long runs: what accumulates over hundreds of evaluations stays flat.

One process in bf16 with 600 evaluations (one after every step) and two processes with 300, each checkpointing
every 100 steps with save_total_limit=2: the number of wrappers around `forward`, the resident memory and the
CPU time of a step (with its evaluation) are the same in the last hundred steps as in the first hundred, and the disk
holds the limit. In one bf16 process every evaluation used to wrap `forward` again (autocast + fp32 outputs), 3
wrappers more each time, until a RecursionError at evaluation 239. CPU times are compared within one run, with room
for a noisy machine (the last hundred steps' median at most twice the first's); CPU rather than wall time, so that
the other tests running beside this one (pytest-xdist) cannot move the comparison.
"""

import json
import statistics

import pytest

from tests.helpers import assert_succeeded, python_bin, run_command, torchrun

pytestmark = pytest.mark.slow
LIMIT = 2


@pytest.mark.parametrize("processes, steps", [(1, 600), (2, 300)], ids=["1-process-600-evaluations", "2-processes-300"])
def test_depth_memory_and_step_time_stay_flat(tmp_path, tiny_model_dir, processes, steps):
    if processes == 1:  # no launcher, as on one GPU: under torchrun even one process is DDP-wrapped
        command = [python_bin("python"), "tests/long_run_worker.py", str(tmp_path), str(steps)]
    else:
        command = torchrun("tests/long_run_worker.py", str(tmp_path), str(steps), processes=processes)
    result = run_command(command, timeout=900)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-4000:])
    for rank in range(processes):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world_size"] == processes and len(report["depths"]) == steps
        assert all(depths == report["depths"][0] for depths in report["depths"]), report["depths"][:5]
        first, last = report["resident"][100:200], report["resident"][-100:]  # after the first checkpoint's growth
        assert max(last) <= 1.05 * max(first), (max(first) / 2**20, max(last) / 2**20)
        early, late = report["step_cpu_seconds"][10:110], report["step_cpu_seconds"][-100:]
        assert statistics.median(late) <= 2 * statistics.median(early), (
            statistics.median(early),
            statistics.median(late),
        )
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert max(rank0["kept"].values()) <= LIMIT and len(rank0["final_checkpoints"]) == LIMIT
    assert max(rank0["disk"].values()) <= (LIMIT + 0.5) * rank0["checkpoint_bytes"]  # the limit, runs/ etc.
