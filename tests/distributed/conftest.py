"""Unbroken reference runs, shared: the preset tests compare losses with them, the fault tests weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import assert_succeeded, run_command, run_once, torchrun

WORKER = "tests/distributed/ddp_worker.py"
# 20 steps of batch 8 per rank, a loss logged each step, checkpoints at 10 and 20, evaluated and saved at the end.
REFERENCE_FLAGS = [
    "--max_steps", "20", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "10", "--save_final",
]  # fmt: skip


@dataclass
class ReferenceRun:
    """A finished 2-process run: its folder (rank<N>.json, rank<N>.safetensors, final/) and its output."""

    folder: Path
    stdout: str
    reports: list[dict]


@pytest.fixture(scope="session")
def reference_run(shared_dir, tiny_model_dir) -> Callable[[str | None], ReferenceRun]:
    """`reference_run(preset)`: the unbroken 2-process run with that ZeRO preset (None: plain DDP), run once."""

    def launch(folder: Path, preset: str | None) -> None:
        flags = [*REFERENCE_FLAGS, *(["--zero_preset", preset] if preset else [])]
        result = run_command(torchrun(WORKER, "--output_dir", str(folder), *flags), timeout=400)
        assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
        (folder / "stdout.log").write_text(result.stdout)

    def run(preset: str | None) -> ReferenceRun:
        folder = run_once(shared_dir, f"reference-{preset or 'ddp'}", lambda folder: launch(folder, preset))
        reports = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        return ReferenceRun(folder, (folder / "stdout.log").read_text(), reports)

    return run
