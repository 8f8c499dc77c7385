"""Tokenize Alpaca records into `input_ids` and `labels` whose mask is exact.

The whole text (prompt + response) is tokenized once, as the model will read it, and each token is labelled
by where its characters lie: a token that ends inside the prompt is -100, every other token is trained on.
So the mask follows whatever the tokenizer did at the boundary instead of assuming `len(tokenize(prompt))`
(the Stanford-Alpaca way, off whenever BPE merges across the boundary). BOS is added once. EOS is appended
and always labelled (also when pad == eos), unless the template's response already closes the turn with its
own token (a chat template's `<|im_end|>`, or LLaMA-2's `</s>`): that token, part of the response text, is
then the labelled end, and no EOS follows it. Over-long records follow a truncation policy, and every record
cut or dropped is counted in the summary.
"""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa
from datasets import Dataset, Features, List, Value
from tokenizers import Encoding
from transformers import PreTrainedTokenizerBase

from hf_scale.data.templates import PromptTemplate
from hf_scale.errors import ConfigError, DataError

IGNORE_INDEX = -100
Truncation = Literal["keep_prompt", "cut_prompt_left", "drop"]
TRUNCATION_POLICIES = get_args(Truncation)
# A record's outcome: kept whole or cut (an example), or dropped and why; each but "whole" names a summary count.
KEPT = ("whole", "response_cut", "prompt_cut")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """BOS (when the tokenizer has one) followed by the prompt's tokens: what generation starts from."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


@dataclass
class TokenizationSummary:
    """What happened to the records on their way to examples; nothing is dropped without being counted."""

    records: int
    examples: int = 0
    response_cut: int = 0  # kept, the end of the response cut at max_length (and no EOS: it did not end)
    prompt_cut: int = 0  # kept, the start of the prompt cut (truncation="cut_prompt_left")
    dropped_too_long: int = 0  # truncation="drop", or the response alone does not fit
    dropped_no_response: int = 0  # the prompt alone fills max_length: no token left to learn from
    boundary_merges: int = 0  # a token spans the prompt/response boundary; it is trained on
    tokens: int = 0
    label_tokens: int = 0
    dropped_indices: list[int] = field(default_factory=list)
    length_for_99_percent: int = 0  # the max_length that would keep 99 % of the records whole

    def __str__(self) -> str:
        dropped = self.dropped_too_long + self.dropped_no_response
        first = f" (first positions in this set: {self.dropped_indices[:5]})" if self.dropped_indices else ""
        return (
            f"{self.records} records -> {self.examples} examples, {self.tokens} tokens of which "
            f"{self.label_tokens} trained on; {self.response_cut} with the response cut and "
            f"{self.prompt_cut} with the prompt cut at max_length; {dropped} dropped{first} "
            f"({self.dropped_no_response} because the prompt alone fills max_length, "
            f"{self.dropped_too_long} too long); {self.boundary_merges} tokens span the prompt/response boundary"
        )


def tokenize_records(
    records: Dataset | list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    max_length: int,
    train_on_inputs: bool = False,
    truncation: Truncation = "keep_prompt",
    num_proc: int | None = None,
    cache_file_name: str | None = None,
) -> tuple[Dataset, TokenizationSummary]:
    """Turn Alpaca records into a `Dataset` of `input_ids`, `attention_mask` and `labels`.

    `truncation` for records longer than `max_length`: "keep_prompt" cuts the end of the response,
    "cut_prompt_left" cuts the start of the prompt (after BOS), "drop" drops the record. The records are tokenized
    by `Dataset.map` in batches of `BATCH_SIZE`, in `num_proc` processes (one process already tokenizes on every
    core in the fast tokenizer's batch call; more processes run the labelling in parallel too); the result is the
    same. With `cache_file_name` the examples are written there and memory-mapped, so memory is bounded by a
    batch, not by the set (a row a record; dropped records are left out by an indices mapping); without it they stay
    in memory.

    Example:
        records, _ = load_records("../shared/data/alpaca_en_demo.json")
        dataset, summary = tokenize_records(records, tokenizer, get_template("alpaca"), max_length=512)
        print(summary)  # records in, examples out, what was cut or dropped and why
    """
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no EOS token: the model could never learn to stop")
    if truncation not in TRUNCATION_POLICIES:
        raise ConfigError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        warnings.warn("pad == eos: the EOS of every example is still labelled (labels come from lengths)", stacklevel=2)
    if not isinstance(records, Dataset):
        check_not_columns(records)
        records = Dataset.from_dict({name: [r.get(name) or "" for r in records] for name in RECORD_COLUMNS})
    tokenize = partial(
        _tokenize_batch,
        tokenizer=tokenizer,
        template=template,
        max_length=max_length,
        train_on_inputs=train_on_inputs,
        truncation=truncation,
    )
    rows = map_in_batches(records, tokenize, RECORD_ROW_FEATURES, num_proc, cache_file_name, "tokenizing")
    outcomes = column(rows, "outcome")
    summary = TokenizationSummary(
        records=len(rows),
        boundary_merges=int(np.count_nonzero(column(rows, "boundary_merge"))),
        length_for_99_percent=percentile_99(column(rows, "whole_length")),
    )
    for outcome in ("response_cut", "prompt_cut", "dropped_too_long", "dropped_no_response"):
        setattr(summary, outcome, int(np.count_nonzero(outcomes == outcome)))
    dataset, summary.dropped_indices = examples_kept(rows, np.isin(outcomes, KEPT))
    summary.examples = len(dataset)
    summary.tokens = int(column(rows, "tokens").sum())
    summary.label_tokens = int(column(rows, "label_tokens").sum())
    return dataset, summary


# Records in a batch of `Dataset.map`: enough for the fast tokenizer's parallel batch call, few enough that a batch's
# Python lists stay small.
BATCH_SIZE = 1000
RECORD_COLUMNS = ("instruction", "input", "output")
EXAMPLE_FEATURES = {
    "input_ids": List(Value("int32")),
    "attention_mask": List(Value("int8")),
    "labels": List(Value("int32")),
}
# One row a record: the example (empty lists when dropped), and what the summary counts.
RECORD_ROW_FEATURES = Features(
    {
        **EXAMPLE_FEATURES,
        "outcome": Value("string"),
        "boundary_merge": Value("bool"),
        "whole_length": Value("int32"),
        "tokens": Value("int32"),
        "label_tokens": Value("int32"),
    }
)


def check_not_columns(items: object) -> None:
    """A `TypeError` for a dict of columns where rows were meant: what `dataset[:n]` gives."""
    if isinstance(items, dict):
        raise TypeError(
            "expected a Dataset or a list of rows, got a dict of columns (what slicing a Dataset, dataset[:n], "
            "gives): use dataset.select(range(n))"
        )


def map_in_batches(
    items: Dataset,
    function: Callable[[dict[str, list]], pa.Table],
    features: Features,
    num_proc: int | None,
    cache_file_name: str | None,
    desc: str,
) -> Dataset:
    """`items.map(function)` in batches, a row an item, written to `cache_file_name` (None: kept in memory)."""
    if num_proc is not None and (num_proc < 2 or len(items) < 2 * num_proc):
        num_proc = None
    return items.map(
        function,
        batched=True,
        batch_size=BATCH_SIZE,
        num_proc=num_proc,
        remove_columns=items.column_names,
        features=features,
        cache_file_name=cache_file_name,
        load_from_cache_file=False,
        new_fingerprint=uuid.uuid4().hex,  # not a hash of the tokenizer: nothing looks the result up by it
        desc=desc,
    )


def column(dataset: Dataset, name: str) -> np.ndarray:
    """One column as a NumPy array, read from Arrow without a Python object a row."""
    return dataset.with_format("arrow")[name].to_numpy(zero_copy_only=False)


def examples_kept(rows: Dataset, kept: np.ndarray) -> tuple[Dataset, list[int]]:
    """The examples of the rows `kept` marks, and the positions of the dropped ones."""
    dropped = np.flatnonzero(~kept).tolist()
    return examples_of(rows, dropped), dropped


def examples_of(rows: Dataset, dropped: list[int]) -> Dataset:
    """The example columns of `rows` without the rows at `dropped` (left out by an indices mapping: the file keeps a
    row a record, and nothing is copied)."""
    examples = rows.select_columns(list(EXAMPLE_FEATURES))
    if not dropped:
        return examples
    return examples.select(np.setdiff1d(np.arange(len(rows)), dropped), new_fingerprint=uuid.uuid4().hex)


def _tokenize_batch(
    columns: dict[str, list[str]],
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    max_length: int,
    train_on_inputs: bool,
    truncation: Truncation,
) -> pa.Table:
    """Records (as columns) to one row each: the example, its `outcome`, and what the summary counts.

    A dropped record keeps its row (empty lists) so that rows stay aligned with records for the summary.
    """
    prompts = [template.format_prompt(i, x) for i, x in zip(columns["instruction"], columns["input"], strict=True)]
    texts = [p + template.format_response(o) for p, o in zip(prompts, columns["output"], strict=True)]
    encodings = encode_texts(tokenizer, texts)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    # A template whose response ends the turn itself (<|im_end|>, LLaMA-2 chat's " </s>") needs no EOS after it:
    # the model learns to close its turn as the chat format does, and EOS is never doubled.
    eos = [] if template.end_of_turn else [tokenizer.eos_token_id]
    rows: dict[str, list] = {name: [] for name in RECORD_ROW_FEATURES if name != "attention_mask"}
    for prompt, encoding in zip(prompts, encodings, strict=True):
        ids = encoding.ids
        # The first response token is the first one that ends after the prompt; when it starts inside the prompt
        # (a merge across the boundary) it is still trained on, and counted.
        n_prompt = first_token_ending_after(encoding, len(prompt))
        merge = n_prompt < len(ids) and encoding.token_to_chars(n_prompt)[0] < len(prompt)
        source = bos + ids[:n_prompt]
        target = [*ids[n_prompt:], *eos]
        rows["whole_length"].append(len(source) + len(target))
        outcome, source, target = _fit(source, target, len(bos), max_length, truncation)
        labels = []
        if outcome in KEPT:
            labels = (source if train_on_inputs else [IGNORE_INDEX] * len(source)) + target
            if bos and train_on_inputs:
                labels[0] = IGNORE_INDEX  # nothing predicts BOS
        rows["input_ids"].append(source + target)
        rows["labels"].append(labels)
        rows["outcome"].append(outcome)
        rows["boundary_merge"].append(merge)
        rows["tokens"].append(len(labels))
        # the labels after the first position that are trained on (nothing predicts the first token)
        rows["label_tokens"].append(len(labels) - 1 - labels[1:].count(IGNORE_INDEX) if labels else 0)
    return arrow_rows(rows, RECORD_ROW_FEATURES)


def first_token_ending_after(encoding: Encoding, position: int) -> int:
    """The index of the first token whose characters end after `position` (the number of tokens when none does).

    Asked of the Rust encoding for the token holding character `position`, which is that token when the one
    before it ends by `position`; otherwise (a character no token holds, such as whitespace a normaliser drops)
    the offsets are read one by one, which is a fifth of the labelling's time when done for every record."""
    token = encoding.char_to_token(position)
    if token is not None and (token == 0 or encoding.token_to_chars(token - 1)[1] <= position):
        return token
    return next((i for i, (_, end) in enumerate(encoding.offsets) if end > position), len(encoding.ids))


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[Encoding]:
    """The fast tokenizer's encodings of `texts`, no special token added, as `tokenizer(texts).encodings` gives them,
    without the Python lists of ids and masks that call also builds for every text (a seventh of the time)."""
    backend = tokenizer.backend_tokenizer
    # What the call sets first: an earlier `tokenizer(..., padding="max_length")` leaves padding set on the backend.
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend.encode_batch(texts, add_special_tokens=False)


def arrow_rows(rows: dict[str, list], features: Features) -> pa.Table:
    """`rows` (with `input_ids` and `labels`, no attention mask) as the Arrow table of `features` that `Dataset.map`
    writes, each column made in one call; the attention mask (all ones) from the ids' lengths."""
    input_ids, labels = int32_lists(rows["input_ids"]), int32_lists(rows["labels"])
    ones = pa.array(np.ones(len(input_ids.values), dtype=np.int8))
    mask = pa.ListArray.from_arrays(input_ids.offsets, ones)
    columns = {**rows, "input_ids": input_ids, "attention_mask": mask, "labels": labels}
    return pa.Table.from_pydict({name: columns[name] for name in features}, schema=features.arrow_schema)


def int32_lists(lists: list[list[int]]) -> pa.ListArray:
    """Lists of ints as an Arrow list array, through one flat list (3x faster than converting each list)."""
    flat, offsets = [], [0]
    for values in lists:
        flat += values
        offsets.append(len(flat))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.int32()))


