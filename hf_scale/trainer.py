"""`ScaleTrainer`: the HF `Trainer`, refusing silently wrong distributed runs and saying what it will do."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.integrations import is_deepspeed_zero3_enabled

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.batching import is_packed_batch
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

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        not_yet_wrapped = self.model_wrapped is self.model
        zero12_before_train = self.is_deepspeed_enabled and self.deepspeed is None and not is_deepspeed_zero3_enabled()
        if zero12_before_train:
            # The stock Trainer refuses ZeRO-1/2 evaluation before train() ("ZeRO inference only makes sense with
            # ZeRO Stage 3"). Under those stages every rank holds the whole model: evaluate it as DDP would.
            self.is_deepspeed_enabled = False
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.is_deepspeed_enabled = self.is_deepspeed_enabled or zero12_before_train
            if not_yet_wrapped:
                self._forget_evaluation_preparation()

    def _forget_evaluation_preparation(self) -> None:
        """Undo what evaluating before train() leaves behind, so that train() still wraps the model.

        `Accelerator.prepare_model(model, evaluation_mode=True)` marks the bare model as prepared and records
        it; a later `prepare(model, optimizer)` then returns it unwrapped, and multi-process training runs
        without DDP (replicas drift apart, silently), and `save_state` would save the model twice.
        Under ZeRO-3 the stock Trainer builds an inference-only DeepSpeed engine to evaluate, and train() would
        then train through it and fail at the first backward ('NoneType' object has no attribute 'backward').
        """
        evaluation_wrapper = self.model_wrapped
        if getattr(self.model, "_is_accelerate_prepared", False):
            del self.model._is_accelerate_prepared
        self.accelerator._models = [
            model for model in self.accelerator._models if model is not self.model and model is not evaluation_wrapper
        ]
        if evaluation_wrapper is not self.model:  # the inference engine: train() builds the training one
            self.model_wrapped = self.model
            self.deepspeed = None

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        if is_packed_batch(inputs):
            # With a KV cache (use_cache=True in the model config) transformers skips the block-diagonal mask
            # that position_ids imply, and packed examples silently attend to each other.
            inputs = {**inputs, "use_cache": False}
        return super().compute_loss(model, inputs, *args, **kwargs)

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
