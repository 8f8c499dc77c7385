"""Load Alpaca-format records from files, folders, a hub dataset, an in-memory `Dataset` or the embedded tasks,
and check every record before any work starts."""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from datasets import Dataset, Features, Value, load_dataset
from datasets.table import InMemoryTable
from huggingface_hub.errors import HfHubHTTPError, HFValidationError

from hf_scale.errors import ConfigError, DataError

FILE_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
OnBadRecord = Literal["error", "skip"]


@dataclass(frozen=True)
class FieldNames:
    """Which columns hold the instruction, the optional input and the response (e.g. prompt/response sets)."""

    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"


@dataclass
class RecordCheck:
    """The outcome of checking records: how many were skipped, which, and why (the first few)."""

    source: str
    records: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (record index, problem)

    def __str__(self) -> str:
        if not self.skipped:
            return f"{self.source}: {self.records} records, all valid"
        shown = "; ".join(f"record {index}: {problem}" for index, problem in self.skipped[:5])
        return f"{self.source}: skipped {len(self.skipped)} of {self.records} invalid records (first: {shown})"


def looks_like_local_path(name: str) -> bool:
    """A name that can only mean a local file or folder (a hub id is `name` or `owner/name`)."""
    return (
        name.startswith(("/", "./", "../", "~"))
        or Path(name).suffix in FILE_SUFFIXES
        or name.count("/") > 1
        or (os.sep in name and os.sep != "/")
    )


def _data_files(path: Path, key: str, name: str) -> tuple[str, list[str]]:
    """The `datasets` builder and files for a file or a folder of files of one kind."""
    files = sorted(p for p in path.iterdir() if p.suffix in FILE_SUFFIXES) if path.is_dir() else [path]
    if path.is_file() and path.suffix not in FILE_SUFFIXES:
        raise ConfigError(f"{key}: {name} is not a {'/'.join(FILE_SUFFIXES)} file")
    if not files:
        raise ConfigError(f"{key}: folder {name} holds no {'/'.join(FILE_SUFFIXES)} files")
    builders = {FILE_SUFFIXES[p.suffix] for p in files}
    if len(builders) > 1:
        raise ConfigError(f"{key}: folder {name} mixes file kinds ({', '.join(sorted(builders))}); keep one kind")
    return builders.pop(), [str(p) for p in files]


def load_records(
    data: str | Dataset,
    key: str = "dataset",
    fields: FieldNames = FieldNames(),
    on_bad_record: OnBadRecord = "error",
) -> tuple[Dataset, RecordCheck]:
    """Records from a .json/.jsonl/.csv/.parquet file or folder, a hub dataset id or a `Dataset`, checked.

    Returns the valid records as a `Dataset` of instruction/input/output columns (the fields renamed; no input is
    ""), and the check's outcome. Records are read one at a time where the format allows (JSON Lines, and what
    `datasets` reads) and kept as Arrow, so memory holds the text of the records once, not a Python object each.
    `key` is the config key that named the data, for error messages.

    Example:
        records, check = load_records("data/train.jsonl", fields=FieldNames("prompt", "context", "response"),
                                      on_bad_record="skip")
        print(check)  # records read, kept, skipped (with the first indices and why)
    """
    records, source = read_records(data, key)
    return check_records(records, source=source, fields=fields, on_bad_record=on_bad_record)


def read_records(data: str | Dataset, key: str = "dataset") -> tuple[Iterable, str]:
    """The raw, unchecked records of a .json/.jsonl/.csv/.parquet file or folder, a hub dataset id or a `Dataset`
    (read as they are iterated, where the format allows), and the name of their source for messages. `key` is the
    config key that named the data, for error messages."""
    if isinstance(data, Dataset):
        return _rows(data), "the given Dataset"
    if not (path := Path(data).expanduser()).exists() and not looks_like_local_path(data):
        return _hub_records(data, key), data
    if not path.exists():
        raise ConfigError(f"{key}: data file not found: {data}")
    builder, files = _data_files(path, key, data)
    if builder == "json":
        # Read here, not through datasets: it names no line in a broken file, and it looped forever on a
        # valid file whose records nest values of mixed types (datasets 4.8, found by tests/test_fuzz.py).
        return (record for file in files for record in _json_records(file, key)), data
    try:
        return _rows(load_dataset(builder, data_files=files, split="train")), data
    except Exception as error:  # datasets raises many types, rarely naming the line
        if builder == "csv":
            for file in files:
                _read_text(file, key)  # an undecodable or empty file: named with its line
        raise DataError(f"{key}: could not read {data}: {_cause(error)}") from error


