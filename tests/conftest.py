"""Shared fixtures: the tiny model built once per session, in a cache that launched processes reuse."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def trained_tiny_run(hf_scale_cache, tmp_path_factory) -> Path:
    """The embedded tiny default trained as `make demo` trains it (about a minute): a run folder whose model
    answers held-out records (exact match about 0.9), shared by the recipe test and the tests that chat with or
    export a run."""
    from tests.helpers import python_bin, train_recipe

    launcher = (python_bin("accelerate"), "launch", "--num_processes", "1")
    return train_recipe(tmp_path_factory.mktemp("trained") / "tiny", launcher=launcher)


@pytest.fixture(scope="session")
def trained_tiny_lora_run(hf_scale_cache, tmp_path_factory) -> Path:
    """The tiny default with LoRA adapters (r=8), trained long enough that the adapter changes the answers: the run
    folder holds the adapter only (adapter_config.json names the base)."""
    from tests.helpers import train_recipe

    flags = ["--lora_r", "8", "--max_steps", "200", "--exact_match_samples", "0", "--save_strategy", "no"]
    return train_recipe(tmp_path_factory.mktemp("trained") / "tiny-lora", *flags)


@pytest.fixture(scope="session")
def trained_tiny_qlora_run(hf_scale_cache, tmp_path_factory) -> Path:
    """QLoRA (NF4 base, r=8) with packing, accumulation 2, gradient checkpointing and early stopping that stops the
    run (no evaluation improves by 100): it ends with its best checkpoint's adapter. Shared by the recipe test of
    those options together and the export test that merges a QLoRA adapter."""
    from tests.helpers import train_recipe

    flags = ["--quantization", "nf4", "--lora_r", "8", "--packing", "true", "--gradient_checkpointing", "true"]
    flags += ["--gradient_accumulation_steps", "2", "--early_stopping_patience", "2", "--early_stopping_threshold"]
    flags += ["100", "--eval_strategy", "steps", "--eval_steps", "4", "--save_strategy", "steps", "--save_steps", "4"]
    flags += ["--logging_steps", "4", "--max_steps", "60", "--exact_match_samples", "0", "--save_total_limit", "5"]
    return train_recipe(tmp_path_factory.mktemp("trained") / "tiny-qlora", *flags)
