"""`ScaleTrainer`: the HF `Trainer`, refusing silently wrong distributed runs and saying what it will do."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import EarlyStoppingCallback, Trainer
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, BestRun, rotate_checkpoints

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.callbacks import DivergenceGuard, ThroughputCallback, TrainingDiverged
from hf_scale.checkpoints import COMPLETE_MARKER, last_complete_checkpoint, mark_complete, remove_incomplete_checkpoints
from hf_scale.data.batching import is_packed_batch
from hf_scale.distributed import check_model_is_wrapped, check_process_group
from hf_scale.errors import ConfigError
from hf_scale.evaluation import GenerationEval, generation_metrics
from hf_scale.output_dir import checkpoint_save_guard
from hf_scale.packed_attention import use_packed_sdpa


class ScaleTrainer(Trainer):
    """A `Trainer` that checks, before any work, that its processes really train together.

    On top of `Trainer`: gloo DDP on CPU, ZeRO presets by name, early stopping, throughput and divergence
    callbacks, greedy generation metrics (`generation_eval`), complete-or-ignored checkpoints, and an Optuna
    `hyperparameter_search` that is right on many processes.

    Example:
        args = ScaleTrainingArguments(output_dir="out", zero_preset="zero2", bf16=True, early_stopping_patience=3,
                                      eval_strategy="steps", eval_steps=50, save_steps=50)
        trainer = ScaleTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                               data_collator=make_collator(tokenizer, packing=True), processing_class=tokenizer)
        trainer.train()
    """

    args: ScaleTrainingArguments

    def __init__(
        self,
        model: Any = None,
        args: ScaleTrainingArguments | None = None,
        generation_eval: GenerationEval | None = None,
        **kwargs: Any,
    ) -> None:
        if args is not None and not isinstance(args, ScaleTrainingArguments):
            raise TypeError(
                f"ScaleTrainer needs ScaleTrainingArguments, got {type(args).__name__}: "
                "ScaleTrainingArguments takes every TrainingArguments field"
            )
        super().__init__(model=model, args=args or ScaleTrainingArguments(), **kwargs)
        check_process_group(self.args.world_size, self.accelerator.distributed_type.value)
        self._wrapping_checked = False
        if self.args.early_stopping_patience is not None:
            self.add_callback(
                EarlyStoppingCallback(self.args.early_stopping_patience, self.args.early_stopping_threshold)
            )
        self.throughput = ThroughputCallback() if self.args.log_throughput else None
        if self.throughput is not None:
            self.add_callback(self.throughput)
        self.divergence_guard = DivergenceGuard(self.args.divergence_spike_factor)
        self.generation_eval = generation_eval

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint is None and self.args.resume:
            resume_from_checkpoint = True
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_complete_checkpoint()
        if self.is_world_process_zero():
            print(describe_batch(self.args), flush=True)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _last_complete_checkpoint(self) -> str:
        """The newest checkpoint whose save finished; newer torn ones (a save that was killed) are removed."""
        last = last_complete_checkpoint(self.args.output_dir)
        if last is None:
            raise ConfigError(f"resume: no complete checkpoint-* folder in output_dir {self.args.output_dir!r}")
        if self.is_world_process_zero():
            for torn in remove_incomplete_checkpoints(self.args.output_dir):
                print(f"hf_scale: removed {torn}: its save was interrupted (no {COMPLETE_MARKER} file)")
        self.accelerator.wait_for_everyone()
        return str(last)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, marked complete once every process has written it, then older ones rotated."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            with checkpoint_save_guard(folder):  # a failed write: a clear SaveError, no torn folder left
                super()._save_checkpoint(model, trial)  # with no limit it deletes nothing yet
        finally:
            self.args.save_total_limit = save_total_limit
        self.accelerator.wait_for_everyone()  # every rank's shards are written
        if self.args.should_save:
            mark_complete(folder)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

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

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ):
        """The Trainer's loss loop, plus greedy generation metrics on `generation_eval` (never any logits)."""
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if self.generation_eval is not None and description == "Evaluation":
            prefix = metric_key_prefix
            settings = self.generation_eval
            scores = generation_metrics(
                self.model,
                settings.tokenizer or self.processing_class,
                settings.records,
                settings.template,
                settings.max_new_tokens,
                settings.batch_size,
                settings.metrics,
            )
            output.metrics.update({f"{prefix}_{name}": value for name, value in scores.items()})
        return output

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
            if self.args.packed_sdpa:
                base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
                use_packed_sdpa(base)
        result = super().compute_loss(model, inputs, *args, **kwargs)
        if not model.training or self.args.divergence_action == "off":
            return result
        loss = result[0] if isinstance(result, tuple) else result
        if self._diverged(loss):
            # This micro-batch adds nothing to the gradients; every parameter still takes part in the backward,
            # as DDP and ZeRO expect.
            zero = sum((p * 0).sum() for p in model.parameters() if p.requires_grad)
            return (zero, *result[1:]) if isinstance(result, tuple) else zero
        return result

    def _diverged(self, loss: torch.Tensor) -> bool:
        """Whether this micro-batch's loss is bad on any process: stop (after a checkpoint) or report a skip."""
        # One all-reduce of two numbers: the mean loss and whether any process saw a NaN/Inf.
        value = loss.detach().float().reshape(())
        finite = torch.isfinite(value)
        summary = torch.stack([torch.where(finite, value, torch.zeros_like(value)), (~finite).float()])
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(summary)
        mean_loss, nonfinite = summary.tolist()
        problem = self.divergence_guard.problem(float("nan") if nonfinite else mean_loss / self.args.world_size)
        if problem is None:
            return False
        step, learning_rate = self.state.global_step + 1, self._get_learning_rate()
        if self.args.divergence_action == "skip":
            self.divergence_guard.skipped += 1
            if self.is_world_process_zero():
                print(f"hf_scale: skipped a micro-batch at step {step}: {problem} (learning rate {learning_rate:.3g})")
            return True
        self.state.global_step = step  # the checkpoint is named after the step that diverged
        self._save_checkpoint(self.model_wrapped, trial=None)
        checkpoint = f"{self.args.output_dir}/checkpoint-{step}"
        raise TrainingDiverged(
            f"training diverged at step {step}: {problem}, learning rate {learning_rate:.3g}; the weights before "
            f"this step and the optimizer state are saved in {checkpoint} for diagnosis"
        )

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.throughput is not None:
            self.throughput.update_logs(logs, self.args.device)
        if self.divergence_guard.skipped and "loss" in logs:
            logs["skipped_micro_batches"] = self.divergence_guard.skipped
        super().log(logs, *args, **kwargs)

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
        if self.throughput is not None:
            self.throughput.count_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float | list[float]] | None = None,
        n_trials: int = 20,
        direction: str | list[str] | None = None,
        backend: str | None = "optuna",
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun]:
        """HF's `hyperparameter_search` on Optuna, correct with many processes, DeepSpeed, LoRA and many nodes.

        Same arguments and return as HF; `kwargs` take `hf_scale.hpo.SearchArguments` fields (storage, pruner,
        timeout, retrain_best, ...) and Optuna's create_study / optimize arguments. The objective is the best value
        of `metric_for_best_model` (eval_loss by default) seen in each trial; `direction` defaults to its own. Every
        rank runs the same trials; afterwards the best trial's model is in `self.model` (saved to
        output_dir/best-model) and the study is `self.hp_search_study` on rank 0. See hf_scale/hpo.

        Example:
            trainer = ScaleTrainer(model_init=lambda trial: load_model(model_args, path, tokenizer), args=args,
                                   train_dataset=train, eval_dataset=held_out)
            best = trainer.hyperparameter_search(n_trials=20, storage="postgresql://hpo:PASSWORD@db/hpo")
            print(best.hyperparameters, best.objective)
        """
        from hf_scale.hpo.search import hyperparameter_search  # optuna is needed only here

        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)


def describe_batch(args: ScaleTrainingArguments) -> str:
    """One line: the effective batch and where it comes from."""
    tensor_parallel = (
        f" ({args.world_size} processes / tensor parallel {args.tensor_parallel_size})"
        if args.tensor_parallel_size > 1
        else ""
    )
    return (
        f"hf_scale: effective batch {args.effective_batch_size}"
        f" = {args.per_device_train_batch_size} per device x {args.data_parallel_size} data-parallel process(es)"
        f"{tensor_parallel} x {args.gradient_accumulation_steps} accumulation step(s)"
    )
