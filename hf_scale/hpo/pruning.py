"""Which pruner stops bad trials early: the median rule by default, Hyperband on request, none for multi-objective.

A trial reports its objective at each evaluation with the evaluation's number (1, 2, ...) as the step, so that
trials with different batch sizes or epoch lengths are compared at the same point of their training, and the
warm-up is counted in evaluations.
"""

from __future__ import annotations

import optuna

from hf_scale.errors import ConfigError

PRUNERS = ("median", "hyperband", "none")


def make_pruner(
    name: str = "median", startup_trials: int = 4, warmup_evaluations: int = 1, multi_objective: bool = False
) -> optuna.pruners.BasePruner:
    """The pruner called `name`.

    median: a trial is stopped when its value at an evaluation is worse than the median of the earlier trials' values
    at the same evaluation, once `startup_trials` trials have finished and after its first `warmup_evaluations`
    evaluations. hyperband: successive halving over brackets, from 1 evaluation to as many as a full trial makes.
    Multi-objective searches never prune (Optuna cannot compare vectors at one step).
    """
    if name not in PRUNERS:
        raise ConfigError(f"pruner: unknown pruner {name!r}; choose one of {', '.join(PRUNERS)}")
    if startup_trials < 0 or warmup_evaluations < 0:
        raise ConfigError("pruner: startup_trials and warmup_evaluations must be >= 0")
    if multi_objective or name == "none":
        return optuna.pruners.NopPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto", reduction_factor=3)
    # Optuna never prunes at a step below n_warmup_steps; steps here start at evaluation 1.
    return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_evaluations + 1)
