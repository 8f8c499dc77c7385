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
