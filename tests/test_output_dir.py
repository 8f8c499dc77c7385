"""Issue #8 part 3: an unwritable output folder stops the run before any work; a save that fails mid-run (disk
full, folder turned read-only) stops with a message naming the checkpoint and leaves the previous one intact."""

import hashlib
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.checkpoints import last_complete_checkpoint, mark_complete
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.errors import ConfigError, SaveError
from hf_scale.modeling import load_tokenizer
from hf_scale.output_dir import check_output_dir, checkpoint_save_guard
from hf_scale.tiny import generate_tasks
from hf_scale.trainer import ScaleTrainer

IS_ROOT = os.geteuid() == 0


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True, check=False).returncode == 0


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def make_read_only(folder: Path) -> None:
    """Make `folder` refuse new files; root writes through permission bits, so for root remount it read-only."""
    if not IS_ROOT:
        folder.chmod(0o555)
    elif not (_mount("--bind", str(folder), str(folder)) and _mount("-o", "remount,ro,bind", str(folder))):
        _unmount(folder)
        pytest.skip("running as root without the right to mount: cannot make a folder read-only")


def undo_read_only(folder: Path) -> None:
    if IS_ROOT:
        _unmount(folder)
    else:
        folder.chmod(0o755)


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    make_read_only(folder)
    yield folder
    undo_read_only(folder)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB file system of its own (a tmpfs), so that a test can fill it; needs the right to mount."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)):
        pytest.skip("cannot mount a tmpfs here (not root, or no right to mount)")
    yield disk
    _unmount(disk)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# --- before any work -------------------------------------------------------------------------------------------


def test_a_writable_or_creatable_output_dir_passes_and_nothing_is_left(tmp_path):
    (tmp_path / "existing").mkdir()
    check_output_dir(tmp_path / "existing")
    check_output_dir(tmp_path / "not" / "yet" / "there")
    assert listing(tmp_path) == ["existing"]  # not created, no probe file left


