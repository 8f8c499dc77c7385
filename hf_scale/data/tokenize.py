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
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, get_args

from datasets import Dataset
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
    records: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    max_length: int,
    train_on_inputs: bool = False,
    truncation: Truncation = "keep_prompt",
    num_proc: int | None = None,
) -> tuple[Dataset, TokenizationSummary]:
    """Turn Alpaca records into a `Dataset` of `input_ids`, `attention_mask` and `labels`.

    `truncation` for records longer than `max_length`: "keep_prompt" cuts the end of the response,
    "cut_prompt_left" cuts the start of the prompt (after BOS), "drop" drops the record. `num_proc` > 1 splits
    the records across that many processes with `datasets.map`; the result is the same. One process already
    tokenizes on every core (the fast tokenizer's batch call is parallel), so more pays off only on large sets
    and many cores.

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

    columns = {
        "instruction": [r["instruction"] for r in records],
        "input": [r.get("input") or "" for r in records],
        "output": [r["output"] for r in records],
    }
    tokenize = partial(
        _tokenize_batch,
        tokenizer=tokenizer,
        template=template,
        max_length=max_length,
        train_on_inputs=train_on_inputs,
        truncation=truncation,
    )
    if num_proc is not None and num_proc > 1 and len(records) >= 2 * num_proc:
        rows = Dataset.from_dict(columns).map(
            tokenize, batched=True, num_proc=num_proc, remove_columns=list(columns), desc="tokenizing"
        )
        rows = rows.to_dict()
    else:
        rows = tokenize(columns)
    summary = TokenizationSummary(
        records=len(records),
        boundary_merges=sum(rows["boundary_merge"]),
        length_for_99_percent=percentile_99(rows["whole_length"]),
    )
    kept = []
    for index, outcome in enumerate(rows["outcome"]):
        if outcome != "whole":
            setattr(summary, outcome, getattr(summary, outcome) + 1)
        (kept if outcome in KEPT else summary.dropped_indices).append(index)
    examples = {name: [rows[name][i] for i in kept] for name in ("input_ids", "attention_mask", "labels")}
    summary.examples = len(kept)
    summary.tokens = sum(map(len, examples["input_ids"]))
    # the labels after the first position that are trained on (nothing predicts the first token)
    summary.label_tokens = sum(len(labels) - 1 - labels[1:].count(IGNORE_INDEX) for labels in examples["labels"])
    return Dataset.from_dict(examples), summary


def _tokenize_batch(
    columns: dict[str, list[str]],
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    max_length: int,
    train_on_inputs: bool,
    truncation: Truncation,
) -> dict[str, list]:
    """Records (as columns) to one row each: the example, its `outcome` and whether a token spans the boundary.

    A dropped record keeps its row (empty lists) so that rows stay aligned with records for the summary.
    """
    prompts = [template.format_prompt(i, x) for i, x in zip(columns["instruction"], columns["input"], strict=True)]
    texts = [p + template.format_response(o) for p, o in zip(prompts, columns["output"], strict=True)]
    # Through the tokenizer's __call__, not its Rust backend directly: the call resets padding and truncation,
    # which an earlier `tokenizer(..., padding="max_length")` leaves set on the backend.
    encodings = tokenizer(texts, add_special_tokens=False).encodings
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    # A template whose response ends the turn itself (<|im_end|>, LLaMA-2 chat's " </s>") needs no EOS after it:
    # the model learns to close its turn as the chat format does, and EOS is never doubled.
    eos = [] if template.end_of_turn else [tokenizer.eos_token_id]
    rows: dict[str, list] = {
        name: [] for name in ("input_ids", "attention_mask", "labels", "outcome", "boundary_merge", "whole_length")
    }
    for prompt, encoding in zip(prompts, encodings, strict=True):
        ids = encoding.ids
        # The first response token is the first one that ends after the prompt; when it starts inside the prompt
        # (a merge across the boundary) it is still trained on, and counted.
        n_prompt = next((i for i, (_, end) in enumerate(encoding.offsets) if end > len(prompt)), len(ids))
        merge = n_prompt < len(ids) and encoding.offsets[n_prompt][0] < len(prompt)
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
        rows["attention_mask"].append([1] * (len(source) + len(target)))
        rows["labels"].append(labels)
        rows["outcome"].append(outcome)
        rows["boundary_merge"].append(merge)
    return rows


def percentile_99(lengths: list[int]) -> int:
    """The smallest length that at least 99 % of `lengths` do not exceed (0 for none)."""
    if not lengths:
        return 0
    return sorted(lengths)[math.ceil(0.99 * len(lengths)) - 1]


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
