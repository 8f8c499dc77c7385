"""Precomputed reference log-probs kept on disk: computed once for a set of pairs and a starting model, then read by a
resumed run, every trial of a search and every worker of a parallel search.

The key is a digest of the pairs' tokens and labels, the starting weights (the base's under LoRA: the reference is
the model with its adapters off) and the precision they were computed in. A folder per key is made once and whole
(`hf_scale.data.cache.cached_folder`), under `$HF_SCALE_CACHE/reference-logps`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from torch import nn

from hf_scale.data.cache import COMPLETE, cached_folder, digest
from hf_scale.paths import cache_dir

PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
LOGPS_FILE = "reference_logps.npy"


def reference_cache_root() -> Path:
    return cache_dir() / "reference-logps"


def pairs_digest(dataset: Dataset) -> str:
    """A digest of the pairs' token ids and labels, in order (the columns the reference log-probs depend on)."""
    table = dataset.flatten_indices().data
    hasher = hashlib.sha256(str(len(dataset)).encode())
    for name in PAIR_COLUMNS:
        column = table.column(name)
        hasher.update(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        hasher.update(pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return hasher.hexdigest()[:24]


def weights_digest(model: nn.Module) -> str:
    """A digest of the weights this process holds, LoRA adapters left out (the reference runs with them off).

    Under ZeRO-3 a process holds its partition only (`ds_tensor`): the caller combines every process's digest."""
    hasher = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        held = getattr(tensor, "ds_tensor", tensor)
        hasher.update(name.encode())
        hasher.update(held.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return hasher.hexdigest()[:24]


def read_reference_logps(folder: Path) -> np.ndarray:
    """The (pairs, 2) array of chosen and rejected reference log-probs kept in `folder`."""
    return np.load(folder / LOGPS_FILE)


def keep_reference_logps(key: str, logps: np.ndarray) -> Path:
    """Write the (pairs, 2) log-probs under `key` (unless a process already did); the folder."""

    def build(folder: Path) -> None:
        np.save(folder / LOGPS_FILE, logps)
        (folder / COMPLETE).write_text(json.dumps({"pairs": len(logps)}))

    folder, _ = cached_folder(reference_cache_root(), key, build)
    return folder


def reference_key(pairs: str, weights: list[str], precision: str) -> str:
    return digest("reference-logps", pairs, weights, precision)


def cached_reference(key: str) -> Path | None:
    """The folder of the log-probs kept under `key`, or None."""
    folder = reference_cache_root() / key
    return folder if (folder / COMPLETE).is_file() else None
