"""A rank killed with SIGKILL right after a checkpoint ends the whole job (non-zero, naming the dead rank, no
hang); restarted with `--resume`, the run ends with the unbroken run's weights: optimizer, scheduler, RNG and
data order all come back. 2 processes: DDP (rank 1 dies), ZeRO-3 (rank 0 dies); ZeRO-2's resumes are those of
test_kills_during_saves.py. A single process killed during saves is tests/test_checkpoints.py.
"""

import re

import pytest
from safetensors.torch import load_file

from hf_scale.checkpoints import last_complete_checkpoint
from tests.helpers import assert_same_weights, assert_succeeded, run_command, torchrun

WORKER = "tests/distributed/ddp_worker.py"
STEPS = ["--max_steps", "20", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "10"]  # as conftest's
pytestmark = pytest.mark.slow


def launch(output_dir, *flags):
    # the hard timeout is also the no-hang check: a live rank would otherwise wait for the dead one forever
    return run_command(torchrun(WORKER, "--output_dir", str(output_dir), *STEPS, *flags), timeout=400)


@pytest.mark.parametrize("preset, dead_rank", [(None, 1), ("zero3", 0)], ids=["ddp", "zero3"])
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


def test_killed_qlora_run_resumes_to_the_unbroken_adapters(tmp_path, tiny_model_dir):
    """A QLoRA run (NF4 base, LoRA on q/v) on 2 processes, rank 1 killed after checkpoint 10 and resumed, ends with
    the unbroken run's adapters; its checkpoints hold the adapters only."""
    flags = ["--quantization", "nf4", "--lora"]
    unbroken = tmp_path / "unbroken"
    assert_succeeded(finished := launch(unbroken, *flags), finished.stderr[-3000:])
    broken = tmp_path / "broken"
    killed = launch(broken, *flags, "--kill_after_checkpoint", "10", "--kill_rank", "1")
    assert killed.returncode != 0 and last_complete_checkpoint(broken) == broken / "checkpoint-10"
    saved = sorted(path.name for path in (broken / "checkpoint-10").glob("*.safetensors"))
    assert saved == ["adapter_model.safetensors"]  # no copy of the base in a checkpoint
    resumed = launch(broken, *flags, "--resume", "true")
    assert_succeeded(resumed, resumed.stderr[-3000:])
    adapters = load_file(unbroken / "rank0.safetensors")
    assert len(adapters) == 12 and all("lora_" in name for name in adapters)  # 3 layers x q/v x A/B
    assert any("lora_B" in name and tensor.abs().sum() > 0 for name, tensor in adapters.items())  # it trained
    for rank in (0, 1):
        assert_same_weights(unbroken / f"rank{rank}.safetensors", broken / f"rank{rank}.safetensors")
