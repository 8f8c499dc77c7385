"""Attention over packed rows, one example at a time, instead of through a dense block-diagonal mask.

For a packed batch (one row of examples whose `position_ids` restart at 0) transformers' sdpa path builds a
row x row boolean mask and runs attention over the whole row: the cost grows with the square of the row, and
an explicit mask keeps SDPA off its flash kernel. On a GPU without flash-attn, and on a CPU, packing 8
Alpaca examples then costs more attention than padding each to 512 tokens. This implementation, registered
with transformers as "hf_scale_packed_sdpa", cuts the row at each restart and runs causal SDPA per example: the
same result (no example sees another), at the cost of the examples' own lengths. Everything that is not a
packed row (padded batches, generation with a KV cache) goes through transformers' own sdpa code unchanged.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import pairwise

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, find_packed_sequence_indices, sdpa_mask

PACKED_SDPA = "hf_scale_packed_sdpa"


@lru_cache(maxsize=1)  # keyed by the tensor's identity
def segment_starts(position_ids: torch.Tensor) -> list[list[int]]:
    """For each row, where its examples start (as transformers' `find_packed_sequence_indices` reads them), and its end.

    Every layer of one forward gets the same `position_ids` tensor: the boundaries are read once per forward,
    so a GPU synchronises once, not once per layer.
    """
    sequence_index = find_packed_sequence_indices(position_ids)  # None: one example in every row
    if sequence_index is None:
        return [[0, position_ids.shape[1]]] * position_ids.shape[0]
    return [[0, *(torch.nonzero(row.diff()).flatten() + 1).tolist(), row.numel()] for row in sequence_index]


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """sdpa attention, run per example on a packed row; (batch, length, heads, head_dim) like transformers'."""
    length = query.shape[2]
    if attention_mask is not None or position_ids is None or key.shape[2] != length or length == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = segment_starts(position_ids)
    if len(rows) != query.shape[0]:  # position ids shared by every row of the batch
        rows = rows * query.shape[0]
    if all(len(bounds) == 2 for bounds in rows):  # one example per row: plain causal attention
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    outputs = []
    for row, bounds in enumerate(rows):
        pieces = []
        for start, end in pairwise(bounds):
            cut = (slice(row, row + 1), slice(None), slice(start, end))  # one example: (1, heads, its length, dim)
            pieces.append(sdpa_attention_forward(module, query[cut], key[cut], value[cut], None, **kwargs)[0])
        outputs.append(torch.cat(pieces, dim=1))
    return torch.cat(outputs, dim=0), None


def packed_sdpa_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for a row without padding and without a cache (the attention cuts it); sdpa's mask otherwise."""
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def use_packed_sdpa(model: PreTrainedModel) -> bool:
    """Switch a model on transformers' sdpa attention to the per-example one; True when it now uses it.

    Models on eager, flash-attn or flex attention keep theirs (flash-attn already runs packed rows per example),
    and so do models whose layers attend through a sliding window or chunks, which the cut would not respect.
    `ScaleTrainer` calls it on the first packed batch (unless `packed_sdpa=False`).

    Example:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        use_packed_sdpa(model)  # then feed packed rows: input_ids and position_ids, no attention_mask
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    """
    config = model.config
    if config._attn_implementation == PACKED_SDPA:
        return True
    if (
        config._attn_implementation != "sdpa"
        or getattr(config, "sliding_window", None)
        or getattr(config, "attention_chunk_size", None)
    ):
        return False
    model.set_attn_implementation(PACKED_SDPA)
    return True
