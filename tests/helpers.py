"""Helpers for tests that launch processes: environment, the preloaded launcher, hard timeouts, console scripts, free
ports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from hf_scale.distributed import free_port  # tests import it from here too
from tests import preloaded

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


# The test being run (set by tests/conftest.py): the fast tier (make check) refuses a launch outside its smoke test.
current_test: pytest.Item | None = None


def launch_env(**extra: str) -> dict[str, str]:
    """Environment for a launched training process: one thread, offline, CPU DeepSpeed, no stray launcher vars.

    Every launch of the suite takes its environment from here, so this is where the fast tier refuses one."""
    if os.environ.get("HF_SCALE_TEST_TIER") == "fast" and not (
        current_test and current_test.get_closest_marker("smoke")
    ):
        name = current_test.nodeid if current_test else "a collection-time launch"
        pytest.fail(
            f"{name} launches a process: mark it slow (the fast tier, make check, launches only its smoke test)"
        )
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


def launched(args: list[str], fresh: bool = False, **extra: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that launch `args`: a Python program of this environment starts forked from
    the preloaded server (tests/preloaded), unless `fresh` asks for a new interpreter (what the test checks depends
    on one: an installed wheel, a package made unimportable, interpreter exit, a real terminal)."""
    env = launch_env(**extra)
    log_launch(args, fresh)
    return (args if fresh else preloaded.command(args, env, server_env=launch_env())), env


def log_launch(args: list[str], fresh: bool) -> None:
    """With HF_SCALE_TEST_LAUNCH_LOG set, one JSON line per launch (the test, the program, fresh or forked): how the
    suite's launches are counted (tests/README.md). The preloaded server adds a line per process it forks."""
    if log := os.environ.get("HF_SCALE_TEST_LAUNCH_LOG"):
        line = {"test": current_test.nodeid if current_test else None, "program": Path(args[0]).name, "fresh": fresh}
        with open(log, "a") as file:
            file.write(json.dumps(line) + "\n")


def run_command(args: list[str], timeout: float, fresh: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run a command with a hard timeout (a hang fails the test instead of stalling CI); output is kept."""
    command, environment = launched(args, fresh, **env)
    return subprocess.run(
        command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=timeout, check=False
    )


def start(args: list[str], fresh: bool = False, extra_env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """Start a launch (see `launched`) without waiting for it, in the repository; `popen` goes to Popen."""
    command, env = launched(args, fresh, **(extra_env or {}))
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, **popen)


def assert_succeeded(result: subprocess.CompletedProcess, message: str = "") -> None:
    """The command exited 0; otherwise the failure shows `message`, by default the end of its stderr."""
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


def train_recipe(
    output_dir: Path, *flags: str, launcher: tuple[str, ...] = (sys.executable,), fresh: bool = False
) -> Path:
    """A recipe run into `output_dir`; what it printed is kept beside it, in `<output_dir>.log`."""
    command = [*launcher, "recipes/finetune_llama2.py", "--output_dir", str(output_dir), *flags]
    result = run_command(command, timeout=600, fresh=fresh)
    assert_succeeded(result, result.stderr[-3000:])
    output_dir.with_suffix(".log").write_text(result.stdout)
    return output_dir


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """`hf-scale ARGV` in this process (the same entry point without a launch): its exit code and what it printed."""
    from hf_scale.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's errors and --help
        code = exit_.code if isinstance(exit_.code, int) else 1
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["hf-scale", *argv], code, printed.out, printed.err)


def run_once(shared_dir: Path, name: str, build: Callable[[Path], object]) -> Path:
    """`shared_dir/name`, built by `build(folder)` by the first worker that asks; the others wait for it, and get
    its error again if it failed (a failed build is not retried by every worker)."""
    folder, failed = shared_dir / name, shared_dir / f"{name}.failed"
    with FileLock(f"{shared_dir / name}.lock"):
        if failed.exists():
            pytest.fail(f"building {name} failed in another worker:\n{failed.read_text()}")
        if not (shared_dir / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            try:
                build(folder)
            except BaseException as error:
                failed.write_text(str(error)[-5000:])
                raise
            (shared_dir / f"{name}.done").touch()
    return folder
