"""Where hf_scale keeps what it builds once and reuses: the tiny model, tokenized sets."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$HF_SCALE_CACHE`, or `~/.cache/hf_scale`."""
    return Path(os.environ.get("HF_SCALE_CACHE", Path.home() / ".cache" / "hf_scale"))
