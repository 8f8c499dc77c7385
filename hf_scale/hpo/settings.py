"""`SearchArguments`: hf_scale's settings of a search, beside HF's `hyperparameter_search` arguments (split from them
by `split_kwargs`), and the Optuna pruner they name (`make_pruner`).

Each field can be given to `ScaleTrainer.hyperparameter_search(..., field=value)`, or as a YAML key or flag of
the search recipe. `n_trials`, `timeout` and `direction` mean what they mean in HF and Optuna, except that
`n_trials` counts the whole study: a resumed search, or several workers on one study, stop together at n_trials.
"""

from dataclasses import dataclass, field, fields
from typing import Any

import optuna

from hf_scale.errors import ConfigError
from hf_scale.hpo.parallel import check_launched_alone

# No `from __future__ import annotations`: HfArgumentParser reads these types at run time.


@dataclass
class SearchArguments:
    """How a hyperparameter search runs, stores its study and ends."""

    n_trials: int = field(
        default=20,
        metadata={
            "help": "Trials the study should hold (complete or pruned; running ones on other workers count). "
            "Failed trials do not count: they are retried or replaced."
        },
    )
    timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds after which the search ends: the running trial stops at its next evaluation (recorded "
            "as pruned, its values kept) and no new trial starts."
        },
    )
    direction: str | None = field(
        default=None,
        metadata={"help": "minimize or maximize; default: what the objective metric needs (minimize for a loss)."},
    )
    storage: str | None = field(
        default=None,
        metadata={
            "help": "Where the study lives: an Optuna RDB URL (sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB) "
            "or journal:PATH (a journal file on a shared filesystem). Default: optuna_study.db in output_dir, so "
            "an interrupted search resumes where it stopped."
        },
    )
    study_name: str = field(default="hf_scale", metadata={"help": "The study's name in the storage."})
    pruner: str = field(
        default="median",
        metadata={
            "help": "median (default); asha (asynchronous successive halving: a trial goes on past evaluations 1, "
            "3, 9, ... only when it is in the best third there, which suits parallel_trials); hyperband; none."
        },
    )
    startup_trials: int = field(
        default=4, metadata={"help": "median pruner: trials that finish before any trial is pruned."}
    )
    warmup_evaluations: int = field(
        default=1, metadata={"help": "median pruner: evaluations of each trial that are never pruned."}
    )
    heartbeat_interval: int = field(
        default=60,
        metadata={
            "help": "Seconds between a running trial's heartbeats in the storage; a trial whose heartbeat stops "
            "(its worker died) is marked failed and queued again after grace_period."
        },
    )
    grace_period: int | None = field(
        default=None, metadata={"help": "Seconds without a heartbeat before a trial counts as dead; default 2x."}
    )
    max_retry: int = field(default=2, metadata={"help": "How often a dead worker's trial is run again."})
    max_failures: int | None = field(
        default=None,
        metadata={
            "help": "End the search after this many failed trials (default: n_trials). A trial fails, and the search "
            "goes on, when it raises or its training diverges (its loss NaN/Inf or spiking: a learning rate too "
            "high). The search ends at once on a wrong setting (a configuration error, at its first trial) and when "
            "its first 3 trials fail with one error other than a divergence (a broken setup, e.g. a missing package)."
        },
    )
    trial_end_timeout: float = field(
        default=300,
        metadata={
            "help": "Seconds a process whose trial raised waits for the others to end that trial too. A rank that "
            "raised alone leaves the others waiting in a collective of the training step: after this wait the "
            "job ends with a message naming the trial and rank (the study keeps the trial as failed) instead of "
            "hanging until the process group's timeout. Under ZeRO-3, also how long ranks wait for each other to "
            "build a trial's model (there building it is a collective); elsewhere that wait is the process group's "
            "own (`ddp_timeout`), since one rank may take far longer than the others to load the model."
        },
    )
    parallel_trials: int = field(
        default=1,
        metadata={
            "help": "Trials run at once on this node, each by its own worker on 1/K of its GPUs (one process each on "
            "CPU), all on one study (default storage: journal:output_dir/optuna_journal.log). Start the search as "
            "one process (hf-scale search, python): it starts the K workers, replaces one that dies in a trial "
            "(the trial is marked failed and queued again), then reloads the best trial and writes the report once. "
            "For searches whose trial fits 1/K of the node (LoRA, QLoRA): no gradient traffic between trials."
        },
    )
    retrain_best: bool = field(
        default=False,
        metadata={
            "help": "Train the best trial's settings again at the end instead of reloading its best checkpoint "
            "(always done when the checkpoint is on another node or the model is partitioned by ZeRO-3)."
        },
    )
    lora_fast_path: bool = field(
        default=True,
        metadata={"help": "For a LoRA model: load the base weights once, re-create only the adapters per trial."},
    )
    report: bool = field(
        default=True,
        metadata={"help": "Write the trials table and plots to output_dir/hpo-report at the end."},
    )
    sampler_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the default TPE sampler; default: the training seed plus the number of trials "
            "already in the study, so a resumed search does not repeat the first trials' values."
        },
    )

    def __post_init__(self):
        check_launched_alone(self.parallel_trials)  # at parsing, before the data and the model are loaded


SEARCH_FIELDS = {f.name for f in fields(SearchArguments)}

