"""DeepSpeed ZeRO presets shipped as JSON beside this file, with "auto" wherever the HF integration fills values in.

The offload presets name an AdamW optimizer: DeepSpeed refuses the Trainer's torch optimizer when the
optimizer states live on the CPU, and with this section it runs its own CPU Adam (AdamW mode) instead.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

from hf_scale.errors import ConfigError


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(
        p.name.removesuffix(".json") for p in resources.files(__package__).iterdir() if p.name.endswith(".json")
    )


def zero_preset(name: str, **overrides: Any) -> dict[str, Any]:
    """The preset called `name` as a dict (a fresh copy), with top-level `overrides` applied.

    A dict override is merged one level deep, so `zero_optimization={"stage": 3}` changes the stage only.

    Example:
        config = zero_preset("zero2", zero_optimization={"overlap_comm": False})
        args = ScaleTrainingArguments(output_dir="out", deepspeed=config)  # or simply zero_preset="zero2"
    """
    known = list_presets()
    if name not in known:
        raise ConfigError(f"zero_preset: unknown preset {name!r}; known presets: {', '.join(known)}")
    config = json.loads(resources.files(__package__).joinpath(f"{name}.json").read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **copy.deepcopy(value)}
        else:
            config[key] = copy.deepcopy(value)
    return config


def load_deepspeed_config(config: dict | str) -> dict[str, Any]:
    """The config as a dict, from a dict, JSON text or a JSON file path."""
    if isinstance(config, dict):
        return config
    inline = config.lstrip().startswith("{")  # a dict given as a flag or YAML mapping arrives as JSON text
    if not inline and not Path(config).is_file():
        raise ConfigError(f"deepspeed: config file not found: {config}")
    try:
        loaded = json.loads(config if inline else Path(config).read_text())
    except json.JSONDecodeError as error:
        what = "not valid JSON" if inline else f"{config} is not valid JSON"
        raise ConfigError(f"deepspeed: {what}: {error}") from None
    if not isinstance(loaded, dict):  # else transformers takes a list for a path to open, and fails far away
        raise ConfigError(f"deepspeed: {config} must hold a JSON object (a mapping), got {type(loaded).__name__}")
    return loaded
