"""Keeping every rank in step: rank 0 owns the study and decides; the other ranks hear each decision.

Each trial is one message from rank 0 (the parameters, or "stop"), one decision per evaluation (prune, stop) and
one gathering of every rank's outcome (how the trial ended there). Every rank makes the same calls in the same
order, so none waits on a collective that another rank skipped: that wait is the hang of the stock backend, whose
rank 0 alone raises `TrialPruned`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


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


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
