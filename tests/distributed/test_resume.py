"""A rank killed with SIGKILL right after a checkpoint ends the whole job (non-zero, naming the dead rank, no
hang); restarted with `--resume`, the run ends with the unbroken run's weights: optimizer, scheduler, RNG and
data order all come back. 2 processes: DDP and ZeRO-2 (rank 1 dies), ZeRO-3 (rank 0 dies). A single process
killed during saves is tests/test_checkpoints.py.
"""

import re

import pytest

from hf_scale.checkpoints import last_complete_checkpoint
from tests.helpers import assert_same_weights, assert_succeeded, run_command, torchrun

WORKER = "tests/distributed/ddp_worker.py"
STEPS = ["--max_steps", "20", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "10"]  # as conftest's
pytestmark = pytest.mark.slow


def launch(output_dir, *flags):
    # the hard timeout is also the no-hang check: a live rank would otherwise wait for the dead one forever
    return run_command(torchrun(WORKER, "--output_dir", str(output_dir), *STEPS, *flags), timeout=400)


@pytest.mark.parametrize("preset, dead_rank", [(None, 1), ("zero2", 1), ("zero3", 0)], ids=["ddp", "zero2", "zero3"])
def test_killed_rank_ends_the_job_and_resume_reaches_the_unbroken_weights(tmp_path, reference_run, preset, dead_rank):
    flags = ["--zero_preset", preset] if preset else []
    unbroken = reference_run(preset).folder

    broken = tmp_path / "broken"
    killed = launch(broken, *flags, "--kill_after_checkpoint", "10", "--kill_rank", str(dead_rank))
    assert killed.returncode != 0 and not (broken / "rank0.json").exists()
    named = rf"rank\s*: {dead_rank} \(local_rank: {dead_rank}\)\s+exitcode\s*: -9"
    assert re.search(named, killed.stderr), killed.stderr[-2000:]
    assert last_complete_checkpoint(broken) == broken / "checkpoint-10"

    resumed = launch(broken, *flags, "--resume", "true")
    assert_succeeded(resumed, resumed.stderr[-3000:])
    for rank in (0, 1):
        assert_same_weights(unbroken / f"rank{rank}.safetensors", broken / f"rank{rank}.safetensors")
