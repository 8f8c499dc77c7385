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

from torch import nn

from hf_scale.errors import ConfigError


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a model can only be a PeftModel if it is importable
        return False
    return isinstance(model, PeftModel)


def fast_path_applies(model: Any, zero3: bool) -> bool:
    """Whether the adapters of `model` can be re-created on its base for each trial."""
    if not is_peft_model(model) or zero3:
        return False
    config = model.peft_config[model.active_adapter]
    return getattr(config, "peft_type", None) == "LORA" and not getattr(config, "modules_to_save", None)


# The search space's names of LoRA values, and LoraConfig's.
LORA_CONFIG_FIELDS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def lora_config_with(config: Any, lora_updates: dict[str, Any]) -> Any:
    """A copy of a LoraConfig with a trial's r, alpha and dropout."""
    return dataclasses.replace(config, **{LORA_CONFIG_FIELDS[key]: value for key, value in lora_updates.items()})


class AdapterFactory:
    """Holds the base model between trials and wraps it in a trial's adapters."""

    def __init__(self, peft_model: Any) -> None:
        self.config = peft_model.peft_config[peft_model.active_adapter]
        self.base: nn.Module | None = peft_model.unload()

    def build(self, lora_updates: dict[str, Any]) -> Any:
        from peft import get_peft_model

        if self.base is None:
            raise RuntimeError("AdapterFactory.build called twice without release(): the base is in use")
        base, self.base = self.base, None
        return get_peft_model(base, lora_config_with(self.config, lora_updates))

    def release(self, peft_model: Any) -> None:
        """Take the base back from a trial's PEFT model: its adapters are dropped, the base weights kept."""
        if is_peft_model(peft_model) and self.base is None:
            self.base = peft_model.unload()


def with_adapters(model: Any, lora_updates: dict[str, Any]) -> Any:
    """`model` (from `model_init`) with fresh adapters carrying a trial's LoRA values; unchanged when there are none."""
    if not lora_updates:
        return model
    if not is_peft_model(model):
        raise ConfigError(
            f"hp_space: {', '.join(lora_updates)} given but the model is not a PEFT (LoRA) model; "
            "drop them from hp_space or return a PeftModel from model_init"
        )
    from peft import get_peft_model

    config = model.peft_config[model.active_adapter]
    return get_peft_model(model.unload(), lora_config_with(config, lora_updates))
