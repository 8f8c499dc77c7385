"""A DeepSpeed config and the training arguments must agree; say where they do not, before any work starts.

The HF integration fills every "auto" value from the training arguments, and checks explicit values only when
the engine starts, after the model is loaded. This check runs when the arguments are built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_scale.errors import ConfigError


def load_deepspeed_config(config: dict | str) -> dict[str, Any]:
    """The config as a dict, from a dict, JSON text or a JSON file path."""
    if isinstance(config, dict):
        return config
    if config.lstrip().startswith("{"):  # a dict given as a flag or YAML mapping arrives as JSON text
        try:
            return json.loads(config)
        except json.JSONDecodeError as error:
            raise ConfigError(f"deepspeed: not valid JSON: {error}") from None
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"deepspeed: config file not found: {config}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"deepspeed: {config} is not valid JSON: {error}") from None


def _get(config: dict, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return "auto"
        value = value[part]
    return value


def check_against_arguments(config: dict, args: Any, world_size: int) -> None:
    """Raise a `ConfigError` naming both values for every explicit DeepSpeed value that contradicts `args`."""
    expected = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
        "gradient_clipping": args.max_grad_norm,
        "bf16.enabled": bool(args.bf16),
        "fp16.enabled": bool(args.fp16),
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.weight_decay": args.weight_decay,
    }
    argument_names = {
        "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x processes",
        "gradient_clipping": "max_grad_norm",
        "bf16.enabled": "bf16",
        "fp16.enabled": "fp16",
        "optimizer.params.lr": "learning_rate",
        "optimizer.params.weight_decay": "weight_decay",
    }
    conflicts = []
    for key, wanted in expected.items():
        value = _get(config, key)
        if value == "auto":
            continue
        same = (
            abs(float(value) - float(wanted)) <= 1e-12 * max(1.0, abs(float(wanted)))
            if not isinstance(wanted, bool)
            else bool(value) == wanted
        )
        if not same:
            conflicts.append(f"{key}={value} but {argument_names[key]}={wanted}")
    if conflicts:
        raise ConfigError(
            "the DeepSpeed config contradicts the training arguments: "
            + "; ".join(conflicts)
            + ' (set those DeepSpeed values to "auto" so the training arguments decide)'
        )
