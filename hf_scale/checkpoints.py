"""Checkpoints are whole or ignored: a save killed half-way never becomes the checkpoint a resume picks.

The Trainer writes `checkpoint-N/` file by file, and `get_last_checkpoint` picks the highest N whatever is in
it, so a job killed while saving resumes from a torn checkpoint and fails (or, worse, loads half-written
state). ScaleTrainer writes a marker file into the folder once every process has finished writing and the
files are on disk; a resume takes the newest folder with the marker and removes newer ones without it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from transformers import TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME

COMPLETE_MARKER = "hf_scale_checkpoint_complete"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def mark_complete(folder: str | os.PathLike) -> None:
    """Flush the checkpoint's files to disk, then write the marker atomically (temporary file and rename)."""
    os.sync()  # the files the processes wrote reach the disk before the marker says they are there
    marker = Path(folder) / COMPLETE_MARKER
    temporary = marker.with_suffix(".tmp")
    temporary.write_text("complete\n")
    os.replace(temporary, marker)


def is_complete(folder: str | os.PathLike) -> bool:
    return (Path(folder) / COMPLETE_MARKER).is_file()


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, oldest (lowest N) first."""
    found = [path for path in Path(output_dir).glob("checkpoint-*") if _CHECKPOINT.match(path.name) and path.is_dir()]
    return sorted(found, key=lambda path: int(path.name.removeprefix("checkpoint-")))


def last_complete_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose save finished, or None.

    Example:
        resume = last_complete_checkpoint(args.output_dir) is not None  # e.g. after a torchrun restart
        trainer.train(resume_from_checkpoint=True if resume else None)
    """
    return next((path for path in reversed(checkpoints(output_dir)) if is_complete(path)), None)


def remove_incomplete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Delete the checkpoints newer than the last complete one that have no marker (interrupted saves)."""
    found, last = checkpoints(output_dir), last_complete_checkpoint(output_dir)
    torn = found[found.index(last) + 1 :] if last is not None else found
    for path in torn:
        shutil.rmtree(path, ignore_errors=True)
    return torn


def finished_step(checkpoint: str | os.PathLike, args: TrainingArguments) -> int | None:
    """The checkpoint's global step when it is already at the end of the run `args` describe, else None.

    The end is `args.max_steps`, or for a run by epochs the step count the checkpoint's own run was heading for
    (when the number of epochs is unchanged). The stock Trainer, resumed from such a checkpoint, trains one more
    step and saves it: each relaunch of a finished run changed its model.
    """
    state_file = Path(checkpoint) / TRAINER_STATE_NAME
    if not state_file.is_file():
        return None
    state = TrainerState.load_from_json(str(state_file))
    if args.max_steps > 0:
        end = args.max_steps
    elif state.num_train_epochs == args.num_train_epochs:
        end = state.max_steps
    else:
        return None
    return state.global_step if state.global_step >= end else None
