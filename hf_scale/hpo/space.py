"""The search space: the default one from the fine-tuning guide, and how a trial's values reach the arguments.

Every value is suggested before the trial trains, on the rank that owns the study, and broadcast: a parameter
suggested later (inside `model_init` or a callback) would exist on one rank only. `split_hyperparameters` is the one
place where a trial's values become `ScaleTrainingArguments` fields or LoRA settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_scale.errors import ConfigError
from hf_scale.hpo.settings import SpaceArguments

# Keys a search space may return that are not TrainingArguments fields.
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout")
# transformers 5 removed warmup_ratio: warmup_steps takes a float in [0, 1) as a ratio.
RENAMED_KEYS = {"warmup_ratio": "warmup_steps"}
# The ranges SpaceArguments does not expose.
WEIGHT_DECAY = (0.01, 0.3)
SCHEDULES = ("linear", "cosine")
LORA_R = (8, 16, 32, 64)
LORA_ALPHA = (16, 32, 64)
LORA_DROPOUT = (0.0, 0.1)


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
    space: SpaceArguments | None = None,
    min_learning_rate: float | None = None,
) -> Callable[[Any], dict[str, Any]]:
    """The default search space as an `hp_space(trial) -> dict` function.

    `world_size` turns the sampled effective batch into gradient accumulation steps; `peft` adds LoRA r, alpha and
    dropout; `space` holds the ranges (default: the fine-tuning space). With `min_learning_rate` (the training
    arguments' floor, which only the cosine schedule has) the schedule is cosine in every trial. The returned dict
    holds what the trial applies, the derived accumulation steps included."""
    space = space or SpaceArguments()
    batches = effective_batch_choices(space.effective_batch_min, space.effective_batch_max)
    schedules = ["cosine"] if min_learning_rate is not None else list(SCHEDULES)

    def hp_space(trial: Any) -> dict[str, Any]:
        per_device = trial.suggest_categorical("per_device_train_batch_size", list(space.per_device_batch_sizes))
        effective = trial.suggest_categorical("effective_batch_size", list(batches))
        params = {
            "learning_rate": trial.suggest_float("learning_rate", *space.learning_rate, log=True),
            "weight_decay": trial.suggest_float("weight_decay", *WEIGHT_DECAY),
            "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation_steps(effective, per_device, world_size),
            "lr_scheduler_type": trial.suggest_categorical("lr_scheduler_type", schedules),
            "warmup_ratio": trial.suggest_float("warmup_ratio", 0.0, space.warmup_ratio_max),
        }
        if peft:
            params["lora_r"] = trial.suggest_categorical("lora_r", list(LORA_R))
            params["lora_alpha"] = trial.suggest_categorical("lora_alpha", list(LORA_ALPHA))
            params["lora_dropout"] = trial.suggest_float("lora_dropout", *LORA_DROPOUT)
        return params

    return hp_space


# Preference-tuning values that change the scale of the loss itself: trials that differ in them cannot be ranked by it.
LOSS_SCALE_KEYS = ("beta", "loss_type", "label_smoothing", "simpo_gamma", "sft_weight")
PREFERENCE_LEARNING_RATE = (5e-7, 5e-5)
PREFERENCE_BETA = (0.01, 0.5)
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge")


def preference_hp_space(
    learning_rate: tuple[float, float] = PREFERENCE_LEARNING_RATE,
    beta: tuple[float, float] = PREFERENCE_BETA,
    loss_types: tuple[str, ...] = PREFERENCE_LOSSES,
) -> Callable[[Any], dict[str, Any]]:
    """The default search space of preference tuning, as an `hp_space(trial) -> dict` function: the learning rate
    and beta on a log scale, and the loss among those that share a reference (sigmoid, IPO, hinge)."""

    def hp_space(trial: Any) -> dict[str, Any]:
        return {
            "learning_rate": trial.suggest_float("learning_rate", *learning_rate, log=True),
            "beta": trial.suggest_float("beta", *beta, log=True),
            "loss_type": trial.suggest_categorical("loss_type", list(loss_types)),
        }

    return hp_space


def loss_scale_keys(hp_space: Callable[[Any], dict[str, Any]]) -> list[str]:
    """The keys of LOSS_SCALE_KEYS that `hp_space` sets, read from one sample of it in a throwaway in-memory study
    (on every rank alike: nothing is stored or broadcast)."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory" on every rank
    try:
        study = optuna.create_study()
    finally:
        optuna.logging.set_verbosity(verbosity)
    return [key for key in hp_space(study.ask()) if key in LOSS_SCALE_KEYS]


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