def percentile_99(lengths: Iterable[int] | np.ndarray) -> int:
    """The smallest length that at least 99 % of `lengths` do not exceed (0 for none)."""
    lengths = np.sort(np.asarray(lengths, dtype=np.int64))
    if not len(lengths):
        return 0
    return int(lengths[math.ceil(0.99 * len(lengths)) - 1])


# More responses cut than this share of a set is worth a warning: the model learns answers that never end.
CUT_WARNING_SHARE = 0.05


def responses_cut_warning(name: str, summary: Any, max_length: int, source: str | None = None) -> str:
    """A one-line warning when max_length cuts more than 5 % of set `name`, else "": of one-turn records (a
    `TokenizationSummary`) the responses cut; of conversations (a `ConversationSummary`) those whose last answer was
    cut or whose oldest turns were removed to fit. It names the length that keeps 99 % whole."""
    if isinstance(summary, TokenizationSummary):
        cut, total, what = summary.response_cut, summary.records, "responses"
        effect = "the model learns answers that do not end"
    else:
        cut, total, what = summary.answer_cut + summary.shortened, summary.conversations, "conversations"
        effect = (
            f"{summary.answer_cut} with the last answer cut (the model learns answers that do not end), "
            f"{summary.shortened} without their oldest turns"
        )
    if total == 0 or cut <= CUT_WARNING_SHARE * total:
        return ""
    where = f" of {source}" if source else ""
    return (
        f"{cut} of {total} {name} {what}{where} ({cut / total:.0%}) are cut at max_length={max_length}: {effect}; "
        f"max_length {summary.length_for_99_percent} keeps 99 % of them whole"
    )


