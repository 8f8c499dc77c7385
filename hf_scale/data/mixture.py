"""Several datasets in one run: each source's format, fields and weight, and the mix of their tokenized examples.

A source is Alpaca records or conversations (ShareGPT or messages) from a file, folder or hub id, or the embedded
generated tasks. Its examples are made apart (each one counted, `tokenize_records` / `tokenize_conversations`)
and then mixed: concatenated, or interleaved by weight with a fixed seed (`datasets.interleave_datasets`), either
until the first source is used up or until every source is. What the mix takes from each source is counted too:
the examples not drawn, or drawn again.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
from datasets import Dataset, concatenate_datasets, interleave_datasets

from hf_scale.data.conversations import MESSAGES, SHAREGPT, ConversationFields
from hf_scale.data.loading import FieldNames
from hf_scale.errors import ConfigError

DataFormat = Literal["alpaca", "sharegpt", "messages"]
Mixture = Literal["interleave", "interleave_all", "concatenate"]
FIELD_KEYS = ("instruction_field", "input_field", "output_field", "conversation_field", "role_field", "content_field")


@dataclass(frozen=True)
class DataSource:
    """One dataset of a run: where it is, its format and field names, and its share of the mix."""

    path: str | None  # a file, folder or hub id; None: the embedded generated tasks of this format
    data_format: DataFormat = "alpaca"
    weight: float = 1.0  # its share of the interleaved mix (weights are normalised)
    eval_path: str | None = None  # held-out data of the same format; None: a share of `path` is held out
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    conversation_field: str | None = None  # None: the format's own (conversations, messages)
    role_field: str | None = None
    content_field: str | None = None

    @property
    def name(self) -> str:
        return self.path or f"the embedded {'conversations' if self.is_conversations else 'tasks'}"

    @property
    def is_conversations(self) -> bool:
        return self.data_format != "alpaca"

    @property
    def fields(self) -> FieldNames:
        return FieldNames(self.instruction_field, self.input_field, self.output_field)

    @property
    def conversation_fields(self) -> ConversationFields:
        layout = SHAREGPT if self.data_format == "sharegpt" else MESSAGES
        overrides = {"column": self.conversation_field, "role_key": self.role_field, "content_key": self.content_field}
        return dataclasses.replace(layout, **{key: value for key, value in overrides.items() if value})


def parse_sources(text: str | list, defaults: dict[str, Any]) -> list[DataSource]:
    """The `datasets` setting (a JSON list, or the list itself) as sources; keys an entry leaves out come from
    `defaults` (the run's own `data_format` and field names). Every mistake names the entry and the key."""
    if isinstance(text, str):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"datasets: not a JSON list of sources: {error}") from None
    else:
        entries = text
    if not isinstance(entries, list) or not entries:
        raise ConfigError("datasets: must be a non-empty list of sources such as {path: data.jsonl, weight: 2}")
    known = [field.name for field in dataclasses.fields(DataSource)]
    sources = []
    for index, entry in enumerate(entries):
        at = f"datasets[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: must be a mapping such as {{path: data.jsonl, weight: 2}}, got {entry!r}")
        for key in entry:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                raise ConfigError(f"{at}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ConfigError(f"{at}: needs a path (a file, folder or hub dataset id)")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{at}: weight must be a positive number, got {weight!r}")
        if entry.get("data_format", defaults.get("data_format", "alpaca")) not in get_args(DataFormat):
            raise ConfigError(f"{at}: data_format must be one of {', '.join(get_args(DataFormat))}")
        for key in FIELD_KEYS + ("eval_path",):
            if entry.get(key) is not None and not isinstance(entry[key], str):
                raise ConfigError(f"{at}: {key} must be text, got {entry[key]!r}")
        sources.append(DataSource(**{**{key: defaults[key] for key in defaults if key in known}, **entry}))
    return sources


def mix(datasets: list[Dataset], weights: list[float], mixture: Mixture, seed: int) -> tuple[Dataset, list[int]]:
    """The sources' examples mixed, and how many examples of each the mix holds (repeats included).

    "interleave" draws by weight until the first source is used up (the rest of the others are not drawn);
    "interleave_all" until every source is (the others start over: their examples are drawn again);
    "concatenate" takes every example once, in source order (the trainer's sampler shuffles).
    """
    if mixture not in get_args(Mixture):
        raise ConfigError(f"mixture must be one of {', '.join(get_args(Mixture))}, got {mixture!r}")
    if len(datasets) == 1:
        return datasets[0], [len(datasets[0])]
    tagged = [dataset.add_column("source", [index] * len(dataset)) for index, dataset in enumerate(datasets)]
    if mixture == "concatenate":
        mixed = concatenate_datasets(tagged)
    else:
        total = sum(weights)
        mixed = interleave_datasets(
            tagged,
            probabilities=[weight / total for weight in weights],
            seed=seed,
            stopping_strategy="first_exhausted" if mixture == "interleave" else "all_exhausted",
        )
    drawn = np.bincount(mixed.with_format("arrow")["source"].to_numpy(), minlength=len(datasets))
    return mixed.remove_columns("source"), drawn.tolist()


def describe_draws(names: list[str], examples: list[int], drawn: list[int], mixture: Mixture, seed: int) -> str:
    """One line: what the mix took from each source, counting what it left out or drew again."""
    parts = []
    for name, available, taken in zip(names, examples, drawn, strict=True):
        if taken < available:
            parts.append(f"{name}: {taken} of {available} examples ({available - taken} not drawn)")
        else:
            parts.append(f"{name}: {taken} of {available} examples ({taken - available} drawn again)")
    return f"mixture ({mixture}, seed {seed}): {sum(drawn)} train examples; " + "; ".join(parts)
