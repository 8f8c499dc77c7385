"""Batches of preference pairs: the chosen rows, then the rejected rows, right-padded into one 2B-row batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_scale.data.tokenize import IGNORE_INDEX


@dataclass
class PreferenceCollator:
    """`input_ids`, `attention_mask` and `labels` of 2B rows (B chosen, then their B rejected), padded on the right
    to the longest; `reference_logps` (2B) when the pairs carry precomputed reference log-probs."""

    pad_token_id: int

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
        labels = [f["chosen_labels"] for f in features] + [f["rejected_labels"] for f in features]
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
        if "reference_chosen_logps" in features[0]:
            batch["reference_logps"] = torch.tensor(
                [f["reference_chosen_logps"] for f in features] + [f["reference_rejected_logps"] for f in features],
                dtype=torch.float32,
            )
        return batch
