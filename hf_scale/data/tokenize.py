"""Tokenize prompt/response pairs into `input_ids` and `labels` with the prompt masked out.

Prompt and response are tokenized separately and concatenated, so the boundary between them is a token
boundary by construction: every response token and the EOS are trained on, every prompt token is -100,
whatever merges the tokenizer would have made across the boundary. Generation tokenizes the prompt the
same way, so the model is trained on exactly the token sequence it later continues.
"""

from __future__ import annotations

from dataclasses import dataclass

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from hf_scale.data.templates import PromptTemplate

IGNORE_INDEX = -100


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """BOS (when the tokenizer has one) followed by the prompt's tokens: what generation starts from."""
    return _with_bos(tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _with_bos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else list(ids)


@dataclass
class TokenizationSummary:
    """What happened to the records on their way to examples; nothing is dropped without being counted."""

    records: int
    examples: int
    truncated: int  # kept, with the end of the response cut at max_length
    dropped_no_response: int  # the prompt alone filled max_length: no token left to learn from

    def __str__(self) -> str:
        return (
            f"{self.records} records -> {self.examples} examples ({self.truncated} with the response cut at "
            f"max_length, {self.dropped_no_response} dropped because the prompt alone fills max_length)"
        )


def tokenize_records(
    records: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, template: PromptTemplate, max_length: int
) -> tuple[Dataset, TokenizationSummary]:
    """Turn Alpaca records into a `Dataset` of `input_ids`, `attention_mask` and `labels`.

    Labels cover the response and the EOS. An example longer than `max_length` keeps its prompt and loses the
    end of its response; one whose prompt alone reaches `max_length` is dropped. Both are counted.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token: the model could never learn to stop")
    prompts = [template.format_prompt(r["instruction"], r.get("input") or "") for r in records]
    prompt_tokens = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_tokens = tokenizer([r["output"] for r in records], add_special_tokens=False)["input_ids"]

    columns: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    truncated = dropped = 0
    for source, response in zip(prompt_tokens, response_tokens, strict=True):
        source = _with_bos(tokenizer, source)
        target = [*response, tokenizer.eos_token_id]
        if len(source) >= max_length:
            dropped += 1
            continue
        if len(source) + len(target) > max_length:
            truncated += 1
        input_ids = (source + target)[:max_length]
        columns["input_ids"].append(input_ids)
        columns["attention_mask"].append([1] * len(input_ids))
        columns["labels"].append(([IGNORE_INDEX] * len(source) + target)[:max_length])
    summary = TokenizationSummary(len(records), len(columns["input_ids"]), truncated, dropped)
    return Dataset.from_dict(columns), summary
