"""hf_scale: instruction fine-tuning of LLaMA-2-class models that stays inside the Hugging Face Trainer."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_scale.arguments import ScaleTrainingArguments
    from hf_scale.trainer import ScaleTrainer

__version__ = "0.1.0"
__all__ = ["ScaleTrainer", "ScaleTrainingArguments"]

# Imported on first use: they pull in transformers (seconds), which `hf-scale plan` or a process that only needs
# hf_scale.distributed does not need.
_EXPORTS = {"ScaleTrainer": "hf_scale.trainer", "ScaleTrainingArguments": "hf_scale.arguments"}


# bitsandbytes (imported through peft by every command, quantized or not) warns at import on a CPU with AVX512-BF16
# that an optional kernel could not be fetched from the hub (`kernels`); it runs without it (bench/qlora_learning.py,
# STACK-NOTES). Said on every command, `--help` included, it reads as an error: the one line is left out.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "from kernels-community" not in record.getMessage()
)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_scale' has no attribute {name!r}")
