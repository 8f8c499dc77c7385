"""Reuse a tokenized set across runs: keyed by the records, the tokenizer, the template and the settings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from datasets import Dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from hf_scale.data.templates import PromptTemplate
from hf_scale.data.tokenize import TokenizationSummary, tokenize_records

CACHE_VERSION = 4  # bump when tokenize_records changes what it produces


def tokenization_key(
    records: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, template: PromptTemplate, **settings
) -> str:
    """A digest of everything the tokenized set depends on."""
    digest = hashlib.sha256()
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    digest.update(json.dumps([CACHE_VERSION, dataclasses.asdict(template), settings, special], sort_keys=True).encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode())  # a fast tokenizer: tokenize_records needs one
    for record in records:
        digest.update(json.dumps([record["instruction"], record.get("input") or "", record["output"]]).encode())
    return digest.hexdigest()[:24]


def cached_tokenize_records(
    records: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    cache_dir: str | os.PathLike,
    num_proc: int | None = None,
    **settings,
) -> tuple[Dataset, TokenizationSummary, bool]:
    """`tokenize_records`, stored under `cache_dir` and reused when nothing it depends on changed.

    Returns (dataset, summary, whether it came from the cache). A cache entry appears whole or not at all.
    `num_proc` is not part of the key: it changes how fast the set is made, not what it holds.

    Example:
        dataset, summary, reused = cached_tokenize_records(records, tokenizer, template, "cache/tokenized",
                                                           max_length=512)
    """
    folder = Path(cache_dir) / tokenization_key(records, tokenizer, template, **settings)
    if (folder / "summary.json").is_file():
        summary = TokenizationSummary(**json.loads((folder / "summary.json").read_text()))
        return load_from_disk(str(folder / "dataset")), summary, True
    dataset, summary = tokenize_records(records, tokenizer, template, num_proc=num_proc, **settings)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        dataset.save_to_disk(str(staging / "dataset"))
        (staging / "summary.json").write_text(json.dumps(dataclasses.asdict(summary)))
        os.rename(staging, folder)
    except OSError:
        if not (folder / "summary.json").is_file():  # another process finished first: its entry is identical
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dataset, summary, False
