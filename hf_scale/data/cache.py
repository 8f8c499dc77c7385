"""Prepared examples kept between runs and shared between processes: a folder per key, made once and whole.

The key is a digest of everything the examples depend on: the data files (path, size, modification time, as
`datasets` keys its own cache), the tokenizer, the template and every setting. The first process builds the folder
in a staging folder beside it and renames it into place, so an entry appears complete or not at all; the others, a
relaunch included, find it and memory-map its Arrow files.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from datasets import Dataset, concatenate_datasets
from transformers import PreTrainedTokenizerBase

CACHE_VERSION = 5  # bump when what a folder holds changes for the same inputs
COMPLETE = "info.json"  # written last: a folder without it was never finished


def digest(*parts: object) -> str:
    """A short hex digest of JSON-serialisable parts."""
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str).encode()).hexdigest()[:24]


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what tokenization depends on in a (fast) tokenizer: its vocabulary, merges and normalisation,
    its special tokens and its chat template."""
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    hasher = hashlib.sha256(json.dumps([special, tokenizer.chat_template]).encode())
    hasher.update(tokenizer.backend_tokenizer.to_str().encode())
    return hasher.hexdigest()[:24]


def cached_folder(root: Path, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """The folder `root/key`, built by `build(folder)` unless it exists; and whether it existed.

    `build` fills a staging folder and must write `info.json` last; the staging folder is renamed into place, so a
    process that finds the folder finds it whole. When two processes build at once, the second rename fails and its
    (identical) folder is dropped.

    Example:
        def build(folder):
            dataset, summary = tokenize_records(records, tokenizer, template, 512,
                                                cache_file_name=str(folder / "train.arrow"))
            (folder / "info.json").write_text(json.dumps({"files": dataset_files(dataset, folder)}))

        folder, reused = cached_folder(cache_dir() / "tokenized", digest(data_identity(path), 512), build)
        train = read_dataset(folder, json.loads((folder / "info.json").read_text())["files"])
    """
    folder = root / key
    if (folder / COMPLETE).is_file():
        return folder, True
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        build(staging)
        os.rename(staging, folder)
    except OSError:
        if not (folder / COMPLETE).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder, False


def temporary_folder(root: Path) -> Path:
    """A new folder under `root` that is removed when this process exits (for examples not to be reused)."""
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".unshared-", dir=root))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def dataset_files(dataset: Dataset, folder: Path) -> list[str]:
    """The names, relative to `folder`, of the Arrow files `dataset` is memory-mapped from."""
    return [str(Path(entry["filename"]).resolve().relative_to(folder.resolve())) for entry in dataset.cache_files]


def read_dataset(folder: Path, names: list[str]) -> Dataset:
    """The `Dataset` memory-mapped from these Arrow files of `folder`, in order."""
    return concatenate_datasets([Dataset.from_file(str(folder / name)) for name in names])
