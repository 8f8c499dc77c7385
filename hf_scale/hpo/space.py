"""The search space: the default one from the fine-tuning guide, and how a trial's values reach the arguments.

Every value is suggested before the trial trains, on the rank that owns the study, and broadcast: a parameter
suggested later (inside `model_init` or a callback) would exist on one rank only. `apply_hyperparameters` is the one
place where a trial's values become `ScaleTrainingArguments` fields or LoRA settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_scale.errors import ConfigError

# Keys a search space may return that are not TrainingArguments fields.
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout")
# transformers 5 removed warmup_ratio: warmup_steps takes a float in [0, 1) as a ratio.
RENAMED_KEYS = {"warmup_ratio": "warmup_steps"}
PER_DEVICE_BATCHES = (2, 4, 8)


@dataclass(frozen=True)
class SpaceSettings:
    """The ranges of the default search space; the defaults are the guide's for LLaMA-2 fine-tuning."""

    learning_rate: tuple[float, float] = (1e-5, 1e-4)  # log-uniform; its geometric centre is 3.2e-5
    weight_decay: tuple[float, float] = (0.01, 0.3)
    per_device_batches: tuple[int, ...] = PER_DEVICE_BATCHES
    effective_batch: tuple[int, int] = (32, 128)  # examples per optimizer step, all processes together
    schedules: tuple[str, ...] = ("linear", "cosine")
    warmup_ratio: tuple[float, float] = (0.0, 0.1)
    lora_r: tuple[int, ...] = (8, 16, 32, 64)
    lora_alpha: tuple[int, ...] = (16, 32, 64)
    lora_dropout: tuple[float, float] = (0.0, 0.1)


FINE_TUNING = SpaceSettings()
# Pre-training-like runs (or LoRA, which trains few weights from zero) take rates about ten times higher.
PRE_TRAINING = SpaceSettings(learning_rate=(1e-5, 5e-4))


def effective_batch_choices(low: int, high: int) -> tuple[int, ...]:
    """The powers of two in [low, high]: the effective batches the default space picks from."""
    if low < 1 or high < low:
        raise ConfigError(f"effective_batch: the range ({low}, {high}) must be positive and increasing")
    choices = tuple(2**k for k in range(0, 31) if low <= 2**k <= high)
    if not choices:
        raise ConfigError(f"effective_batch: no power of two lies in ({low}, {high})")
    return choices


def accumulation_steps(effective_batch: int, per_device_batch: int, world_size: int) -> int:
    """Gradient accumulation steps that come nearest to `effective_batch`, at least 1.

    With more processes than the range allows (per_device x processes > effective_batch), it is 1 and the effective
    batch is larger than asked for."""
    return max(1, round(effective_batch / (per_device_batch * world_size)))


def default_hp_space(
    world_size: int = 1,
    peft: bool = False,
    settings: SpaceSettings = FINE_TUNING,
    min_learning_rate: float | None = None,
) -> Callable[[Any], dict[str, Any]]:
    """The default search space as an `hp_space(trial) -> dict` function.

    `world_size` turns the sampled effective batch into gradient accumulation steps; `peft` adds LoRA r, alpha and
    dropout. With `min_learning_rate` (the training arguments' floor, which only the cosine schedule has) the
    schedule is cosine in every trial. The returned dict holds what the trial applies, the derived accumulation
    steps included."""
    batches = effective_batch_choices(*settings.effective_batch)
    schedules = ["cosine"] if min_learning_rate is not None else list(settings.schedules)

    def hp_space(trial: Any) -> dict[str, Any]:
        per_device = trial.suggest_categorical("per_device_train_batch_size", list(settings.per_device_batches))
        effective = trial.suggest_categorical("effective_batch_size", list(batches))
        params = {
            "learning_rate": trial.suggest_float("learning_rate", *settings.learning_rate, log=True),
            "weight_decay": trial.suggest_float("weight_decay", *settings.weight_decay),
            "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation_steps(effective, per_device, world_size),
            "lr_scheduler_type": trial.suggest_categorical("lr_scheduler_type", schedules),
            "warmup_ratio": trial.suggest_float("warmup_ratio", *settings.warmup_ratio),
        }
        if peft:
            params["lora_r"] = trial.suggest_categorical("lora_r", list(settings.lora_r))
            params["lora_alpha"] = trial.suggest_categorical("lora_alpha", list(settings.lora_alpha))
            params["lora_dropout"] = trial.suggest_float("lora_dropout", *settings.lora_dropout)
        return params

    return hp_space


def split_hyperparameters(params: dict[str, Any], args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TrainingArguments updates, LoRA updates) from a trial's values; an unknown key is a ConfigError.

    The stock backend only warns about an unknown key and trains without it: a typo in a search space would
    silently search nothing."""
    arg_updates: dict[str, Any] = {}
    lora_updates: dict[str, Any] = {}
    for key, value in params.items():
        if key in LORA_KEYS:
            lora_updates[key] = value
            continue
        field = RENAMED_KEYS.get(key, key)
        if key == "effective_batch_size":
            continue  # a sampled quantity, already turned into gradient_accumulation_steps
        if not hasattr(args, field):
            raise ConfigError(
                f"hp_space: {key!r} is neither a ScaleTrainingArguments field nor one of {', '.join(LORA_KEYS)}"
            )
        if key == "warmup_ratio" and not 0 <= float(value) < 1:
            raise ConfigError(f"hp_space: warmup_ratio must lie in [0, 1), got {value}")
        current = getattr(args, field)
        if field == "warmup_steps":
            value = float(value) if key == "warmup_ratio" else value
        elif current is not None and not isinstance(current, bool) and isinstance(current, int | float | str):
            value = type(current)(value)  # as the stock backend does: a sampler may hand back numpy scalars
        arg_updates[field] = value
    return arg_updates, lora_updates