def data_identity(data: str, key: str = "dataset") -> list:
    """What tells, without reading it, that the data `data` names changed: each local file's path, size and
    modification time (as `datasets` keys its own cache); for a hub dataset, the files of its `train` split in the
    datasets cache. Mistakes are the `ConfigError`s `read_records` raises."""
    path = Path(data).expanduser()
    if path.exists():
        files = [Path(file) for file in _data_files(path, key, data)[1]]
    elif looks_like_local_path(data):
        raise ConfigError(f"{key}: data file not found: {data}")
    else:
        files = [Path(entry["filename"]) for entry in _hub_split(data, key).cache_files]
    return [(str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns) for file in files]


def _hub_records(name: str, key: str) -> Iterator[dict]:
    return _rows(_hub_split(name, key))


def _hub_split(name: str, key: str) -> Dataset:
    """The `train` split of hub dataset `name` (no local file or folder has that name).

    A misspelt id, a hub out of reach (no network, or HF_HUB_OFFLINE set and the dataset not in the cache) and a
    dataset without a `train` split are each a `ConfigError` naming `key`, the id and what to do. Only the errors
    datasets and huggingface_hub raise for those are caught: anything else is a bug and keeps its traceback.
    """
    where = f"{key}: no local file or folder {name}"  # a mistyped path lands here too: it may not be an id at all
    try:
        splits = load_dataset(name)  # every split: download_and_prepare builds them all even when one is asked for
    except HFValidationError as error:  # "owner/na--me", spaces, over 96 characters: no request is even made
        raise ConfigError(f"{where}, and it is no valid hub dataset id ({_one_line(error)}): check the path") from None
    except ConnectionError as error:  # no network, or HF_HUB_OFFLINE set (OfflineModeIsEnabled is one)
        raise ConfigError(
            f"{where}, and the Hugging Face hub is out of reach for a dataset of that id ({_one_line(error)}): check "
            "the path or the id, the network, or HF_HUB_OFFLINE (when set, only datasets already in the cache load)"
        ) from None
    except FileNotFoundError as error:  # DatasetNotFoundError (no such id, or gated), DataFilesNotFoundError, ...
        raise ConfigError(
            f"{where}, nor a hub dataset of that id ({_one_line(error)}): check the path or the id (owner/name); "
            "a gated dataset needs `hf auth login` and access granted on its page"
        ) from None
    except HfHubHTTPError as error:  # the hub answered with an error: rate limit, server error, revoked token
        raise ConfigError(f"{key}: the Hugging Face hub failed on dataset {name}: {_one_line(error)}") from None
    if "train" not in splits:
        names = sorted(splits)
        raise ConfigError(
            f"{key}: hub dataset {name} has no 'train' split (its splits: {', '.join(names)}); hf_scale trains on "
            f"the train split: save the split you want as a file, e.g. load_dataset({name!r}, split={names[0]!r})"
            ".to_json('data.jsonl'), and give that file"
        )
    return splits["train"]


def _rows(dataset: Dataset) -> Iterator[dict]:
    """A `Dataset`'s rows as dicts, read a batch at a time (row by row, a `Dataset` is slow to read)."""
    for batch in dataset.iter(batch_size=1000):
        yield from (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))


def _one_line(error: BaseException) -> str:
    """The error's message on one line: the recipe prints one `error:` line (hub errors add a request id line)."""
    return " ".join(str(error).split())


def _read_text(file: str, key: str) -> str:
    """The text of a data file; a `DataError` naming the file, line and column when it is not UTF-8, or empty."""
    raw = Path(file).read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark is not part of the data
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise DataError(
            f"{key}: {file} is not valid UTF-8 text: line {line}, column {column}: byte 0x{raw[error.start]:02x} "
            "(save the file as UTF-8)"
        ) from None
    if not text.strip():
        raise DataError(f"{key}: {file} is empty: no records")
    return text


def _json_records(file: str, key: str) -> Iterator[dict]:
    """The records of a JSON file: one document (a list of records, read whole) or JSON Lines (one record per line,
    read a line at a time)."""
    if _is_json_lines(file):
        yield from _json_lines(file, key)
        return
    document = _json_value(_read_text(file, key), file, key)
    if isinstance(document, dict):
        yield document
    elif isinstance(document, list):
        yield from document
    else:
        raise _not_a_record(document, file, key, line=1)


