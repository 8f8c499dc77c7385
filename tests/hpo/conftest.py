"""Helpers of the hpo tests: run the search worker (one process or torchrun) and read what each rank wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_succeeded, python_bin, run_command, torchrun

WORKER = "tests/hpo/search_worker.py"


def run_search(output_dir: Path, *flags: str, processes: int = 1, timeout: float = 400) -> list[dict]:
    """Run the worker with a hard timeout (a hang fails the test); return each rank's report."""
    command = (
        [python_bin("python"), WORKER, "--output_dir", str(output_dir), *flags]
        if processes == 1
        else torchrun(WORKER, "--output_dir", str(output_dir), *flags, processes=processes)
    )
    result = run_command(command, timeout=timeout)
    assert_succeeded(result, result.stdout[-3000:] + result.stderr[-5000:])
    return [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]


def trials_seen(report: dict) -> list[tuple]:
    """(number, params, state, value) of every trial one rank ran, in order."""
    return [(o["number"], o["params"], o["state"], o["value"]) for o in report["outcomes"]]


@pytest.fixture
def worker(tiny_model_dir):
    return run_search