def test_an_output_dir_that_is_a_file_or_under_a_file(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir: .*notes.txt exists and is not a folder"):
        check_output_dir(file)
    with pytest.raises(ConfigError, match=r"output_dir: cannot create .*notes.txt/run: .*notes.txt is a file"):
        check_output_dir(file / "run")


def test_a_read_only_output_dir(read_only_folder):
    reason = r"\((Read-only file system|Permission denied)\)"
    with pytest.raises(ConfigError, match=rf"output_dir: .*read-only is not writable {reason}"):
        check_output_dir(read_only_folder)
    with pytest.raises(ConfigError, match=r"output_dir: cannot create .*read-only/run: .*read-only is not writable"):
        check_output_dir(read_only_folder / "run")


def test_preparing_the_run_checks_the_output_dir(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    with pytest.raises(ConfigError, match="output_dir: .*notes.txt exists and is not a folder"):
        prepare_run(ScaleTrainingArguments(output_dir=str(file), report_to="none"))


# --- the guard around one checkpoint save ---------------------------------------------------------------------


def test_the_guard_removes_the_half_written_checkpoint_and_names_the_previous_one(tmp_path):
    (tmp_path / "checkpoint-10").mkdir()
    mark_complete(tmp_path / "checkpoint-10")
    target = tmp_path / "checkpoint-20"
    with pytest.raises(SaveError) as caught, checkpoint_save_guard(target):
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")
    message = str(caught.value)
    assert message.startswith(f"could not save checkpoint {target}: No space left on device [ENOSPC]")
    assert f"the previous checkpoint {tmp_path / 'checkpoint-10'} is intact" in message
    assert listing(tmp_path) == ["checkpoint-10", "checkpoint-10/hf_scale_checkpoint_complete"]
    assert isinstance(caught.value, OSError) and isinstance(caught.value.__cause__, OSError)


def test_the_guard_reads_torch_safetensors_and_tokenizers_errors(tmp_path):
    from safetensors import SafetensorError

    with pytest.raises(SaveError, match=r"No space left on device \[ENOSPC\].*there is no earlier checkpoint"):
        with checkpoint_save_guard(tmp_path / "checkpoint-5"):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(SaveError, match=r"Read-only file system \[EROFS\]"):
        with checkpoint_save_guard(tmp_path / "checkpoint-6"):
            raise Exception("Read-only file system (os error 30)")  # what the tokenizers library raises
    with pytest.raises(SaveError, match=r"RuntimeError: PytorchStreamWriter failed writing file data/0"):
        with checkpoint_save_guard(tmp_path / "checkpoint-7"):
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")


def test_other_errors_pass_through_and_folders_the_save_did_not_make_are_kept(tmp_path):
    target = tmp_path / "checkpoint-8"
    with pytest.raises(KeyError), checkpoint_save_guard(target):
        target.mkdir()
        raise KeyError("a bug is not a failed write: it passes through, but no half checkpoint is left")
    assert not target.exists()
    before = tmp_path / "checkpoint-9"
    before.mkdir()  # there before the save: not the guard's to remove
    mark_complete(before)
    with pytest.raises(SaveError, match=r"checkpoint-9 was there before this save and may be half overwritten"):
        with checkpoint_save_guard(before):
            raise OSError(28, "No space left on device")
    assert before.is_dir()


# --- a real training run whose second checkpoint cannot be written --------------------------------------------

# ScaleTrainer._save_checkpoint must run the stock save inside `checkpoint_save_guard` (hf_scale/trainer.py).


class FaultAfterFirstSave(TrainerCallback):
    """After the first checkpoint: fingerprint it, then break the disk so that the next save fails."""

    def __init__(self, fault: str, output_dir: Path):
        self.fault, self.output_dir = fault, output_dir
        self.fingerprint: dict[str, str] = {}

    def on_save(self, args, state, control, **kwargs):
        if self.fingerprint:
            return
        first = last_complete_checkpoint(self.output_dir)
        self.fingerprint = fingerprint(first)
        if self.fault == "file_size_limit":  # every file this process writes stops at 64 KiB: EFBIG
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the default action would kill the process
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif self.fault == "disk_full":  # leave a third of a checkpoint free: the next one fails half written
            size = sum(p.stat().st_size for p in first.iterdir())
            free = shutil.disk_usage(self.output_dir).free
            (self.output_dir.parent / "filler").write_bytes(b"\0" * max(0, free - size // 3))
        else:
            make_read_only(self.output_dir)


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fault", ["file_size_limit", "disk_full", "read_only"])
def test_a_failed_save_mid_run_stops_clearly_and_keeps_the_previous_checkpoint(
    fault, tmp_path, tiny_model_dir, request
):
    disk = request.getfixturevalue("small_disk") if fault == "disk_full" else tmp_path
    output_dir = disk / "run"
    tokenizer = load_tokenizer(str(tiny_model_dir))
    dataset, _ = tokenize_records(generate_tasks()[0][:64], tokenizer, ALPACA, max_length=64)
    args = ScaleTrainingArguments(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=8,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,  # rotation must not delete checkpoint-2 when checkpoint-4 failed
        report_to="none",
        disable_tqdm=True,
    )
    fault_callback = FaultAfterFirstSave(fault, output_dir)
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        callbacks=[fault_callback],
    )
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        with pytest.raises(SaveError) as caught:
            trainer.train()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        if fault == "read_only":
            undo_read_only(output_dir)
    reason = {
        "file_size_limit": r"File too large \[EFBIG\]",
        "disk_full": r"No space left on device \[ENOSPC\]",
        "read_only": r"(Read-only file system \[EROFS\]|Permission denied \[EACCES\])",
    }[fault]
    previous = output_dir / "checkpoint-2"
    assert caught.match(rf"^could not save checkpoint {output_dir / 'checkpoint-4'}: {reason}")
    assert caught.match(rf"the previous checkpoint {previous} is intact")
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-2"]  # the half-written one is gone
    assert fingerprint(previous) == fault_callback.fingerprint  # byte for byte what was saved
    assert last_complete_checkpoint(output_dir) == previous  # what --resume will pick
    AutoModelForCausalLM.from_pretrained(previous)
