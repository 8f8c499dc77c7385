"""The search: rank 0 runs the Optuna study, every rank runs each trial, and all end together.

Rank 0 asks the study for a trial, samples every value (`hp_space`) and sends the plan; every rank runs it
(`trial.run_trial`); every rank's outcome is gathered, so a trial that raised anywhere is recorded FAIL and the
search goes on with all ranks in step. When the budget, the clock or a failure limit says so, rank 0 sends "stop".
At the end the best trial's model is reloaded (or retrained) into the trainer on every rank and saved.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from peft import PeftModel
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, BestRun

from hf_scale.errors import ConfigError, HfScaleError
from hf_scale.hpo import sync
from hf_scale.hpo.lora import fast_path_applies, unload
from hf_scale.hpo.objective import metric_objective, objective_metric, resolve_direction
from hf_scale.hpo.parallel import JOURNAL_FILE, run_workers, worker_id
from hf_scale.hpo.policy import NOT_RUN, SAME_ERROR_TRIALS, best_of, runs_of, same_error_every_time
from hf_scale.hpo.settings import make_pruner, split_kwargs
from hf_scale.hpo.space import default_hp_space
from hf_scale.hpo.storage import DEFAULT_STUDY_FILE, JournalHeartbeat, open_storage, quiet_experimental
from hf_scale.hpo.sync import ABORTED, COMPLETE, FAILED, SKIP, STOPPED, Decision, TrialPlan
from hf_scale.hpo.trial import (
    PER_TRIAL_FIELDS,
    build_model,
    configure_trial,
    run_trial,
    trial_folder,
)
from hf_scale.safety import mask_secrets


class TrialFailed(RuntimeError):
    """A trial raised on at least one rank; the study records it FAIL and the search goes on."""


class TrialNotRun(TrialFailed):
    """Asked for beyond n_trials (workers that asked at the same moment): recorded FAIL with `not_run`, not counted."""


@dataclass
class BestTrial(TrialPlan):
    """What every rank needs to know about the best trial to reload or retrain it."""

    value: float
    checkpoint: str | None


def say(message: str) -> None:
    if sync.rank() == 0:
        worker = worker_id()
        print(f"hf_scale hpo{f' [worker {worker}]' if worker else ''}: {message}", flush=True)


class Search:
    """One hyperparameter search over a ScaleTrainer; `run()` is called on every rank."""

    def __init__(
        self,
        trainer: Any,
        hp_space: Any,
        compute_objective: Any,
        n_trials: int,
        direction: Any,
        hp_name: Any,
        kwargs: dict[str, Any],
    ) -> None:
        settings, self.study_kwargs, optimize = split_kwargs({"n_trials": n_trials, **kwargs})
        self.settings = settings
        self.trainer = trainer
        args = trainer.args
        if settings.n_trials < 1:
            raise ConfigError(f"n_trials: must be at least 1, got {settings.n_trials}")
        if settings.parallel_trials < 1:
            raise ConfigError(f"parallel_trials: must be at least 1, got {settings.parallel_trials}")
        # The process that starts the workers of a parallel search runs no trial itself.
        self.launches_workers = settings.parallel_trials > 1 and worker_id() is None
        self.direction = resolve_direction(
            settings.direction if direction is None else direction, compute_objective, args
        )
        self.compute_objective = compute_objective or metric_objective(objective_metric(args))
        self.objective_label = "compute_objective" if compute_objective else objective_metric(args)
        self.optimize_kwargs = optimize
        self.hp_name = hp_name
        self.output_dir = args.output_dir
        self.base_run_name = args.run_name if args.run_name and args.run_name != args.output_dir else "hpo"
        # The LoRA fast path's base and adapter config between trials (the model Trainer built or was given first).
        self.lora_base: tuple[Any, Any] | None = None
        initial_model = trainer.model
        self.take_back(initial_model)
        if trainer.model_init is None and self.lora_base is None:
            raise ConfigError(
                "hyperparameter_search needs model_init (a fresh model for each trial), or a LoRA PeftModel "
                "whose adapters it re-creates for each trial (lora_fast_path)"
            )
        # Each trial builds its own model; this one would only hold memory (the callback handler holds it too).
        trainer.model = trainer.model_wrapped = trainer.callback_handler.model = None
        # Sized by the processes that each see their own batch (tensor-parallel ranks share one).
        self.hp_space = hp_space or default_hp_space(
            args.data_parallel_size, peft=isinstance(initial_model, PeftModel), min_learning_rate=args.min_learning_rate
        )
        self.base_args = args  # each trial's arguments are built from these; the trainer gets them back at the end
        self.study: optuna.Study | None = None
        self.trial: optuna.Trial | None = None
        self.study_best: float | None = None  # the study's best value when the running trial started
        self.deadline = time.time() + settings.timeout if settings.timeout else None
        self.started = datetime.datetime.now()  # the trials of this search, not those of a study it goes on with
        self.peers_gone = False
        self.storage: optuna.storages.BaseStorage | None = None
        self.journal_heartbeat: JournalHeartbeat | None = None
        self.outcomes: list[dict[str, Any]] = []  # this worker's trials, for tests and the benchmark

    # ---- rank 0: the study ----

    def default_storage(self) -> str:
        """The study file in output_dir: a journal for parallel workers (one SQLite file locks them out in turn)."""
        output_dir = Path(self.output_dir).resolve()
        if self.settings.parallel_trials > 1 or (output_dir / JOURNAL_FILE).exists():
            return f"journal:{output_dir / JOURNAL_FILE}"
        return f"sqlite:///{output_dir / DEFAULT_STUDY_FILE}"

    def open_study(self) -> optuna.Study:
        settings = self.settings
        spec = settings.storage or self.default_storage()
        storage = self.study_kwargs.get("storage")  # an Optuna storage object, used as it is
        where = type(storage).__name__ if storage is not None else mask_secrets(spec)
        if storage is None:
            storage = open_storage(spec, settings.heartbeat_interval, settings.grace_period, settings.max_retry)
        pruner = self.study_kwargs.get("pruner") or make_pruner(
            settings.pruner, settings.startup_trials, settings.warmup_evaluations
        )
        try:
            study = optuna.create_study(
                storage=storage,
                study_name=settings.study_name,
                pruner=pruner,
                load_if_exists=self.study_kwargs.get("load_if_exists", True),
                direction=self.direction,
            )
        except ValueError as error:  # e.g. the stored study has other directions
            raise ConfigError(f"storage {where}, study {settings.study_name!r}: {error}") from None
        self.storage = storage
        if isinstance(storage, optuna.storages.JournalStorage):
            self.journal_heartbeat = JournalHeartbeat(
                study, storage, settings.heartbeat_interval, settings.grace_period, settings.max_retry
            )
        existing = len(study.trials)
        sampler = self.study_kwargs.get("sampler")
        if sampler is None:
            seed = settings.sampler_seed
            shared = settings.storage is not None or settings.parallel_trials > 1
            if seed is None:
                # A resumed study must not replay its first trials' values.
                seed = self.trainer.args.seed + existing
                if shared:  # workers that start together must not sample alike
                    seed += hash((socket.gethostname(), os.getpid())) % 100_000
            # constant_liar: a worker's sampler counts the other workers' running trials as bad, so that workers
            # asking at the same time do not all pick the same region.
            with quiet_experimental():  # constant_liar is marked experimental; every worker would warn
                sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=shared)
        study.sampler = sampler
        say(
            f"study {settings.study_name!r} in {where} with {existing} trial(s) already; "
            f"objective {self.objective_label} ({self.direction})"
        )
        return study

    def stop_reason(self) -> str | None:
        """Why no new trial should start, or None."""
        study = self.study
        if self.journal_heartbeat is not None:
            self.journal_heartbeat.fail_stale()
        else:
            with quiet_experimental():
                optuna.storages.fail_stale_trials(study)  # a dead worker's trial: FAIL and queued again
        trials = runs_of(study.get_trials(deepcopy=False))
        counted = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING) for t in trials)
        failures = sum(t.state == TrialState.FAIL for t in trials)
        if counted >= self.settings.n_trials:
            return f"the study holds {counted} trial(s), n_trials={self.settings.n_trials}"
        if self.deadline is not None and time.time() >= self.deadline:
            return f"timeout of {self.settings.timeout} s reached"
        max_failures = self.settings.max_failures or self.settings.n_trials
        if failures >= max_failures:
            return f"{failures} failed trial(s), max_failures={max_failures}"
        this_search = [t for t in trials if (t.datetime_start or self.started) >= self.started]
        if (error := same_error_every_time(this_search)) is not None:
            return f"its first {SAME_ERROR_TRIALS} trials failed with one error, which no value searched fixes: {error}"
        return None

    def check_within_budget(self, trial: optuna.Trial) -> None:
        """Raise TrialNotRun when the study held n_trials before this trial was created.

        Optuna has no cap shared by workers: each checks the study, then asks for a trial, so two workers that
        check at the same moment both get one. Trial numbers are given in the order trials are created, so the
        trials numbered below this one are exactly those that existed first.
        """
        earlier = [t for t in runs_of(self.study.get_trials(deepcopy=False)) if t.number < trial.number]
        counted = sum(t.state != TrialState.FAIL for t in earlier)
        if counted >= self.settings.n_trials:
            reason = f"the study already held n_trials={self.settings.n_trials} trial(s) when it was created"
            trial.set_user_attr(NOT_RUN, reason)
            say(f"trial {trial.number} not run: {reason}")
            raise TrialNotRun(reason)

    def decide(self, value: float, evaluation: int) -> Decision:
        """Rank 0, after each evaluation: report it, and say whether to prune or stop and whether it beats the study."""
        stop = self.deadline is not None and time.time() >= self.deadline
        self.trial.report(value, evaluation)
        beats = self.study_best is None or (
            value < self.study_best if self.direction == "minimize" else value > self.study_best
        )
        return Decision(prune=self.trial.should_prune(), stop=stop, beats_study=beats)

    def objective(self, trial: optuna.Trial) -> Any:
        """Rank 0's Optuna objective: sample, send the plan, run the trial with every rank, gather the outcomes."""
        self.trial = trial
        self.study_best = None
        with contextlib.suppress(ValueError):  # no complete trial yet
            self.study_best = self.study.best_value
        try:
            self.check_within_budget(trial)
            params = dict(self.hp_space(trial))
            run_name = self.hp_name(trial) if self.hp_name else f"{self.base_run_name}-trial-{trial.number}"
        except Exception:
            sync.broadcast(SKIP)
            raise
        plan = TrialPlan(trial.number, params, dict(trial.params), run_name)
        trial.set_user_attr("hyperparameters", params)
        trial.set_user_attr("run_name", run_name)
        trial.set_user_attr("output_dir", str(Path(self.output_dir).resolve() / trial_folder(trial.number)))
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        if worker_id() is not None:
            trial.set_user_attr("parallel_worker", worker_id())  # the launcher fails it if this worker dies
        say(f"trial {trial.number}: {json.dumps(params, default=str)}")
        sync.broadcast(plan)
        if self.journal_heartbeat is not None:
            self.journal_heartbeat.start(trial.number)
        try:
            outcome = run_trial(self.trainer, self, plan)
            outcomes = sync.end_trial(plan.number, outcome, self.settings.trial_end_timeout)
        finally:
            if self.journal_heartbeat is not None:
                self.journal_heartbeat.stop()
            self.trial = None
        for key in ("evaluations", "best_evaluation", "best_step", "checkpoint", "seconds", "model_seconds"):
            trial.set_user_attr(key, getattr(outcome, key))
        self.record(plan, outcomes)
        # The rank where it went wrong first: the others only say that some rank failed.
        failed = sorted(
            ((rank, o) for rank, o in enumerate(outcomes) if o.state == FAILED),
            key=lambda item: item[1].error.startswith("TrialFailedElsewhere"),
        )
        if failed:
            rank, failure = failed[0]
            trial.set_user_attr("error", f"rank {rank}: {failure.error}"[:2000])
            say(f"trial {trial.number} failed on rank {rank}: {failure.error.splitlines()[0]}")
            raise TrialFailed(f"rank {rank}: {failure.error.splitlines()[0]}")
        if outcome.state != COMPLETE:
            trial.set_user_attr("stopped_by", "timeout" if outcome.state == STOPPED else "pruner")
            say(
                f"trial {trial.number} {'stopped by the timeout' if outcome.state == STOPPED else 'pruned'}"
                f" after evaluation {outcome.evaluations}"
            )
            raise optuna.TrialPruned()
        say(f"trial {trial.number} complete: best {outcome.value} at evaluation {outcome.best_evaluation}")
        return outcome.value

    def record(self, plan: TrialPlan, outcomes: list[Any]) -> None:
        """Every rank, after each trial: keep this rank's outcome; end the search if a rank found a wrong setting."""
        self.outcomes.append({"number": plan.number, "params": plan.params, **asdict(outcomes[sync.rank()])})
        aborted = [o for o in outcomes if o.state == ABORTED]
        if aborted:
            self.peers_gone = True  # every rank raises this error now: nobody waits for another message
            raise ConfigError(f"trial {plan.number} cannot run: {aborted[0].error}")

    def after_trial(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """Optuna callback, after the user's: delete the checkpoints of the finished trials except the best trial's
        (the search keeps O(1) checkpoints; a trial still running, here or on another worker, keeps its own); stop
        the study when it is time."""
        # The best trial from the same list: read apart, a best trial finished in between would lose its checkpoint.
        trials = study.get_trials(deepcopy=False)
        best = best_of(trials, self.direction)
        finished = {t.number for t in trials if t.state.is_finished()} - {best.number if best else None}
        for number in finished:
            for checkpoint in (Path(self.output_dir) / trial_folder(number)).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
                shutil.rmtree(checkpoint, ignore_errors=True)
        if self.stop_reason() is not None:
            study.stop()

    def lead(self) -> None:
        """Rank 0: run trials until a stop reason (or a user's callback stops the study), then tell the others."""
        self.study = self.open_study()
        try:
            if (reason := self.stop_reason()) is None:
                optimize = self.optimize_kwargs
                self.study.optimize(
                    self.objective,
                    catch=(TrialFailed, *optimize.get("catch", ())),
                    callbacks=[*(optimize.get("callbacks") or ()), self.after_trial],
                    gc_after_trial=optimize.get("gc_after_trial", False),
                )
                reason = self.stop_reason() or "a callback stopped the study"
            say(f"search ends: {reason}")
        finally:
            if not self.peers_gone:
                sync.broadcast(None)

    def follow(self) -> None:
        """Any other rank: run the trials rank 0 sends until it says stop."""
        while (plan := sync.broadcast(None)) is not None:
            if plan == SKIP:
                continue
            outcome = run_trial(self.trainer, self, plan)
            self.record(plan, sync.end_trial(plan.number, outcome, self.settings.trial_end_timeout))

    # ---- every rank ----

    def take_back(self, model: Any) -> None:
        """After a trial: keep the LoRA base for the next one when the fast path applies."""
        if fast_path_applies(model, self.settings.lora_fast_path):
            self.lora_base = unload(model)

    def free_device_for_workers(self) -> None:
        """The launcher holds no model while its workers train: the best trial's is built again at the end (a kept
        LoRA base stays only when there is no model_init to build one)."""
        if self.trainer.model_init is not None:
            self.lora_base = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # memory held by this process's cache is memory no worker can have

    def best_trial(self) -> BestTrial | str:
        """Rank 0: the best trial, or why there is none."""
        study = self.study
        try:
            best = study.best_trial
        except ValueError:
            states = [t.state.name for t in study.trials]
            return f"no trial completed ({', '.join(f'{s}: {states.count(s)}' for s in sorted(set(states)))})"
        return BestTrial(
            number=best.number,
            value=best.value,
            params=best.user_attrs.get("hyperparameters", best.params),
            suggested=dict(best.params),
            checkpoint=best.user_attrs.get("checkpoint"),
            run_name=best.user_attrs.get("run_name", f"{self.base_run_name}-trial-{best.number}"),
        )

    def run(self) -> BestRun:
        sync.start_control_group(self.settings.trial_end_timeout)
        # Exempt every object alive now (modules, datasets, the tokenizer) from garbage collection during the search:
        # a full collection walks every object (about a second with transformers, peft and deepspeed imported), and
        # accelerate collects at every train() and every release. Frozen, it looks only at what the trials created.
        gc.collect()
        gc.freeze()
        try:
            if self.launches_workers:
                self.free_device_for_workers()
                self.study = self.open_study()
                say(f"search ends: {run_workers(self.study, self.storage, self.settings, say)}")
            elif sync.rank() == 0:
                self.lead()
            else:
                self.follow()
        finally:
            gc.unfreeze()
        if worker_id() is not None:
            # A worker of a parallel search ends here, and its program with it: the launcher reloads the best trial.
            say("no trial left for this worker")
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            raise SystemExit(0)
        best = sync.broadcast(self.best_trial() if sync.rank() == 0 else None)
        if isinstance(best, str):
            raise HfScaleError(f"hyperparameter_search: {best}")
        self.finish(best)
        if sync.rank() == 0 and self.settings.report:
            from hf_scale.hpo.report import write_report

            folder = write_report(self.study, Path(self.output_dir) / "hpo-report")
            say(f"trials table and plots in {folder}")
        return BestRun(str(best.number), best.value, best.params)

    def finish(self, best: BestTrial) -> None:
        """Every rank: the best trial's model in the trainer, reloaded from its checkpoint or retrained, and saved."""
        trainer = self.trainer
        lora_updates = configure_trial(trainer, self, best)
        trainer.args.run_name = self.base_args.run_name
        have_checkpoint = best.checkpoint is not None and os.path.isdir(best.checkpoint)
        everyone_has_it = all(sync.gather(have_checkpoint))
        retrain = self.settings.retrain_best or not everyone_has_it or is_deepspeed_zero3_enabled()
        model = build_model(trainer, self, best, lora_updates)
        trainer.model = trainer.model_wrapped = model
        if trainer.place_model_on_device:
            model.to(trainer.args.device)
        trainer._wrapping_checked = False
        if retrain:
            why = "retrain_best" if self.settings.retrain_best else "its checkpoint is not on every node or ZeRO-3"
            say(f"best trial {best.number} ({best.value}): training it again ({why})")
            trainer.args.output_dir = str(Path(self.output_dir) / "best-retrain")
            if self.launches_workers:
                train_on_one_device(trainer.args)
            model_init, trainer.model_init = trainer.model_init, None
            try:
                trainer.train()
            finally:
                trainer.model_init = model_init
                trainer.args.output_dir = self.base_args.output_dir
        else:
            say(f"best trial {best.number} ({best.value}): reloading {best.checkpoint}")
            # The Trainer's own loader (resume and load_best_model_at_end use it): full weights, shards or adapters.
            trainer._load_from_checkpoint(best.checkpoint, model)
        # A reloaded model has no DeepSpeed engine yet: under ZeRO-1/2 every rank holds the whole model, and the stock
        # save_model would ask the missing engine to save it.
        deepspeed = trainer.is_deepspeed_enabled
        trainer.is_deepspeed_enabled = deepspeed and trainer.deepspeed is not None
        try:
            trainer.save_model(str(Path(self.output_dir) / "best-model"))
        finally:
            trainer.is_deepspeed_enabled = deepspeed
        for name in PER_TRIAL_FIELDS:  # the best trial's values stay; the search's own settings go
            setattr(trainer.args, name, getattr(self.base_args, name))
        if trainer.is_world_process_zero():
            (Path(self.output_dir) / "best-model" / "hpo_best_trial.json").write_text(
                json.dumps({**asdict(best), "retrained": retrain}, indent=2, default=str) + "\n"
            )


def train_on_one_device(args: Any) -> None:
    """The launcher of a parallel search retrains on one device, as each worker trained its trials.

    It sees every GPU of the node, where the stock Trainer would wrap the model in nn.DataParallel and train a
    batch as many times larger (the launcher refuses workers of several GPUs that would need it to retrain). Trainer
    sets `_n_gpu` itself the same way for a model-parallel model.
    """
    if args.n_gpu > 1:
        args._n_gpu = 1


def hyperparameter_search(
    trainer: Any,
    hp_space: Any = None,
    compute_objective: Any = None,
    n_trials: int = 20,
    direction: str | None = None,
    backend: str | None = None,
    hp_name: Any = None,
    **kwargs: Any,
) -> BestRun:
    """`Trainer.hyperparameter_search` with Optuna, for one or many processes; see `ScaleTrainer`."""
    if backend is not None and str(getattr(backend, "value", backend)) != "optuna":
        raise ConfigError(f"backend: hf_scale's search runs on Optuna only, got {backend!r}")
    search = Search(trainer, hp_space, compute_objective, n_trials, direction, hp_name, kwargs)
    trainer.hp_search_outcomes = search.outcomes
    try:
        return search.run()
    finally:
        trainer.hp_search_study = search.study
