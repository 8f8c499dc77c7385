"""Shared fixtures: the tiny model built once per session, in a cache that launched processes reuse."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_scale_cache(tmp_path_factory) -> Path:
    """One cache folder for the whole session, so the tiny model is built once and reused by subprocesses."""
    cache = tmp_path_factory.mktemp("hf_scale_cache")
    os.environ["HF_SCALE_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(hf_scale_cache) -> Path:
    from hf_scale.tiny import ensure_tiny_model

    return ensure_tiny_model()


def _train(output_dir: Path, *flags: str, launcher: tuple[str, ...] = (sys.executable,)) -> Path:
    """A recipe run into `output_dir`; what it printed is kept beside it, in `<output_dir>.log`."""
    from tests.helpers import assert_succeeded, run_command

    command = [*launcher, "recipes/finetune_llama2.py", "--output_dir", str(output_dir), *flags]
    result = run_command(command, timeout=600, OMP_NUM_THREADS="2")
    assert_succeeded(result, result.stderr[-3000:])
    output_dir.with_suffix(".log").write_text(result.stdout)
    return output_dir


@pytest.fixture(scope="session")
def trained_tiny_run(hf_scale_cache, tmp_path_factory) -> Path:
    """The embedded tiny default trained as `make demo` trains it (about a minute): a run folder whose model
    answers held-out records (exact match about 0.9), shared by the recipe test and the tests that chat with or
    export a run."""
    from tests.helpers import python_bin

    launcher = (python_bin("accelerate"), "launch", "--num_processes", "1")
    return _train(tmp_path_factory.mktemp("trained") / "tiny", launcher=launcher)


@pytest.fixture(scope="session")
def trained_tiny_lora_run(hf_scale_cache, tmp_path_factory) -> Path:
    """The tiny default with LoRA adapters (r=8), trained long enough that the adapter changes the answers: the run
    folder holds the adapter only (adapter_config.json names the base)."""
    flags = ["--lora_r", "8", "--max_steps", "200", "--exact_match_samples", "0", "--save_strategy", "no"]
    return _train(tmp_path_factory.mktemp("trained") / "tiny-lora", *flags)
