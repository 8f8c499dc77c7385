"""The search's rules, read off the study's trials: which count toward n_trials, which is best, and when failed
trials say the setup is broken. Functions of a trial list, so that one read of the study decides each question."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

# This many failed trials in a row with one error, and none complete: a setup problem that no value of the search fixes.
SAME_ERROR_TRIALS = 3
# Set on a trial that was created but never run (TrialNotRun); such a trial counts neither as a trial nor a failure.
NOT_RUN = "not_run"


def runs_of(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The trials that ran or run (any state), without those created beyond n_trials and never run."""
    return [t for t in trials if NOT_RUN not in t.user_attrs]


def same_error_every_time(trials: list[optuna.trial.FrozenTrial]) -> str | None:
    """The error of the first SAME_ERROR_TRIALS finished trials when each failed with it (its first line), else None.

    A diverging training is left out: a learning rate too high is a value the search is there to rule out.
    """
    first = [t for t in trials if t.state.is_finished()][:SAME_ERROR_TRIALS]
    if len(first) < SAME_ERROR_TRIALS or any(t.state != TrialState.FAIL for t in first):
        return None
    # "rank 0: ModuleNotFoundError: ..." without the rank: the same error may be first seen on any rank.
    errors = {t.user_attrs.get("error", "").split("\n")[0].split(": ", 1)[-1] for t in first}
    error = errors.pop() if len(errors) == 1 else ""
    return error if error and not error.startswith("TrainingDiverged") else None


def best_of(trials: list[optuna.trial.FrozenTrial], direction: str) -> optuna.trial.FrozenTrial | None:
    """The best complete trial of `trials` (the study's rule: the first of equal values), or None."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        return None
    sign = 1 if direction == "minimize" else -1
    return min(complete, key=lambda t: (sign * t.value, t.number))
