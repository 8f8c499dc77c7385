"""`ScaleTrainer`: the HF `Trainer`, refusing silently wrong distributed runs and saying what it will do."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import nn
from torch.utils.data import DataLoader
from transformers import EarlyStoppingCallback, Trainer
from transformers.integrations import TensorBoardCallback, is_deepspeed_zero3_enabled
from transformers.integrations.integration_utils import default_logdir
from transformers.trainer import logger as trainer_logger
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, BestRun, rotate_checkpoints

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.callbacks import DivergenceGuard, ThroughputCallback, TrainingDiverged
from hf_scale.checkpoints import (
    COMPLETE_MARKER,
    finished_step,
    last_complete_checkpoint,
    mark_complete,
    remove_incomplete_checkpoints,
)
from hf_scale.data.batching import is_packed_batch
from hf_scale.distributed import check_model_is_wrapped, check_process_group, release_gil_to_collectives_at_exit
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
        super().__init__(model=model, args=prepare_run(args or ScaleTrainingArguments()), **kwargs)
        check_process_group(self.args.world_size, self.accelerator.distributed_type.value)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            release_gil_to_collectives_at_exit()
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
                # It opens its writer at the first log, before train() tells it output_dir when an evaluation
                # comes first: the whole run's logs went to the working directory's runs/.
                callback.logging_dir = os.path.join(self.args.output_dir, default_logdir())
        self._wrapping_checked = False
        if self.args.early_stopping_patience is not None:
            self.add_callback(
                EarlyStoppingCallback(self.args.early_stopping_patience, self.args.early_stopping_threshold)
            )
        self.throughput = ThroughputCallback() if self.args.log_throughput else None
        if self.throughput is not None:
            self.add_callback(self.throughput)
        self.divergence_guard = DivergenceGuard(self.args.divergence_spike_factor)
        self._step_loss: torch.Tensor | None = None  # the running optimizer step's loss so far, on the device
        self.generation_eval = generation_eval
        # (global step, metric prefix, metrics) of the last evaluate() of the trainer's own eval_dataset
        self._last_evaluation: tuple[int, str, dict[str, float]] | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint is None and self.args.resume != "false":
            resume_from_checkpoint = True
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_complete_checkpoint(required=self.args.resume != "auto")
        self._step_loss = None  # nothing left over from a step that an exception interrupted
        say = print if self.is_world_process_zero() else (lambda *_, **__: None)
        say(describe_batch(self.args), flush=True)
        finished = finished_step(resume_from_checkpoint, self.args) if resume_from_checkpoint else None
        if finished is None:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        say(
            f"hf_scale: {self.args.output_dir} already finished: {Path(resume_from_checkpoint).name} is at step "
            f"{finished} of max_steps {self.args.max_steps if self.args.max_steps > 0 else finished}; nothing left "
            "to train (its weights are loaded, and the best ones when load_best_model_at_end)"
        )
        # The Trainer's own resume, over no batches: it loads the model, optimizer and state (and at the end the best
        # model) exactly as for a run with steps left, and takes no step.
        self._nothing_to_train, max_steps, self.args.max_steps = True, self.args.max_steps, finished
        # The Trainer's warning about an epoch without batches is what "no batches" means here.
        quiet = lambda record: "a single sample in your epoch_iterator" not in record.getMessage()  # noqa: E731
        trainer_logger.addFilter(quiet)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self._nothing_to_train, self.args.max_steps = False, max_steps
            trainer_logger.removeFilter(quiet)

    def get_train_dataloader(self) -> DataLoader:
        if getattr(self, "_nothing_to_train", False):
            return DataLoader([])
        return super().get_train_dataloader()

    def _last_complete_checkpoint(self, required: bool = True) -> str | None:
        """The newest checkpoint whose save finished; newer torn ones (a save that was killed) are removed.

        When there is none: a `ConfigError` if `required`, else None (resume=auto starts from the first step)."""
        last = last_complete_checkpoint(self.args.output_dir)
        if last is None and required:
            raise ConfigError(f"resume: no complete checkpoint-* folder in output_dir {self.args.output_dir!r}")
        if self.is_world_process_zero():
            for torn in remove_incomplete_checkpoints(self.args.output_dir):
                print(f"hf_scale: removed {torn}: its save was interrupted (no {COMPLETE_MARKER} file)")
            if last is None:
                print(f"hf_scale: resume=auto: no complete checkpoint in {self.args.output_dir}; starting at step 0")
            else:
                print(f"hf_scale: resuming from {last}")
        self.accelerator.wait_for_everyone()
        return None if last is None else str(last)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """The Trainer's warnings after loading a checkpoint, less the tied weights that saving leaves out.

        transformers 5.24 reports a tied `lm_head.weight` as "missing keys in the checkpoint" on every resume,
        although `save_pretrained` drops it on purpose and loading ties it again."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        tied = set(getattr(base, "all_tied_weights_keys", None) or {})
        missing = [key for key in load_result.missing_keys if key.split("base_model.model.")[-1] not in tied]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, marked complete once every process has written it, then older ones rotated."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        # A failed write on any process: a clear SaveError on every process, no torn folder left. Its exchange of
        # outcomes also waits until every rank's shards are written.
        exchange = lambda outcome: gather_object([outcome])  # noqa: E731
        try:
            with checkpoint_save_guard(folder, exchange, removes_partial=self.args.should_save):
                super()._save_checkpoint(model, trial)  # with no limit it deletes nothing yet
        finally:
            self.args.save_total_limit = save_total_limit
        if self.args.should_save:
            mark_complete(folder)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    @contextmanager
    def evaluation_preparation(self):
        """Around an evaluation or a prediction: undo afterwards what it prepared itself (before train()).

        The stock evaluation_loop prepares the model itself only when nothing is prepared yet (before train()).
        Only that preparation is undone afterwards: undoing the training's own would make every later evaluation
        prepare again, and in one process with bf16 each preparation wraps `forward` once more (RecursionError
        after a few hundred evaluations)."""
        prepared_here = not self.accelerator._models and self.model_wrapped is self.model
        zero12_before_train = self.is_deepspeed_enabled and self.deepspeed is None and not is_deepspeed_zero3_enabled()
        if zero12_before_train:
            # The stock Trainer refuses ZeRO-1/2 evaluation before train() ("ZeRO inference only makes sense with
            # ZeRO Stage 3"). Under those stages every rank holds the whole model: evaluate it as DDP would.
            self.is_deepspeed_enabled = False
        try:
            yield
        finally:
            self.is_deepspeed_enabled = self.is_deepspeed_enabled or zero12_before_train
            if prepared_here:
                self._forget_evaluation_preparation()

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self.evaluation_preparation():
            metrics = super().evaluate(*args, **kwargs)
        if not args and kwargs.get("eval_dataset") is None:
            self._last_evaluation = (self.state.global_step, kwargs.get("metric_key_prefix", "eval"), metrics)
        return metrics

    def predict(self, *args: Any, **kwargs: Any):
        with self.evaluation_preparation():
            return super().predict(*args, **kwargs)

    def evaluate_trained(self, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`evaluate()` of the weights training ended with, under `metric_key_prefix`. When training's own last
        evaluation was at its last step and those weights were kept (no best checkpoint loaded at the end), its
        figures are those: they are returned again instead of evaluating the same weights on the same data twice
        (for a 7B model with generation metrics, minutes)."""
        if self._last_evaluation is not None and not self.args.load_best_model_at_end:
            step, prefix, metrics = self._last_evaluation
            if step == self.state.global_step and step > 0:
                return {
                    metric_key_prefix + key.removeprefix(prefix) if key.startswith(f"{prefix}_") else key: value
                    for key, value in metrics.items()
                }
        return self.evaluate(metric_key_prefix=metric_key_prefix)

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
            output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in scores.items()})
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
        self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)  # the autocast wrapper of `forward`, if any
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
        result = self.compute_batch_loss(model, inputs, *args, **kwargs)
        if not model.training or self.args.divergence_action == "off":
            return result
        loss = result[0] if isinstance(result, tuple) else result
        self._add_to_step_loss(loss, kwargs.get("num_items_in_batch"))
        if self.accelerator.sync_gradients and self._step_diverged():  # the step's last micro-batch
            # Nothing of this step reaches the weights: the earlier micro-batches' gradients are dropped, this one
            # adds zeros (every parameter still takes part in the backward, as DDP expects), and the learning rate
            # of this one optimizer step is 0, so that AdamW's momentum and weight decay move nothing either.
            model.zero_grad(set_to_none=False)
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0  # the scheduler sets the next step's rate as usual
            zero = sum((p * 0).sum() for p in model.parameters() if p.requires_grad)
            return (zero, *result[1:]) if isinstance(result, tuple) else zero
        return result

    def compute_batch_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        """The loss of one micro-batch (Trainer's `compute_loss`); a subclass with a loss of its own overrides this,
        and `compute_loss` still guards the step (divergence) around it."""
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _add_to_step_loss(self, loss: torch.Tensor, num_items_in_batch: Any) -> None:
        """Add a micro-batch's share of its step's per-token loss, on its device (no host sync)."""
        scaled_for_accumulation = (
            self.loss_is_scaled_for_ga
            if self.loss_is_scaled_for_ga is not None
            else (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func
        )
        share = loss.detach().float().reshape(())
        if not scaled_for_accumulation:  # a per-micro-batch mean, as the Trainer itself divides it
            share = share / self.current_gradient_accumulation_steps
        self._step_loss = share if self._step_loss is None else self._step_loss + share

    def _step_diverged(self) -> bool:
        """Whether this optimizer step's loss is bad: stop (after a checkpoint) or report a skip.

        The loss is the step's per-token loss over all processes, the one the Trainer logs for it: one all-reduce and
        one read from the device per optimizer step, the same decision on every process."""
        step_loss, self._step_loss = self._step_loss, None
        step_loss = self.accelerator.reduce(step_loss, "mean")  # each process's loss is scaled to the world's tokens
        problem = self.divergence_guard.problem(step_loss.item())
        if problem is None:
            return False
        step, learning_rate = self.state.global_step + 1, self._get_learning_rate()
        if self.args.divergence_action == "skip":
            self.divergence_guard.skipped += 1
            if self.is_world_process_zero():
                print(f"hf_scale: skipped step {step}: {problem} (learning rate {learning_rate:.3g})")
            return True
        diagnosis = self._save_diagnosis_checkpoint(step)
        summary = f"training diverged at step {step}: {problem}, learning rate {learning_rate:.3g}"
        raise TrainingDiverged(summary, diagnosis)

    def _save_diagnosis_checkpoint(self, step: int) -> Path:
        """The state before the diverging `step`, beside the run's checkpoints, where --resume does not look."""
        output_dir = self.args.output_dir
        self.args.output_dir = os.path.join(output_dir, f"diverged-step-{step}")
        try:
            self._save_checkpoint(self.model_wrapped, trial=None)  # alone in its folder: the rotation deletes nothing
        finally:
            self.args.output_dir = output_dir
        return Path(output_dir) / f"diverged-step-{step}" / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.throughput is not None:
            self.throughput.update_logs(logs, self.args.device)
        if self.divergence_guard.skipped and "loss" in logs:
            logs["skipped_steps"] = self.divergence_guard.skipped
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
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | None = None,
        backend: str | None = "optuna",
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun:
        """HF's `hyperparameter_search` on Optuna, correct with many processes, DeepSpeed, LoRA and many nodes.

        Same arguments and return as HF; `kwargs` take `hf_scale.hpo.SearchArguments` fields (storage, pruner,
        timeout, retrain_best, ...) and Optuna's create_study / optimize arguments. The objective is the best value
        of `metric_for_best_model` (eval_loss by default) seen in each trial; `direction` defaults to its own (one
        objective: a list of directions is refused, since no single best trial could be reloaded). Every
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
