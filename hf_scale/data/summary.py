"""What a user reads before training: what became of the records, the padding cost, one example as trained."""

from __future__ import annotations

from itertools import groupby

import pyarrow.compute as pc
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from hf_scale.data.batching import Batching, padding_fraction
from hf_scale.data.tokenize import IGNORE_INDEX


def render_masked_example(tokenizer: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int]) -> str:
    """The example's text with each trained-on span between ⟦ and ⟧ (the rest is masked with -100)."""
    pieces = []
    for trained, pairs in groupby(zip(input_ids, labels, strict=True), key=lambda pair: pair[1] != IGNORE_INDEX):
        text = tokenizer.decode([token for token, _ in pairs])
        pieces.append(f"⟦{text}⟧" if trained else text)
    return "".join(pieces)


def example_lengths(dataset: Dataset) -> list[int]:
    """Each example's length in tokens, read from Arrow (not a Python list of token ids an example)."""
    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()


def batching_of(packing: bool, train_sampling_strategy: str) -> Batching:
    """The batching a run uses, in `padding_fraction`'s terms."""
    if packing:
        return "packing"
    return "group_by_length" if train_sampling_strategy == "group_by_length" else "dynamic"


def describe_batching(lengths: list[int], batch_size: int, batching: Batching, pad_to_multiple_of: int | None) -> str:
    """The padding the chosen batching costs a set of examples of these lengths."""
    waste = padding_fraction(lengths, batch_size, batching, pad_to_multiple_of=pad_to_multiple_of) if lengths else 0
    return f"batching: {batching}, {waste:.1%} of the batch tokens are padding"
