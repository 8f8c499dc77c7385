"""One trial, run the same way on every rank: its arguments, its model, its training, its outcome, its cleanup.

Order matters: the trial's values are applied to the arguments first, then the DeepSpeed config and the Accelerator
are rebuilt from them ("auto" values follow the trial's learning rate and batch), and only then is the model built,
so that ZeRO-3 partitions it under the trial's config (the stock backend calls `model_init` before applying them).
A trial that raises is caught here on every rank and reported as an outcome; only KeyboardInterrupt goes through.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import optuna
import psutil
from peft import PeftModel
from transformers import TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, set_seed

from hf_scale.callbacks import TrainingDiverged
from hf_scale.errors import ConfigError, HfScaleError
from hf_scale.hpo import sync
from hf_scale.hpo.lora import unload, with_adapters
from hf_scale.hpo.objective import BestValue, Objective, check_against_direction
from hf_scale.hpo.space import split_hyperparameters
from hf_scale.hpo.sync import ABORTED, COMPLETE, FAILED, PRUNED, STOPPED, Decision, Outcome, TrialPlan


class TrialFailedElsewhere(RuntimeError):
    """Another rank failed to set the trial up; this rank skips it too."""


class TrialFailedOnRank0(RuntimeError):
    """Rank 0 could not record an evaluation; every rank ends the trial with this error."""


def trial_folder(number: int) -> str:
    return f"trial-{number:04d}"


# What configure_trial sets for every trial whatever the user asked: put back once the search is over.
PER_TRIAL_FIELDS = ("output_dir", "run_name", "save_only_model", "save_total_limit", "save_strategy", "save_steps",
                    "resume")  # fmt: skip


def trial_arguments(base: Any, params: dict[str, Any], output_dir: str, run_name: str) -> Any:
    """The trial's arguments: the user's `base` with the trial's values, built and checked as the user's were.

    `dataclasses.replace` runs `__post_init__` again, so a trial's values get every check and every derived value
    that the same values given by the user would (a schedule and min_learning_rate, an accumulation from
    global_batch_size, the DeepSpeed config's "auto" values and its contradictions...)."""
    updates = dict(params)
    if "gradient_accumulation_steps" in updates:
        updates["global_batch_size"] = None  # the trial's own accumulation, not one derived from the user's batch
    # A trial is never resumed (a killed one is run again from the start), so its checkpoints need only the model;
    # the best one is found by the search's own objective. DeepSpeed reloads a best model (early stopping turns
    # load_best_model_at_end on) only from a whole checkpoint.
    model_only = not (base.deepspeed and base.load_best_model_at_end)
    updates.update(output_dir=output_dir, run_name=run_name, save_only_model=model_only, save_total_limit=None)
    updates["resume"] = "false"
    if base.eval_strategy.value != "no":
        updates.update(save_strategy=base.eval_strategy.value, save_steps=base.eval_steps)
    else:
        updates["save_strategy"] = "no"
    return dataclasses.replace(base, **updates)


def configure_trial(trainer: Any, search: Any, plan: TrialPlan) -> dict[str, Any]:
    """Give the trainer the trial's arguments and an Accelerator built from them; return the LoRA values."""
    arg_updates, lora_updates = split_hyperparameters(plan.params, search.base_args)
    output_dir = str(Path(search.output_dir) / trial_folder(plan.number))
    trainer.args = trial_arguments(search.base_args, arg_updates, output_dir, plan.run_name)
    # As transformers' own `Trainer._hp_search_setup` does (no public API does it): accelerate keeps the last trial's
    # DeepSpeed plugin in its shared state, and the train loader reads the batch size from `_train_batch_size`.
    if trainer.args.deepspeed:
        from accelerate.state import AcceleratorState

        trainer.accelerator.free_memory()
        AcceleratorState._reset_state()
    trainer._train_batch_size = trainer.args.train_batch_size
    trainer.create_accelerator_and_postprocess()
    return lora_updates


def build_model(trainer: Any, search: Any, plan: TrialPlan, lora_updates: dict[str, Any]) -> Any:
    """The trial's fresh model: new adapters on the kept base (LoRA fast path), or `model_init`."""
    args = trainer.args
    set_seed(args.seed)  # the same initial weights for the same seed, as the stock backend
    if search.lora_base is not None:
        (base, config), search.lora_base = search.lora_base, None
        return with_adapters(base, config, lora_updates)
    if trainer.model_init is None:
        raise HfScaleError("hyperparameter_search: no model_init and no kept LoRA base to build a trial's model from")
    model = trainer.call_model_init(optuna.trial.FixedTrial(plan.suggested, plan.number))
    if not lora_updates:
        return model
    if not isinstance(model, PeftModel):
        raise ConfigError(
            f"hp_space: {', '.join(lora_updates)} given but the model is not a PEFT (LoRA) model; "
            "drop them from hp_space or return a PeftModel from model_init"
        )
    return with_adapters(*unload(model), lora_updates)


def run_trial(trainer: Any, search: Any, plan: TrialPlan) -> Outcome:
    """Train one trial on this rank and say how it ended; the trial's state is released whatever happens."""
    callback = TrialCallback(search.compute_objective, search.direction, search.decide if sync.rank() == 0 else None)
    started = time.perf_counter()
    model_seconds = 0.0
    state, error = COMPLETE, None
    model_init = trainer.model_init
    try:
        setup_error: Exception | None = None
        try:
            lora_updates = configure_trial(trainer, search, plan)
            built = time.perf_counter()
            trainer.model = trainer.model_wrapped = build_model(trainer, search, plan, lora_updates)
            model_seconds = time.perf_counter() - built
        except Exception as exception:
            setup_error = exception
        # Every rank says whether it is ready before any trains: a rank whose setup failed must not leave the
        # others waiting in the first collective of training (DDP's broadcast of the weights) forever.
        error = None if setup_error is None else f"{type(setup_error).__name__}: {setup_error}"
        building_is_collective = is_deepspeed_zero3_enabled()
        timeout = search.settings.trial_end_timeout if building_is_collective else trainer.args.ddp_timeout
        ready = sync.gather_ready(plan.number, error, timeout, building_is_collective)
        if setup_error is not None:
            raise setup_error
        if not all(ready):
            raise TrialFailedElsewhere(f"rank {ready.index(False)} could not set the trial up")
        if trainer.place_model_on_device:
            trainer.model.to(trainer.args.device)
        trainer.optimizer = trainer.lr_scheduler = None
        trainer._wrapping_checked = False  # ScaleTrainer checks the new wrapper at the trial's first step
        trainer.add_callback(callback)
        trainer.model_init = None  # train() would otherwise build the model a second time
        trainer.train()
        if callback.best.evaluations == 0:
            trainer.evaluate()  # no evaluation during training: score the end of it
        if callback.pruned:
            state = PRUNED
        elif callback.stopped:
            state = STOPPED
        elif callback.keep and not callback.saved_best and callback.best.step == trainer.state.global_step:
            # The best evaluation came when no checkpoint is written (evaluated only at the end, or not at a save
            # step): the model as it ended is that evaluation's model.
            trainer.save_model(str(Path(trainer.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{callback.best.step}"))
    except sync.TrialEndMissed:
        raise  # the other ranks are stuck: this process ends
    except TrainingDiverged as exception:  # this trial's hyperparameters (a learning rate too high): the search goes on
        state, error = FAILED, f"TrainingDiverged: {exception.summary} (its diagnosis checkpoint is not kept)"
        shutil.rmtree(exception.diagnosis.parent, ignore_errors=True)  # a failed trial keeps no checkpoint
    except HfScaleError as exception:  # a wrong setting: the next trial would fail the same way
        state, error = ABORTED, f"{type(exception).__name__}: {exception}"
    except Exception as exception:
        state = FAILED
        error = f"{type(exception).__name__}: {exception}\n" + "".join(traceback.format_exc(limit=-4))
    finally:
        trainer.model_init = model_init
        trainer.pop_callback(callback)
        model = trainer.model
        release_trial(trainer)
        search.take_back(model)
        del model
        gc.collect()
    return Outcome(
        state=state,
        value=callback.best.value,
        evaluations=callback.best.evaluations,
        best_evaluation=callback.best.evaluation,
        best_step=callback.best.step,
        checkpoint=callback.best_checkpoint(trainer.args.output_dir) if state == COMPLETE else None,
        error=error,
        seconds=time.perf_counter() - started,
        model_seconds=model_seconds,
        rss_bytes=psutil.Process().memory_info().rss,
    )


def release_trial(trainer: Any) -> None:
    """Drop the trial's model, wrapper, optimizer, scheduler and engine from the trainer; free what nothing else holds.

    The Trainer hands them to its callbacks and to the Accelerator, which keeps its own lists: unless every reference
    goes, each trial's model and optimizer states stay alive and memory grows trial after trial. The caller may still
    hold the model (the LoRA fast path keeps its base): the last collection is the caller's."""
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()  # DeepSpeed keeps hooks and buffers that refer to the module until destroyed
    trainer.deepspeed = trainer.model_wrapped = trainer.model = trainer.optimizer = trainer.lr_scheduler = None
    handler = trainer.callback_handler
    for name in ("model", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"):
        setattr(handler, name, None)
    # Its lists of prepared models, optimizers, schedulers and loaders; then gc and the device's cache.
    trainer.accelerator.free_memory()


class TrialCallback(TrainerCallback):
    """Scores, prunes and stops one trial in step on every rank; keeps its best checkpoint only.

    At each evaluation it scores the trial, asks rank 0 whether to prune or stop (`decide`, rank 0's only: it asks
    the study and the clock), and applies the one answer on every rank, so that all of them leave the loop after the
    same evaluation."""

    def __init__(self, compute_objective: Objective, direction: str, decide: Any) -> None:
        self.compute_objective = compute_objective
        self.direction = direction
        self.decide = decide  # (value, evaluation number) -> Decision
        self.best = BestValue(direction)
        self.pruned = False
        self.stopped = False
        self.keep = False  # whether the last evaluation is worth a checkpoint
        self.saved_best = False  # whether the trial's best evaluation has its checkpoint

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = float(self.compute_objective(dict(metrics or {})))
        if self.best.evaluations == 0:
            check_against_direction(value, dict(metrics or {}), self.direction)
        is_best = self.best.update(value, state.global_step)
        decision = None
        if self.decide is not None:
            try:
                decision = self.decide(value, self.best.evaluations)
            except Exception as error:  # every rank must hear about it, or they wait in the broadcast below forever
                decision = Decision(error=f"{type(error).__name__}: {error}")
        decision = sync.broadcast(decision)
        if decision.error:
            raise TrialFailedOnRank0(f"rank 0 could not record evaluation {self.best.evaluations}: {decision.error}")
        # Only the trial's best evaluation, and only when it beats the study, is worth a checkpoint.
        self.keep = is_best and decision.beats_study and not (decision.prune or decision.stop)
        self.saved_best = self.saved_best and not is_best  # a better evaluation makes the last checkpoint stale
        control.should_save = control.should_save and self.keep
        if decision.prune or decision.stop:
            self.pruned, self.stopped = decision.prune, decision.stop
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.saved_best = True
        if args.should_save:
            keep = f"{PREFIX_CHECKPOINT_DIR}-{self.best.step}"
            for folder in Path(args.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
                if folder.name != keep:
                    shutil.rmtree(folder, ignore_errors=True)
        return control

    def best_checkpoint(self, output_dir: str) -> str | None:
        path = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.best.step}"
        return str(path) if path.is_dir() else None
