"""Tokenize Alpaca records into `input_ids` and `labels` whose mask is exact.

The whole text (prompt + response) is tokenized once, as the model will read it, and each token is labelled
by where its characters lie: a token that ends inside the prompt is -100, every other token is trained on.
So the mask follows whatever the tokenizer did at the boundary instead of assuming `len(tokenize(prompt))`
(the Stanford-Alpaca way, off whenever BPE merges across the boundary). BOS is added once, EOS is appended
and always labelled (also when pad == eos). Over-long records follow a truncation policy, and every record
cut or dropped is counted in the summary.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from hf_scale.data.templates import PromptTemplate
from hf_scale.errors import ConfigError, DataError

IGNORE_INDEX = -100
Truncation = Literal["keep_prompt", "cut_prompt_left", "drop"]
TRUNCATION_POLICIES = ("keep_prompt", "cut_prompt_left", "drop")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """BOS (when the tokenizer has one) followed by the prompt's tokens: what generation starts from."""
    return _with_bos(tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _with_bos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else list(ids)


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
) -> tuple[Dataset, TokenizationSummary]:
    """Turn Alpaca records into a `Dataset` of `input_ids`, `attention_mask` and `labels`.

    `truncation` for records longer than `max_length`: "keep_prompt" cuts the end of the response,
    "cut_prompt_left" cuts the start of the prompt (after BOS), "drop" drops the record.
    """
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no EOS token: the model could never learn to stop")
    if truncation not in TRUNCATION_POLICIES:
        raise ConfigError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
        warnings.warn("pad == eos: the EOS of every example is still labelled (labels come from lengths)", stacklevel=2)

    prompts = [template.format_prompt(r["instruction"], r.get("input") or "") for r in records]
    texts = [p + template.format_response(r["output"]) for p, r in zip(prompts, records, strict=True)]
    encoded = tokenizer(texts, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    summary = TokenizationSummary(records=len(records))
    columns: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for index, (prompt, text, ids) in enumerate(zip(prompts, texts, encoded["input_ids"], strict=True)):
        # The first response token is the one holding the response's first character; when it starts inside
        # the prompt (a merge across the boundary) it is still trained on, and counted.
        n_prompt = _first_token_at_or_after(encoded, index, len(prompt), len(text), default=len(ids))
        if n_prompt < len(ids) and encoded.token_to_chars(index, n_prompt).start < len(prompt):
            summary.boundary_merges += 1
        source = bos + ids[:n_prompt]
        target = [*ids[n_prompt:], tokenizer.eos_token_id]
        source, target = _fit(source, target, len(bos), max_length, truncation, summary, index)
        if source is None:
            continue
        labels = (source if train_on_inputs else [IGNORE_INDEX] * len(source)) + target
        if bos and train_on_inputs:
            labels[0] = IGNORE_INDEX  # nothing predicts BOS
        columns["input_ids"].append(source + target)
        columns["attention_mask"].append([1] * (len(source) + len(target)))
        columns["labels"].append(labels)
        summary.examples += 1
        summary.tokens += len(source) + len(target)
        summary.label_tokens += sum(1 for label in labels[1:] if label != IGNORE_INDEX)
    return Dataset.from_dict(columns), summary


def check_examples_left(name: str, summary: TokenizationSummary, max_length: int, truncation: str) -> None:
    """A `DataError` naming max_length when the truncation policy dropped every record of set `name`.

    Dropping some records is policy, and counted; dropping all leaves an empty set that fails later, far from
    its cause (an empty batch, an empty evaluation).
    """
    if summary.records and not summary.examples:
        raise DataError(
            f"max_length={max_length} leaves no {name} example: all {summary.records} records dropped "
            f"({summary.dropped_no_response} because the prompt alone fills max_length, {summary.dropped_too_long} "
            f"too long with truncation={truncation!r}); raise max_length or choose another truncation"
        )


def _first_token_at_or_after(encoded, index: int, char: int, end: int, default: int) -> int:
    """Index of the token holding character `char` of text `index` (or the next character that has one)."""
    for position in range(char, end):
        token = encoded.char_to_token(index, position)
        if token is not None:
            return token
    return default


def _fit(
    source: list[int],
    target: list[int],
    n_bos: int,
    max_length: int,
    truncation: Truncation,
    summary: TokenizationSummary,
    index: int,
) -> tuple[list[int] | None, list[int]]:
    """Apply the truncation policy; return (None, []) for a dropped record, counting every change."""
    excess = len(source) + len(target) - max_length
    if excess <= 0:
        return source, target
    if truncation == "drop":
        summary.dropped_too_long += 1
    elif truncation == "cut_prompt_left":
        if len(source) - n_bos > excess:
            summary.prompt_cut += 1
            return source[:n_bos] + source[n_bos + excess :], target
        summary.dropped_too_long += 1  # even an empty prompt leaves the response too long
    elif len(source) < max_length:
        summary.response_cut += 1
        return source, target[: max_length - len(source)]  # no EOS: the response did not end here
    else:
        summary.dropped_no_response += 1
    summary.dropped_indices.append(index)
    return None, []
