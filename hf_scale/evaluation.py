"""Held-out greedy exact match: does the model write exactly the expected response?"""

from __future__ import annotations

import math

import torch
from accelerate import PartialState
from accelerate.utils import reduce
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_scale.data.templates import PromptTemplate
from hf_scale.data.tokenize import prompt_ids


@torch.no_grad()
def greedy_exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict[str, str]],
    template: PromptTemplate,
    max_new_tokens: int = 16,
    batch_size: int = 64,
) -> float:
    """Share of `records` whose greedy generation, stripped, equals their stripped `output`.

    Each process takes a contiguous share of the records and every process runs the same number of
    `generate` calls (a process with no records left runs a dummy batch it does not count), so ZeRO-3's
    synchronised generation never waits on a peer that stopped early. The counts are summed.
    """
    if not records:
        raise ValueError("greedy_exact_match needs at least one record")
    state = PartialState()
    per_process = math.ceil(len(records) / state.num_processes)
    first = state.process_index * per_process
    mine = records[first : first + per_process]
    counts = torch.zeros(2, dtype=torch.long, device=state.device)  # (exact matches, records counted)

    was_training = model.training
    model.eval()
    for start in range(0, per_process, batch_size):
        batch = mine[start : start + batch_size]
        counted = bool(batch)
        batch = batch or records[:1]
        prompts = [prompt_ids(tokenizer, template.format_prompt(r["instruction"], r["input"])) for r in batch]
        inputs = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(model.device)
        generated = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        if not counted:
            continue
        texts = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        counts[0] += sum(text.strip() == record["output"].strip() for text, record in zip(texts, batch, strict=True))
        counts[1] += len(batch)
    model.train(was_training)

    if state.num_processes > 1:
        counts = reduce(counts, reduction="sum")
    return counts[0].item() / counts[1].item()
