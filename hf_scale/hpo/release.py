"""Release everything a trial built, on every rank, before the next trial starts.

The Trainer keeps the model, its DDP or DeepSpeed wrapper, the optimizer and scheduler, and hands them to its
callbacks and to the Accelerator, which keeps its own lists: unless every reference goes, each trial's model and
optimizer states stay alive and memory grows trial after trial.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


def release_trial(trainer: Any) -> None:
    """Drop the trial's model, wrapper, optimizer, scheduler and engine from the trainer; free what nothing else holds.

    The caller may still hold the model (the LoRA fast path keeps its base): the last collection is the caller's."""
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()  # DeepSpeed keeps hooks and buffers that refer to the module until destroyed
    trainer.deepspeed = None
    trainer.model_wrapped = None
    trainer.model = None
    trainer.optimizer = None
    trainer.lr_scheduler = None
    handler = trainer.callback_handler
    for name in ("model", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"):
        setattr(handler, name, None)
    # Its lists of prepared models, optimizers, schedulers and loaders; then gc and the device's cache.
    trainer.accelerator.free_memory()


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Exempt every object alive now (modules, datasets, the tokenizer) from garbage collection while inside.

    A full collection walks every object: with transformers, peft and deepspeed imported that is about a second, and
    accelerate collects at every train() and every release. Frozen, a collection looks only at what the trials
    created, which is what it is there to free."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
