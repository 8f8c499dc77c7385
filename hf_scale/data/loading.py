"""Load Alpaca-format records from a file, a hub dataset or the embedded tasks, and check every one."""

from __future__ import annotations

import os
import random
from pathlib import Path

from hf_scale.errors import ConfigError, DataError

FILE_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
REQUIRED_FIELDS = ("instruction", "output")


def looks_like_local_path(name: str) -> bool:
    """A name that can only mean a local file or folder (a hub id is `name` or `owner/name`)."""
    return (
        name.startswith(("/", "./", "../", "~"))
        or Path(name).suffix in FILE_SUFFIXES
        or name.count("/") > 1
        or os.sep in name
        and os.sep != "/"
    )


def load_records(name: str, key: str = "dataset") -> list[dict[str, str]]:
    """Records from a local .json/.jsonl/.csv/.parquet file or a hub dataset id, checked by `check_records`.

    `key` is the config key that named the data, for error messages.
    """
    from datasets import load_dataset

    path = Path(name).expanduser()
    if path.exists() or looks_like_local_path(name):
        if not path.is_file():
            raise ConfigError(f"{key}: data file not found: {name}")
        if path.suffix not in FILE_SUFFIXES:
            raise ConfigError(f"{key}: {name} is not a {'/'.join(FILE_SUFFIXES)} file")
        try:
            dataset = load_dataset(FILE_SUFFIXES[path.suffix], data_files=str(path), split="train")
        except Exception as error:  # datasets raises many types for a malformed file
            raise DataError(f"{key}: could not read {name}: {error}") from error
    else:
        dataset = load_dataset(name, split="train")
    records = dataset.to_list()
    check_records(records, source=name)
    return records


def check_records(records: list[dict], source: str) -> None:
    """Raise a `DataError` naming the first record and field that is not a usable Alpaca record."""
    if not records:
        raise DataError(f"{source}: no records")
    for index, record in enumerate(records):
        for field in (*REQUIRED_FIELDS, "input"):
            value = record.get(field)
            if value is None and field == "input":
                continue
            if value is None:
                raise DataError(f"{source}: record {index}: missing field {field!r}")
            if not isinstance(value, str):
                raise DataError(f"{source}: record {index}: field {field!r} must be text, got {type(value).__name__}")
        if not record["output"].strip():
            raise DataError(f"{source}: record {index}: field 'output' is empty")


def split_records(
    records: list[dict[str, str]], eval_ratio: float, seed: int
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Shuffle with `seed` and split off `eval_ratio` of the records (at least one) for evaluation."""
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    n_eval = max(1, round(len(shuffled) * eval_ratio))
    if n_eval >= len(shuffled):
        raise DataError(f"{len(records)} record(s) are too few to hold out {eval_ratio:.0%} for evaluation")
    return shuffled[n_eval:], shuffled[:n_eval]
