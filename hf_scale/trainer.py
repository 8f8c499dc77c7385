"""`ScaleTrainer`: the HF `Trainer`, refusing silently wrong distributed runs and saying what it will do."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.distributed import check_model_is_wrapped, check_process_group


class ScaleTrainer(Trainer):
    """A `Trainer` that checks, before any work, that its processes really train together."""

    args: ScaleTrainingArguments

    def __init__(self, model: Any = None, args: ScaleTrainingArguments | None = None, **kwargs: Any) -> None:
        if args is not None and not isinstance(args, ScaleTrainingArguments):
            raise TypeError(
                f"ScaleTrainer needs ScaleTrainingArguments, got {type(args).__name__}: "
                "ScaleTrainingArguments takes every TrainingArguments field"
            )
        super().__init__(model=model, args=args or ScaleTrainingArguments(), **kwargs)
        check_process_group(self.args.world_size, self.accelerator.distributed_type.value)
        self._wrapping_checked = False

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint is None and self.args.resume:
            resume_from_checkpoint = True
        if self.is_world_process_zero():
            print(describe_batch(self.args), flush=True)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        if not self._wrapping_checked:
            # `model` here is what the loop trains: DDP(model) or DeepSpeedEngine(model) when distributed.
            check_model_is_wrapped(model, self.args.world_size)
            self._wrapping_checked = True
        return super().training_step(model, inputs, num_items_in_batch)


def describe_batch(args: ScaleTrainingArguments) -> str:
    """One line: the effective batch and where it comes from."""
    return (
        f"hf_scale: effective batch {args.effective_batch_size}"
        f" = {args.per_device_train_batch_size} per device x {args.world_size} process(es)"
        f" x {args.gradient_accumulation_steps} accumulation step(s)"
    )
