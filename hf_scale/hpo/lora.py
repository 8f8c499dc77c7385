"""The LoRA fast path: load the base weights once, re-create only the adapters for each trial.

A LoRA trial trains the adapters and leaves the base weights as they were; loading a 7B base again for every trial
costs tens of seconds and, for a while, a second copy in memory. Here the first PEFT model is unwrapped (`unload()`
puts the original layers back, unmerged) and each trial wraps that same base in fresh adapters with its own r, alpha
and dropout. Only plain LoRA without `modules_to_save` qualifies (those copies of base modules train), and not under
ZeRO-3 (the engine partitions the base); the others call `model_init` for every trial.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from peft import PeftModel, get_peft_model
from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled

# The search space's names of LoRA values, and LoraConfig's.
LORA_CONFIG_FIELDS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def fast_path_applies(model: Any, enabled: bool = True) -> bool:
    """Whether the adapters of `model` can be re-created on its base for each trial."""
    if not (enabled and isinstance(model, PeftModel)) or is_deepspeed_zero3_enabled():
        return False
    config = model.peft_config[model.active_adapter]
    return config.peft_type == "LORA" and not getattr(config, "modules_to_save", None)


def unload(model: PeftModel) -> tuple[nn.Module, Any]:
    """(the base without adapters, the adapters' config): what a trial's new adapters are built from."""
    config = model.peft_config[model.active_adapter]
    return model.unload(), config


def with_adapters(base: nn.Module, config: Any, lora_updates: dict[str, Any]) -> PeftModel:
    """`base` in fresh adapters: `config` with a trial's r, alpha and dropout."""
    updates = {LORA_CONFIG_FIELDS[key]: value for key, value in lora_updates.items()}
    return get_peft_model(base, dataclasses.replace(config, **updates))
