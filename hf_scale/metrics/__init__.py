"""Generation metrics as local `evaluate` modules, shipped in the package: hub metrics cannot load offline.

Each metric is one self-contained file here (`exact_match.py`, `token_f1.py`) that `evaluate.load` takes by path.
"""

from __future__ import annotations

from pathlib import Path

import evaluate

from hf_scale.errors import ConfigError

METRICS_DIR = Path(__file__).resolve().parent
KNOWN_METRICS = ("exact_match", "token_f1")


def metric_path(name: str) -> Path:
    """The file of the local metric module `name`; a `ConfigError` listing the known ones for any other name."""
    if name not in KNOWN_METRICS:
        raise ConfigError(f"unknown generation metric {name!r}; known metrics: {', '.join(KNOWN_METRICS)}")
    return METRICS_DIR / f"{name}.py"


def load_metric(name: str) -> evaluate.EvaluationModule:
    """The local metric module `name`, loaded offline from the installed package.

    `keep_in_memory`: no Arrow cache file and no file lock, so several ranks that each compute the same metric
    never share (or wait on) a cache file.
    """
    return evaluate.load(str(metric_path(name)), keep_in_memory=True)
