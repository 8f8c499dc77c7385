"""Batches of preference pairs: the chosen rows, then the rejected rows, either right-padded into one 2B-row batch or
packed into one row without padding.

Packed, the 2B sequences follow each other in one row with `position_ids` restarting at 0 at each, and no attention
mask: the SFT path for packed batches applies (transformers builds a block-diagonal mask from the position ids, or
hf_scale's per-example attention cuts the row; `ScaleTrainer` turns the KV cache off), so no sequence sees another.
`sequence_ids` says which of the 2B sequences each token belongs to, and the log-probs are summed per sequence
(`packed_sequence_logps`): the same values as padded rows, without the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_scale.data.tokenize import IGNORE_INDEX


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id (padding is masked out either way), else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return getattr(tokenizer, name)
    return 0


@dataclass
class PreferenceCollator:
    """`input_ids` and `labels` of 2B sequences (B chosen, then their B rejected): padded on the right to the longest
    with an `attention_mask`, or with `packing` one row with `position_ids` and `sequence_ids`; `reference_logps`
    (2B) when the pairs carry precomputed reference log-probs."""

    pad_token_id: int
    packing: bool = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
        labels = [f["chosen_labels"] for f in features] + [f["rejected_labels"] for f in features]
        batch = self.packed(ids, labels) if self.packing else self.padded(ids, labels)
        if "reference_chosen_logps" in features[0]:
            batch["reference_logps"] = torch.tensor(
                [f["reference_chosen_logps"] for f in features] + [f["reference_rejected_logps"] for f in features],
                dtype=torch.float32,
            )
        return batch

    def padded(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
        length = max(len(row) for row in ids)
        batch = {
            "input_ids": torch.full((len(ids), length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(ids), length), dtype=torch.long),
            "labels": torch.full((len(ids), length), IGNORE_INDEX, dtype=torch.long),
        }
        for row, (row_ids, row_labels) in enumerate(zip(ids, labels, strict=True)):
            batch["input_ids"][row, : len(row_ids)] = torch.as_tensor(row_ids)
            batch["attention_mask"][row, : len(row_ids)] = 1
            batch["labels"][row, : len(row_labels)] = torch.as_tensor(row_labels)
        return batch

    @staticmethod
    def packed(ids: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
        # A sequence's first token is never a label (it is predicted by the sequence before it in the row): the
        # prompt's first token is unlabelled anyway, and an unlabelled first token keeps that true whatever the data.
        first_unlabelled = [[IGNORE_INDEX, *row[1:]] for row in labels]
        return {
            "input_ids": torch.tensor([[token for row in ids for token in row]], dtype=torch.long),
            "labels": torch.tensor([[label for row in first_unlabelled for label in row]], dtype=torch.long),
            "position_ids": torch.tensor([[p for row in ids for p in range(len(row))]], dtype=torch.long),
            "sequence_ids": torch.tensor([[n for n, row in enumerate(ids) for _ in row]], dtype=torch.long),
        }
