"""The output folder: writable before any work starts, and a failed checkpoint save that leaves no broken checkpoint.

`check_output_dir` runs when the arguments are built: a run that could never save stops before it loads data.
`checkpoint_save_guard` wraps one checkpoint save: when the disk is full or the folder turns read-only mid-run,
it removes the half-written `checkpoint-N` (so that `--resume` does not pick it as the newest) and raises a
`SaveError` naming the folder, the cause and the previous checkpoint, which is left as it was; with several
processes, on every process at once, naming the one that failed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hf_scale.checkpoints import last_complete_checkpoint
from hf_scale.errors import ConfigError, SaveError

# A failed write is an OSError only from Python itself: torch.save raises RuntimeError ("PytorchStreamWriter failed
# writing file", "[enforce fail at inline_container.cc]"), safetensors SafetensorError and tokenizers a bare
# Exception, both ending in "(os error 28)".
_TORCH_WRITER = re.compile(r"PytorchStreamWriter|inline_container|file write failed")


def check_output_dir(output_dir: str | os.PathLike | None) -> None:
    """`output_dir` must be a folder this process can write into, or one it can create; a `ConfigError` otherwise.

    Writability is tried, not read from the permission bits: root passes every permission check, yet still
    cannot write on a read-only file system. Nothing is left behind: the probe file has no name or is removed.
    """
    if not output_dir:
        return
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir: {output_dir} exists and is not a folder")
    existing = path
    while not existing.exists():  # the folder is created later, by the trainer: its nearest ancestor must allow it
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir: cannot create {output_dir}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing) as probe:
            probe.write(b"\0")
            probe.flush()
    except OSError as error:
        problem = error.strerror or str(error)
        if existing == path:
            raise ConfigError(f"output_dir: {output_dir} is not writable ({problem})") from None
        raise ConfigError(f"output_dir: cannot create {output_dir}: {existing} is not writable ({problem})") from None


@contextmanager
def checkpoint_save_guard(
    checkpoint_dir: str | os.PathLike,
    gather: Callable[[str | None], list[str | None]] = lambda outcome: [outcome],
    removes_partial: bool = True,
) -> Iterator[None]:
    """Turn a write that fails while saving into `checkpoint_dir` into a `SaveError`, removing what it half wrote.

    Any other error passes through as it is, also without a half-written folder left behind for `--resume` to
    pick. A folder that existed before the save is never removed (it was not this save's to remove).
    With several processes, `gather` exchanges each one's outcome once its part of the save is over (a collective
    that every process calls, e.g. accelerate's `gather_object`): when any failed, every process stops with that
    process's reason, and the partial folder is removed by the one process with `removes_partial`, once nobody
    writes into it any more. Alone, a failed process would remove the folder the others are writing, and they would
    wait for it in their next collective.
    """
    checkpoint_dir = Path(checkpoint_dir)
    existed = checkpoint_dir.exists()
    error = None
    try:
        yield
    except Exception as caught:
        error = caught
    outcomes = gather(None if error is None else _failed_save_message(checkpoint_dir, error))
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if not failed:
        return
    leftover = ""
    if removes_partial and not existed:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        if checkpoint_dir.exists():
            leftover = f"; the partial folder {checkpoint_dir} could not be removed: delete it before resuming"
    if error is not None and not is_write_error(error):
        raise error
    rank, message = failed[0]
    where = f"rank {rank}: " if len(outcomes) > 1 else ""
    raise SaveError(where + message + leftover) from error


def is_write_error(error: BaseException) -> bool:
    """Whether `error` says that a file could not be written (disk full, read-only, too large, no permission)."""
    if isinstance(error, OSError):
        return True
    if re.search(r"\(os error \d+\)", str(error)):
        return True
    return isinstance(error, RuntimeError) and _TORCH_WRITER.search(str(error)) is not None


def _failed_save_message(checkpoint_dir: Path, error: BaseException) -> str:
    """The user's message for a failed checkpoint save: the folder, the cause, and what is left to resume from."""
    if not is_write_error(error):
        return f"saving checkpoint {checkpoint_dir} raised {type(error).__name__}: {error}"
    parent = checkpoint_dir.parent
    previous = last_complete_checkpoint(parent)
    if previous == checkpoint_dir:  # left by an earlier run, overwritten in part
        kept = f"{checkpoint_dir} was there before this save and may be half overwritten now: check it before resuming"
    elif previous is not None:
        kept = f"the previous checkpoint {previous} is intact; free space or fix the folder, then rerun with --resume"
    else:
        kept = "there is no earlier checkpoint to resume from"
    try:  # how much room is left where the checkpoint goes: the likely cause when torch only says "write failed"
        free = f" ({shutil.disk_usage(parent).free / 2**20:.1f} MiB free on that disk)"
    except OSError:
        free = ""
    return f"could not save checkpoint {checkpoint_dir}: {_reason(error)}{free}; {kept}"


def _reason(error: BaseException) -> str:
    """The cause in words: "No space left on device" rather than "[Errno 28] ..." or a torch enforce message."""
    if isinstance(error, OSError) and error.errno is not None:
        code, target = error.errno, f" ({error.filename})" if error.filename else ""
    else:  # safetensors and tokenizers end their message in "(os error 28)"
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found is None:
            return f"{type(error).__name__}: {error}"
        code, target = int(found.group(1)), ""
    return f"{os.strerror(code)} [{errno.errorcode.get(code, code)}]{target}"
