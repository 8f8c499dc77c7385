"""The rank protocol of a search, all of it: rank 0 owns the study and decides; the other ranks hear each decision.

Per trial: rank 0 broadcasts a `TrialPlan` (or `SKIP` when it could not sample one, or None for "stop"); every rank
sets the trial up and says whether it is ready (`gather_ready`); after each evaluation rank 0 broadcasts a
`Decision` (prune, stop); at the trial's end every rank meets the others and gathers every rank's `Outcome`
(`end_trial`). Every rank makes the same calls in the same order, so none waits on a collective that another rank
skipped: that wait is the hang of the stock backend, whose rank 0 alone raises `TrialPruned`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hf_scale.errors import HfScaleError

SKIP = "skip"  # rank 0's message when it could not even sample a trial
COMPLETE, PRUNED, STOPPED, FAILED, ABORTED = "complete", "pruned", "stopped", "failed", "aborted"

_control_group: Any = None  # gloo, apart from the training's group: a trial's end never meets a training collective


@dataclass
class TrialPlan:
    """What rank 0 sends every rank before a trial."""

    number: int
    params: dict[str, Any]  # what the trial applies (hp_space's dict)
    suggested: dict[str, Any]  # what Optuna sampled (trial.params), for model_init(trial) on every rank
    run_name: str


@dataclass
class Decision:
    """Rank 0's answer after one evaluation."""

    prune: bool = False
    stop: bool = False  # the search's time is up: end this trial now, start no other
    # The value beats every finished trial of the study: only then can this trial's checkpoint be the one reloaded
    # at the end, so only then is it written (a LLaMA-7B checkpoint is 13 GB).
    beats_study: bool = True
    error: str | None = None  # rank 0 could not decide (the study's storage failed): every rank stops the trial


@dataclass
class Outcome:
    """How a trial ended on one rank."""

    state: str
    value: float | None = None
    evaluations: int = 0
    best_evaluation: int = 0
    best_step: int = 0
    checkpoint: str | None = None
    error: str | None = None
    seconds: float = 0.0
    model_seconds: float = 0.0  # building the model (model_init, or only the adapters on the LoRA fast path)
    rss_bytes: int | None = None  # this process's resident memory once the trial's state is released


class TrialEndMissed(HfScaleError):
    """A rank's trial raised and the other ranks did not reach the trial's end: they wait inside training."""


def is_distributed() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank (any picklable object); a no-op in a single process."""
    if not is_distributed():
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (over `group`, the training's by default)."""
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def start_control_group(timeout: float) -> None:
    """Every rank, before the first trial: the group on which trials end (a collective: all ranks call it).

    Its operations give up after `timeout` seconds (a `monitored_barrier`'s own timeout binds only rank 0).
    """
    global _control_group
    if is_distributed() and _control_group is None:
        _control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


def gather_ready(number: int, error: str | None, timeout: float, building_is_collective: bool) -> list[bool]:
    """Every rank, once trial `number` is set up (its model built, or `error`): whether each rank is ready to train.

    Where building the model is itself a collective (ZeRO-3), a rank whose setup raised would wait forever: the
    others wait inside the build for it and never arrive. There the exchange runs on the control group, which gives
    up after `timeout` seconds; this rank then raises `TrialEndMissed`, its process ends, and the launcher ends the
    others. Elsewhere each rank builds its own model, and one may take much longer (a 70B model from a slow disk):
    the exchange runs on the training's group and waits as long as its first collective would have (`timeout` is
    then `ddp_timeout`, that group's own).
    """
    try:
        return gather(error is None, group=_control_group if building_is_collective else None)
    except RuntimeError as missed:
        raise TrialEndMissed(setup_missed_message(number, error, timeout, missed, building_is_collective)) from None


def setup_missed_message(
    number: int, error: str | None, timeout: float, missed: Exception, building_is_collective: bool
) -> str:
    """Why the job ends when the ranks did not all finish setting trial `number` up within `timeout` seconds."""
    here = f"setting it up raised here: {error.splitlines()[0]}" if error else "it is set up here"
    where = (
        "they wait inside it (under ZeRO-3, building the model is a collective of all ranks)"
        if building_is_collective
        else "a rank is still building its model, or has stopped"
    )
    return (
        f"trial {number} on rank {rank()}: {here}, but not every rank finished setting it up (waited at most "
        f"{timeout:g} s: {str(missed).splitlines()[0]}); {where}. The job ends here; starting the search again goes "
        "on with the study."
    )


def end_trial(number: int, outcome: Outcome, timeout: float) -> list[Outcome]:
    """Every rank, after each trial: wait until all ranks have ended trial `number`, then every rank's outcome.

    A trial that raised on every rank (or on none) meets at once. One that raised on some ranks only leaves the
    others blocked in a collective of the training step, which would wait for the process group's timeout (30
    minutes by default): the ranks that got here wait at most `timeout` seconds, then raise `TrialEndMissed`, their
    process ends, and the launcher ends the others (their blocked collective fails when a peer's connection closes).
    """
    if is_distributed():
        try:
            dist.barrier(group=_control_group)
        except RuntimeError as missed:
            cause = f"it raised here: {outcome.error.splitlines()[0]}" if outcome.error else "it ended here"
            raise TrialEndMissed(
                f"trial {number} on rank {rank()}: {cause}, but not every rank reached the trial's end (waited at "
                f"most {timeout:g} s: {str(missed).splitlines()[0]}); they wait inside training. The job ends here; "
                "the study keeps the trial as failed, and starting the search again goes on with the next trial."
            ) from None
    return gather(outcome)
