"""The divergence guard: a NaN or Inf loss, or a spike far above the running mean, is caught at its step.

The stock Trainer's `logging_nan_inf_filter` hides a NaN loss from the logs and trains on; the weights turn to
NaN and the run burns hours. `ScaleTrainer` hands the guard each optimizer step's loss once: the per-token loss of
all the step's micro-batches on all processes, the loss the Trainer logs for that step. It is taken with the step's
last micro-batch, before its backward, so a bad step is stopped or skipped before any weight moves. Micro-batches
are never judged one by one: transformers divides each one's loss by the whole step's token count, so with
accumulation and uneven lengths their losses differ many-fold without anything being wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hf_scale.errors import HfScaleError

WARMUP_STEPS = 10  # the running mean needs some history before a spike can be told from the start
EMA_DECAY = 0.9


class TrainingDiverged(HfScaleError, RuntimeError):
    """The loss became NaN/Inf or spiked. `summary` names the step, the problem and the learning rate; `diagnosis` is
    the checkpoint of the weights before that step."""

    def __init__(self, summary: str, diagnosis: Path) -> None:
        super().__init__(
            f"{summary}; the weights before this step and the optimizer state are saved in {diagnosis} for diagnosis "
            "(--resume goes on from the last periodic checkpoint, not from it)"
        )
        self.summary, self.diagnosis = summary, diagnosis


@dataclass
class DivergenceGuard:
    """Judges each step's loss against finiteness and `spike_factor` x its running mean (None: no spike check)."""

    spike_factor: float | None = None
    running_mean: float | None = None
    seen: int = 0  # steps judged good
    skipped: int = 0  # steps skipped (divergence_action="skip")
    last_loss: float | None = None

    def problem(self, loss: float) -> str | None:
        """Why `loss` is bad, or None; a good loss updates the running mean."""
        self.last_loss = loss
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        if (
            self.spike_factor is not None
            and self.running_mean is not None
            and self.seen >= WARMUP_STEPS
            and loss > self.spike_factor * self.running_mean
        ):
            return f"the loss {loss:.4g} is over {self.spike_factor:g}x its running mean {self.running_mean:.4g}"
        self.seen += 1
        self.running_mean = (
            loss if self.running_mean is None else EMA_DECAY * self.running_mean + (1 - EMA_DECAY) * loss
        )
        return None
