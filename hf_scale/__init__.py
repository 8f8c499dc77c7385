"""hf_scale: instruction fine-tuning of LLaMA-2-class models that stays inside the Hugging Face Trainer."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_scale.arguments import ScaleTrainingArguments
    from hf_scale.trainer import ScaleTrainer

__version__ = "0.1.0"
__all__ = ["ScaleTrainer", "ScaleTrainingArguments"]

# Imported on first use: they pull in transformers (seconds), which `hf-scale plan` or a process that only needs
# hf_scale.distributed does not need.
_EXPORTS = {"ScaleTrainer": "hf_scale.trainer", "ScaleTrainingArguments": "hf_scale.arguments"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_scale' has no attribute {name!r}")
