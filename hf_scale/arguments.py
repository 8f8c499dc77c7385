"""`ScaleTrainingArguments`: `TrainingArguments` plus the settings hf_scale adds, each documented where declared.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from hf_scale.distributed import has_accelerator, launched_world_size
from hf_scale.errors import ConfigError
from hf_scale.presets.consistency import check_against_arguments, load_deepspeed_config


@dataclass
class ScaleTrainingArguments(TrainingArguments):
    """`TrainingArguments` for instruction fine-tuning at scale; every HF argument works as usual."""

    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Effective batch (per_device_train_batch_size x processes x gradient_accumulation_steps) to "
            "keep whatever the number of processes: gradient_accumulation_steps is derived from it at launch. "
            "It must be a multiple of per_device_train_batch_size x processes."
        },
    )
    zero_preset: str | None = field(
        default=None,
        metadata={
            "help": "A DeepSpeed ZeRO preset shipped with hf_scale, by name (see `hf_scale.presets`); it sets "
            "`deepspeed`. Leave empty to set `deepspeed` yourself or to train without DeepSpeed."
        },
    )
    resume: bool = field(
        default=False,
        metadata={"help": "Resume from the newest checkpoint in output_dir; an error if there is none."},
    )
    auto_cpu_ddp: bool = field(
        default=True,
        metadata={
            "help": "On a machine without an accelerator, set use_cpu=True when several processes are launched, "
            "so that they train as real gloo DDP instead of as independent copies."
        },
    )

    def __post_init__(self):
        world_size = launched_world_size()
        if not has_accelerator():
            self.dataloader_pin_memory = False  # nothing to pin for; torch warns on every loader otherwise
            if self.auto_cpu_ddp and world_size > 1:
                self.use_cpu = True
        if self.zero_preset:
            if self.deepspeed:
                raise ConfigError("zero_preset and deepspeed are both set: give one DeepSpeed config, not two")
            from hf_scale.presets import zero_preset

            self.deepspeed = zero_preset(self.zero_preset)
        if self.global_batch_size is not None:
            self.gradient_accumulation_steps = accumulation_for_global_batch(
                self.global_batch_size, self.per_device_train_batch_size, world_size
            )
        if self.deepspeed:
            self.deepspeed = load_deepspeed_config(self.deepspeed)
            check_against_arguments(self.deepspeed, self, world_size)
        if self.resume:
            check_resumable(self.output_dir)
        super().__post_init__()
        if self.deepspeed and self.use_cpu and world_size > 1:
            _start_deepspeed_comm(self)

    @property
    def effective_batch_size(self) -> int:
        """Examples per optimizer step across all processes."""
        return self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps


def accumulation_for_global_batch(global_batch_size: int, per_device_batch_size: int, world_size: int) -> int:
    """Gradient accumulation steps that make `per_device x world_size x steps == global_batch_size` exactly."""
    per_step = per_device_batch_size * world_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size={global_batch_size} cannot be reached with per_device_train_batch_size="
            f"{per_device_batch_size} on {world_size} process(es): it must be a positive multiple of "
            f"{per_device_batch_size} x {world_size} = {per_step}"
        )
    return global_batch_size // per_step


def check_resumable(output_dir: str | None) -> None:
    """`--resume` needs a `checkpoint-*` folder in output_dir; say so before any work starts."""
    if not output_dir or not os.path.isdir(output_dir):
        raise ConfigError(f"resume: output_dir {output_dir!r} does not exist, so there is nothing to resume")
    if get_last_checkpoint(output_dir) is None:
        raise ConfigError(f"resume: no checkpoint-* folder in output_dir {output_dir!r}")


def _start_deepspeed_comm(args: TrainingArguments) -> None:
    """Make deepspeed.comm join the CPU process group before any model is loaded.

    On CPU, accelerate starts only torch.distributed (gloo). ZeRO-3 partitions the weights while
    `from_pretrained` loads them, and asks deepspeed.comm for the world size; uninitialised, it answers 1 and
    the batch check fails (train_batch_size != micro_batch x accumulation x 1).
    """
    import deepspeed

    _ = args.device  # starts the gloo process group
    deepspeed.init_distributed(dist_backend="gloo")