def _json_value(text: str, file: str, key: str, line: int | None = None) -> Any:
    """`json.loads(text)`, or a `DataError` naming the file and the line (`line`, else the error's own)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{key}: could not read {file}: line {line or error.lineno}, column {error.colno}: not valid JSON: "
            f"{error.msg}"
        ) from None
    except RecursionError:
        raise DataError(f"{key}: could not read {file}: values nested too deeply") from None


def _not_a_record(value: Any, file: str, key: str, line: int) -> DataError:
    return DataError(
        f"{key}: could not read {file}: line {line}: a record must be a JSON object, got {type(value).__name__}"
    )


def _is_json_lines(file: str) -> bool:
    """Whether the file is JSON Lines: its first non-blank line is a JSON object on its own, and another line
    follows. (A document split over lines, or a single object, is read whole.)"""
    with open(file, "rb") as lines:
        first = next((line for line in lines if line.strip()), None)
        if first is None or not first.lstrip(b"\xef\xbb\xbf \t").startswith(b"{"):
            return False
        try:
            if not isinstance(json.loads(first.decode("utf-8-sig")), dict):
                return False
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return False
        return any(line.strip() for line in lines)


def _json_lines(file: str, key: str) -> Iterator[dict]:
    """The records of a JSON Lines file, a line at a time; a `DataError` naming the line of the first problem."""
    with open(file, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{key}: {file} is not valid UTF-8 text: line {number}, column {error.start + 1}: byte "
                    f"0x{raw[error.start]:02x} (save the file as UTF-8)"
                ) from None
            if not line.strip():
                continue
            record = _json_value(line, file, key, line=number)
            if not isinstance(record, dict):
                raise _not_a_record(record, file, key, line=number)
            yield record


def _cause(error: BaseException) -> str:
    """The innermost message: datasets wraps the reader's error in "An error occurred while generating the dataset"."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _problem(record: dict, fields: FieldNames) -> str | None:
    for role, column in vars(fields).items():
        value = record.get(column)
        if value is None:
            if role == "input":
                continue  # no input is an empty input
            return f"missing field {column!r}"
        if not isinstance(value, str):
            return f"field {column!r} must be text, got {type(value).__name__}"
        if "\ufffd" in value:
            return f"field {column!r} holds undecodable bytes (U+FFFD): the file is not valid UTF-8"
    for column in (fields.output, fields.instruction):
        if not record[column].strip():
            return f"field {column!r} is empty"
    return None


RECORD_FEATURES = Features({"instruction": Value("string"), "input": Value("string"), "output": Value("string")})
# Valid records gathered as Python objects before they become Arrow: a bounded share of the set.
CHUNK_RECORDS = 10_000


def check_records(
    records: Iterable, source: str, fields: FieldNames = FieldNames(), on_bad_record: OnBadRecord = "error"
) -> tuple[Dataset, RecordCheck]:
    """Check every record; stop at the first bad one (`"error"`) or skip and count them (`"skip"`)."""

    def problem(record: object) -> str | None:
        return _problem(record, fields) if isinstance(record, dict) else "not a mapping of fields"

    def normal(record: dict) -> dict[str, str]:
        return {role: record.get(column) or "" for role, column in vars(fields).items()}  # no input: ""

    return check_each_record(records, source, on_bad_record, problem, normal, RECORD_FEATURES)


def check_each_record(
    records: Iterable,
    source: str,
    on_bad_record: OnBadRecord,
    problem: Callable[[Any], str | None],
    normal: Callable[[Any], dict],
    features: Features,
) -> tuple[Dataset, RecordCheck]:
    """The policy every record format shares: each record's `problem` (None when valid) stops the load
    (`"error"`) or is skipped and counted (`"skip"`); a valid record is kept in its `normal` form, a row of a
    `Dataset` of `features`."""
    if on_bad_record not in ("error", "skip"):
        raise ConfigError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    check = RecordCheck(source=source, records=0)
    chunks, valid = [], []
    for index, record in enumerate(records):
        check.records += 1
        if (found := problem(record)) is None:
            valid.append(normal(record))
            if len(valid) == CHUNK_RECORDS:
                chunks.append(pa.Table.from_pylist(valid, schema=features.arrow_schema))
                valid = []
        elif on_bad_record == "error":
            raise DataError(f"{source}: record {index}: {found} (on_bad_record='skip' skips and counts such records)")
        else:
            check.skipped.append((index, found))
    if not check.records:
        raise DataError(f"{source}: no records")
    if not valid and not chunks:
        raise DataError(f"{check}: no valid record left")
    if valid:
        chunks.append(pa.Table.from_pylist(valid, schema=features.arrow_schema))
    # A fingerprint of our own: without one, datasets hashes the whole table to make one (for 500k records, two
    # more copies of the set in memory and most of the load's time).
    return Dataset(InMemoryTable(pa.concat_tables(chunks)), fingerprint=uuid.uuid4().hex), check


def split_records(records: Dataset, eval_ratio: float, seed: int) -> tuple[Dataset, Dataset]:
    """Shuffle with `seed` and split off `eval_ratio` of the records (at least one) for evaluation."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(order) * eval_ratio))
    if n_eval >= len(order):
        raise DataError(f"{len(records)} record(s) are too few to hold out {eval_ratio:.0%} for evaluation")
    # Fingerprints of our own: datasets would hash the list of indices for each.
    return (
        records.select(order[n_eval:], new_fingerprint=uuid.uuid4().hex),
        records.select(order[:n_eval], new_fingerprint=uuid.uuid4().hex),
    )
