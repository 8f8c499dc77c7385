"""Batches for training: dynamic padding or padding-free packing, and how much padding each one costs.

Packing reuses transformers' `DataCollatorWithFlattening`: a batch becomes one row with `position_ids`
restarting at every example, and transformers' masking builds a block-diagonal mask from them on the sdpa
and eager paths, so no example attends to another. That mask is only built when the forward has no KV
cache: with `use_cache=True` (the saved config's default, and what `TrainingArguments(use_cache=True)` puts
back) the packed examples silently attend to each other. `ScaleTrainer` passes `use_cache=False` for every
packed batch, and switches sdpa models to `hf_scale.packed_attention`, which cuts the row at each restart
instead of masking the whole row.

Padded batches pad on the right whatever the tokenizer's `padding_side` says: many chat models save "left" (what
their generation needs), and left-padded training shifts every shorter example's positions. LLaMA's rotary positions
are relative, so its loss does not change, but a model with absolute positions trains on shifted ones. Generation
(`hf_scale.evaluation`) pads its own batches on the left.
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase
from transformers.trainer_pt_utils import LengthGroupedSampler

from hf_scale.data.tokenize import IGNORE_INDEX

Batching = Literal["pad_to_max_length", "dynamic", "group_by_length", "packing"]


def make_collator(tokenizer: PreTrainedTokenizerBase, packing: bool, pad_to_multiple_of: int | None = 8):
    """Padding-free packing, or padding on the right to the longest example of each batch (labels padded with -100).

    Example:
        collator = make_collator(tokenizer, packing=True)  # one row per batch, per-example position_ids
        batch = collator([dataset[0], dataset[1]])
    """
    if packing:
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    # DataCollatorForSeq2Seq pads inputs and labels on `tokenizer.padding_side`: give it a shallow copy that pads on
    # the right, and leave the shared tokenizer (saved with the model, used for generation) as it was.
    right_padding = copy.copy(tokenizer)
    right_padding.padding_side = "right"
    return DataCollatorForSeq2Seq(right_padding, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=pad_to_multiple_of)


def is_packed_batch(inputs: dict) -> bool:
    """A flattened batch: position ids and no attention mask (the mask comes from the position ids)."""
    return "position_ids" in inputs and inputs.get("attention_mask") is None


def padding_fraction(
    lengths: list[int],
    batch_size: int,
    batching: Batching,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> float:
    """Share of the tokens in the batches that are padding, for one epoch in the sampler's order."""
    if batching == "packing":
        return 0.0
    if batching == "pad_to_max_length":
        if max_length is None:
            raise ValueError("pad_to_max_length needs max_length")
        return 1 - sum(lengths) / (max_length * len(lengths))
    # The order of an epoch as the Trainer's samplers give it: shuffled, or grouped by length within megabatches.
    generator = torch.Generator().manual_seed(0)
    if batching == "group_by_length":
        order = list(LengthGroupedSampler(batch_size, lengths=lengths, generator=generator))
    else:
        order = torch.randperm(len(lengths), generator=generator).tolist()
    padded = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        width = max(batch)
        if pad_to_multiple_of:
            width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
        padded += width * len(batch)
    return 1 - sum(lengths) / padded