# The learning-rate ranges of the two default spaces (log-uniform): fine-tuning's geometric centre is 3.2e-5, in
# the guide's 2e-5 to 5e-5; pre-training-like runs (or LoRA, which trains few weights from zero) take higher rates.
LEARNING_RATES = {"fine_tuning": (1e-5, 1e-4), "pre_training": (1e-5, 5e-4)}


@dataclass
class SpaceArguments:
    """The default search space's ranges (`default_hp_space`), as YAML keys and flags of the search recipe.

    The defaults are the guide's for LLaMA-2 fine-tuning; weight decay (0.01 to 0.3), the schedules and the LoRA
    values are fixed (`hf_scale.hpo.space`)."""

    search_space: str = field(
        default="fine_tuning",
        metadata={
            "help": "fine_tuning: learning rate 1e-5 to 1e-4, log (centred on 2e-5 to 5e-5); pre_training: "
            "1e-5 to 5e-4 (also right for LoRA). The keys below override the range."
        },
    )
    lr_min: float | None = field(default=None, metadata={"help": "Lowest learning rate (log-uniform)."})
    lr_max: float | None = field(default=None, metadata={"help": "Highest learning rate (log-uniform)."})
    per_device_batches: str = field(
        default="2,4,8", metadata={"help": "Per-device batch sizes to try, comma-separated."}
    )
    effective_batch_min: int = field(default=32, metadata={"help": "Smallest effective batch (all processes)."})
    effective_batch_max: int = field(default=128, metadata={"help": "Largest effective batch (all processes)."})
    warmup_ratio_max: float = field(default=0.1, metadata={"help": "Warm-up ratios tried: 0 to this."})

    def __post_init__(self):
        # Checked here, before any data or model is loaded: a typo in a range would otherwise surface in trial 0.
        if self.search_space not in LEARNING_RATES:
            raise ConfigError(f"search_space: unknown space {self.search_space!r}; choose {', '.join(LEARNING_RATES)}")
        low, high = self.learning_rate
        if not 0 < low < high:
            raise ConfigError(f"lr_min / lr_max: need 0 < lr_min < lr_max, got {low} and {high}")
        try:
            _ = self.per_device_batch_sizes
        except ValueError:
            raise ConfigError(f"per_device_batches: not a list of integers: {self.per_device_batches!r}") from None

    @property
    def learning_rate(self) -> tuple[float, float]:
        """The log-uniform learning-rate range: the space's, with lr_min and lr_max on top."""
        low, high = LEARNING_RATES[self.search_space]
        return self.lr_min or low, self.lr_max or high

    @property
    def per_device_batch_sizes(self) -> tuple[int, ...]:
        return tuple(int(value) for value in self.per_device_batches.split(","))


# Arguments of create_study and optimize that the search takes as HF's Optuna backend does, beside SearchArguments.
STUDY_KWARGS = {"sampler", "load_if_exists"}
OPTIMIZE_KWARGS = {"n_jobs", "gc_after_trial", "catch", "callbacks", "show_progress_bar"}
PRUNERS = ("median", "asha", "hyperband", "none")


def make_pruner(
    name: str = "median", startup_trials: int = 4, warmup_evaluations: int = 1
) -> optuna.pruners.BasePruner:
    """The pruner called `name`; a trial reports at each evaluation, numbered from 1, so that trials with different
    batch sizes or epoch lengths are compared at the same point of their training.

    median: a trial is stopped when its value at an evaluation is worse than the median of the earlier trials' values
    at the same evaluation, once `startup_trials` trials have finished and after its first `warmup_evaluations`
    evaluations. asha: asynchronous successive halving (Optuna's SuccessiveHalvingPruner): at evaluations 1, 3,
    9, ... a trial goes on only when it is in the best third of the trials that reached that evaluation, decided
    as each trial gets there, so parallel workers never wait for each other. hyperband: successive halving over
    brackets, from 1 evaluation to as many as a full trial makes.
    """
    if name not in PRUNERS:
        raise ConfigError(f"pruner: unknown pruner {name!r}; choose one of {', '.join(PRUNERS)}")
    if startup_trials < 0 or warmup_evaluations < 0:
        raise ConfigError("pruner: startup_trials and warmup_evaluations must be >= 0")
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto", reduction_factor=3)
    # Optuna never prunes at a step below n_warmup_steps; steps here start at evaluation 1.
    return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_evaluations + 1)


def split_kwargs(kwargs: dict[str, Any]) -> tuple[SearchArguments, dict[str, Any], dict[str, Any]]:
    """(hf_scale's settings, create_study arguments, optimize arguments); an unknown name is a ConfigError."""
    settings, study, optimize = {}, {}, {}
    for key, value in kwargs.items():
        if key in ("storage", "pruner") and not isinstance(value, str | None):
            study[key] = value  # an Optuna storage or pruner object, used as it is
        elif key in SEARCH_FIELDS:
            settings[key] = value
        elif key in STUDY_KWARGS:
            study[key] = value
        elif key in OPTIMIZE_KWARGS:
            optimize[key] = value
        else:
            known = sorted(SEARCH_FIELDS | STUDY_KWARGS | OPTIMIZE_KWARGS)
            raise ConfigError(f"hyperparameter_search: unknown argument {key!r}; known: {', '.join(known)}")
    if optimize.pop("n_jobs", 1) != 1:
        raise ConfigError(
            "n_jobs: a distributed search runs one trial at a time per worker (all processes train it); "
            "use parallel_trials for several trials at once"
        )
    return SearchArguments(**settings), study, optimize