def check_examples_left(
    name: str, summary: TokenizationSummary, max_length: int, truncation: str, source: str | None = None
) -> None:
    """A `DataError` naming max_length when the truncation policy dropped every record of set `name` (of `source`).

    Dropping some records is policy, and counted; dropping all leaves an empty set that fails later, far from
    its cause (an empty batch, an empty evaluation).
    """
    if summary.records and not summary.examples:
        where = f" in {source}" if source else ""
        raise DataError(
            f"max_length={max_length} leaves no {name} example{where}: all {summary.records} records dropped "
            f"({summary.dropped_no_response} because the prompt alone fills max_length, {summary.dropped_too_long} "
            f"too long with truncation={truncation!r}); raise max_length or choose another truncation"
        )


def _fit(
    source: list[int], target: list[int], n_bos: int, max_length: int, truncation: Truncation
) -> tuple[str, list[int], list[int]]:
    """Apply the truncation policy: (outcome, source, target); a dropped record comes back with empty lists."""
    excess = len(source) + len(target) - max_length
    if excess <= 0:
        return "whole", source, target
    if truncation == "cut_prompt_left":
        if len(source) - n_bos > excess:
            return "prompt_cut", source[:n_bos] + source[n_bos + excess :], target
        return "dropped_too_long", [], []  # even an empty prompt leaves the response too long
    if truncation == "drop":
        return "dropped_too_long", [], []
    if len(source) < max_length:
        return "response_cut", source, target[: max_length - len(source)]  # no EOS: the response did not end here
    return "dropped_no_response", [], []
