"""Helpers for tests that launch processes: environment, hard timeouts, console scripts, free ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_scale.hpo.parallel import free_port  # tests import it from here too

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def launch_env(**extra: str) -> dict[str, str]:
    """Environment for a launched training process: one thread, offline, CPU DeepSpeed, no stray launcher vars."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(REPO_ROOT),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
    env.update(extra)
    return env


def run_command(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run a command with a hard timeout (a hang fails the test instead of stalling CI); output is kept."""
    return subprocess.run(
        args, cwd=REPO_ROOT, env=launch_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )


# The exit abort of issue 17 item 5 (a gloo worker thread ending inside a noexcept destructor while Python
# finalizes; hf_scale.distributed.release_gil_to_collectives_at_exit). hf_scale's exit handler removes it in the
# measured cases; should it still happen, the test is reported as an expected failure (listed in the summary with this
# reason, so it stays visible) instead of failing CI. Any other non-zero exit fails.
EXIT_ABORT = "terminate called without an active exception"


def assert_succeeded(result: subprocess.CompletedProcess, message: str = "") -> None:
    """The command exited 0; otherwise the failure shows `message`, by default the end of its stderr."""
    if result.returncode != 0 and EXIT_ABORT in result.stderr and "SIGABRT" in result.stderr:
        pytest.xfail(f"the exit SIGABRT of issue 17 item 5 came back: {EXIT_ABORT}")
    assert result.returncode == 0, message or result.stderr[-3000:]


def python_bin(name: str) -> str:
    """A console script (torchrun, accelerate, deepspeed) from the environment running the tests."""
    return str(Path(sys.executable).parent / name)


def torchrun(script: str, *args: str, processes: int = 2, max_restarts: int = 0) -> list[str]:
    """The command line that starts `script` on `processes` local processes on a free port.

    With `max_restarts`, torchrun restarts the whole group when a process dies; that needs the c10d rendezvous and,
    in the environment, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see hf_scale.distributed.check_elastic_restarts).
    """
    if max_restarts:
        endpoint = ["--max_restarts", str(max_restarts), "--rdzv_backend", "c10d", "--rdzv_endpoint"]
        endpoint.append(f"127.0.0.1:{free_port()}")
    else:
        endpoint = ["--master_port", str(free_port())]
    return [python_bin("torchrun"), "--nproc_per_node", str(processes), *endpoint, script, *args]


def assert_same_weights(expected_file: Path, actual_file: Path, atol: float = 1e-6) -> None:
    """Two safetensors files hold the same tensors, name by name, within `atol`."""
    import torch
    from safetensors.torch import load_file

    expected, actual = load_file(expected_file), load_file(actual_file)
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.allclose(tensor, actual[name], atol=atol, rtol=0), name


def train_recipe(output_dir: Path, *flags: str, launcher: tuple[str, ...] = (sys.executable,)) -> Path:
    """A recipe run into `output_dir`; what it printed is kept beside it, in `<output_dir>.log`."""
    command = [*launcher, "recipes/finetune_llama2.py", "--output_dir", str(output_dir), *flags]
    result = run_command(command, timeout=600, OMP_NUM_THREADS="2")
    assert_succeeded(result, result.stderr[-3000:])
    output_dir.with_suffix(".log").write_text(result.stdout)
    return output_dir
