"""Real multi-process runs on CPU: torchrun, gloo, one thread per process, a hard timeout on each launch."""

import json
import subprocess
import time

import pytest

from hf_scale.checkpoints import last_complete_checkpoint
from tests.helpers import assert_succeeded, free_port, python_bin, run_command, start, torchrun

WORKER = "tests/distributed/ddp_worker.py"
pytestmark = pytest.mark.slow


def reports(output_dir, world_size):
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


# The first is the fast tier's smoke run (make check): one real 2-process launch.
@pytest.mark.parametrize(
    "evaluate_first",
    [pytest.param(False, marks=pytest.mark.smoke, id="train"), pytest.param(True, id="evaluate-then-train")],
)
def test_two_processes_train_as_one_ddp_model(tmp_path, tiny_model_dir, evaluate_first):
    flags = ["--evaluate_first"] if evaluate_first else []
    result = run_command(torchrun(WORKER, "--output_dir", str(tmp_path), *flags), timeout=300)
    assert_succeeded(result, result.stderr[-3000:])
    rank0, rank1 = reports(tmp_path, 2)
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["wrapper"] == rank1["wrapper"] == "DistributedDataParallel"
    assert rank0["end_digest"] == rank1["end_digest"]  # identical replicas after training
    assert rank0["end_digest"] != rank0["start_digest"]  # and they did train
    assert "effective batch 16 = 8 per device x 2 data-parallel process(es) x 1 accumulation step(s)" in result.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--auto_cpu_ddp", "false"],
            "the launcher started 2 processes (WORLD_SIZE=2) but this process sees world size 1",
        ),
        (["--auto_cpu_ddp", "false", "--ddp_backend", "gloo"], "distributed mode is NO"),
    ],
)
def test_unguarded_cpu_runs_are_refused(tmp_path, tiny_model_dir, flags, message):
    result = run_command(torchrun(WORKER, "--output_dir", str(tmp_path), *flags), timeout=300)
    assert result.returncode != 0
    assert message in result.stderr
    assert not list(tmp_path.glob("rank*.json"))  # nobody trained


def on_two_nodes(*flags: str) -> tuple[list[int], list[str]]:
    """Run the worker as two single-process nodes on loopback (one torchrun each): exit codes and stderrs."""
    port = str(free_port())
    nodes = [
        start(
            [
                python_bin("torchrun"),
                "--nnodes",
                "2",
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                WORKER,
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [node.returncode for node in nodes], [stderr for _, stderr in outputs]


def test_two_nodes_on_loopback_train_together(tmp_path, tiny_model_dir):
    returncodes, stderrs = on_two_nodes("--output_dir", str(tmp_path))
    assert returncodes == [0, 0], stderrs[0][-2000:] + stderrs[1][-2000:]
    node0, node1 = reports(tmp_path, 2)
    assert node0["world_size"] == node1["world_size"] == 2
    assert node0["wrapper"] == node1["wrapper"] == "DistributedDataParallel"
    assert node0["end_digest"] == node1["end_digest"] != node0["start_digest"]


def test_a_save_that_fails_on_one_node_ends_both_with_its_reason_and_no_partial_checkpoint(tmp_path, tiny_model_dir):
    """Two nodes (no launcher watches both): node 1's checkpoint save fails with a full disk. Both processes stop
    at once with the reason, and the partial folder is removed once nobody writes into it. Before, node 1 raised
    alone and removed the folder node 0 was still writing; node 0 stopped with gloo's "Connection closed by peer"
    at its next collective (with NCCL, which does not see a closed peer, it would wait for ddp_timeout)."""
    flags = ["--output_dir", str(tmp_path), "--save_strategy", "steps", "--save_steps", "2"]
    started = time.monotonic()
    returncodes, stderrs = on_two_nodes(*flags, "--fail_save_step", "4", "--fail_save_rank", "1")
    seconds = time.monotonic() - started
    assert returncodes == [1, 1], stderrs[0][-3000:] + stderrs[1][-3000:]
    assert seconds < 120, f"the job took {seconds:.0f} s: a node waited for the failed one"
    for stderr in stderrs:
        assert "could not save checkpoint" in stderr and "checkpoint-4" in stderr and "rank 1" in stderr, stderr[-3000:]
        assert "No space left on device" in stderr
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]  # no partial checkpoint-4
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
