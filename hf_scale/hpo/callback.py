"""The callback that runs inside each trial's training loop, on every rank.

At each evaluation it scores the trial, asks rank 0 whether to prune or stop (rank 0 asks the study and the clock),
and applies the one answer on every rank, so that all of them leave the loop after the same evaluation. It also keeps
the trial's folder to one checkpoint: the best evaluation's.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_scale.hpo import sync
from hf_scale.hpo.objective import BestValue, Objective, check_against_direction


@dataclass
class Decision:
    """Rank 0's answer after one evaluation."""

    prune: bool = False
    stop: bool = False  # the search's time is up: end this trial now, start no other
    # The value beats every finished trial of the study: only then can this trial's checkpoint be the one reloaded
    # at the end, so only then is it written (a LLaMA-7B checkpoint is 13 GB).
    beats_study: bool = True
    error: str | None = None  # rank 0 could not decide (the study's storage failed): every rank stops the trial


# decide(value or None for multi-objective, evaluation number) -> Decision; rank 0 only.
Decide = Callable[[float | None, int], Decision]


class TrialFailedOnRank0(RuntimeError):
    """Rank 0 could not record an evaluation; every rank ends the trial with this error."""


class TrialCallback(TrainerCallback):
    """Scores, prunes and stops one trial in step on every rank; keeps its best checkpoint only."""

    def __init__(self, compute_objective: Objective, direction: str | list[str], decide: Decide | None) -> None:
        self.compute_objective = compute_objective
        self.multi_objective = not isinstance(direction, str)
        self.direction = direction
        self.decide = decide if sync.rank() == 0 else None
        self.best = BestValue(direction if isinstance(direction, str) else "minimize")
        self.last_values: list[float] | None = None
        self.pruned = False
        self.stopped = False
        self.keep = False  # whether the last evaluation is worth a checkpoint
        self.saved_best = False  # whether the trial's best evaluation has its checkpoint

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = self.compute_objective(dict(metrics or {}))
        if self.multi_objective:
            if not isinstance(value, Sequence) or len(value) != len(self.direction):
                raise TypeError(f"compute_objective must return {len(self.direction)} values, one per direction")
            self.last_values = [float(v) for v in value]
            self.best.evaluations += 1
            self.best.step = state.global_step
            is_best, reported = True, None  # no order between vectors: the last evaluation stands
        else:
            value = float(value)
            if self.best.evaluations == 0:
                check_against_direction(value, dict(metrics or {}), self.direction)
            is_best = self.best.update(value, state.global_step)
            reported = value
        decision = None
        if self.decide is not None:
            try:
                decision = self.decide(reported, self.best.evaluations)
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

    def result(self) -> Any:
        """The trial's objective: its best value, or the last evaluation's values for a multi-objective search."""
        return self.last_values if self.multi_objective else self.best.value
