"""Held-out generation metrics: greedy, batched, left-padded generation scored by local `evaluate` modules.

Only token ids and decoded text are ever kept: `generate` returns ids (no scores, no logits), each batch is
decoded as soon as it is generated, so evaluation memory is one batch's worth whatever the size of the set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_scale.data.templates import PromptTemplate
from hf_scale.data.tokenize import prompt_ids
from hf_scale.metrics import load_metric

GENERATION_METRICS = ("exact_match", "token_f1")


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, str]],
    template: PromptTemplate,
    max_new_tokens: int = 16,
    batch_size: int = 64,
) -> list[str]:
    """Greedy responses to this process's contiguous share of `records` (concatenated in rank order, the shares are
    `records`), in order.

    Every process runs the same number of `generate` calls (a process with no records left runs a dummy batch it
    does not keep), so ZeRO-3's synchronised generation never waits on a peer that stopped early. The model is put
    in eval mode and the caller's mode is restored.
    """
    state = PartialState()
    calls = math.ceil(math.ceil(len(records) / state.num_processes) / batch_size)  # for the largest share
    texts: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with state.split_between_processes(list(records)) as mine:
            for call in range(calls):
                batch = mine[call * batch_size : (call + 1) * batch_size]
                generated = _generate_batch(model, tokenizer, batch or records[:1], template, max_new_tokens)
                if batch:
                    texts.extend(generated)
    finally:
        model.train(was_training)
    return texts


def _generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: Sequence[dict[str, str]],
    template: PromptTemplate,
    max_new_tokens: int,
) -> list[str]:
    """Greedy-generate one left-padded batch and decode the new tokens (special tokens, padding included, dropped)."""
    prompts = [held_out_prompt_ids(tokenizer, template, record) for record in batch]
    # Left padding, for this batch only (training pads on the right whatever the tokenizer says): every prompt ends
    # at the last column, where generation appends.
    inputs = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(model.device)
    generated = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop_token_ids(model, tokenizer, template),
        # Ids only: scores or logits of every step would be kept for the whole batch.
        output_scores=False,
        output_logits=False,
        return_dict_in_generate=False,
    )
    return tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def held_out_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, template: PromptTemplate, record: dict[str, Any]
) -> list[int]:
    """What generation is given for a held-out record: its `prompt_ids` when it has them (a conversation's last
    turn, the history rendered by its chat template), else its instruction and input in `template`, after BOS."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    return prompt_ids(tokenizer, template.format_prompt(record["instruction"], record.get("input") or ""))


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, template: PromptTemplate) -> list[int]:
    """Where greedy generation stops: the model's own EOS ids, the tokenizer's EOS, and the template's end of turn.

    A chat template that closes a turn with a token other than EOS (`<|im_end|>`, `<|eot_id|>`) trains the model
    to write that token and not EOS; generation that waited for EOS would run on past the answer.
    """
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    ids.append(tokenizer.eos_token_id)
    if template.end_of_turn:
        ids.append(tokenizer.convert_tokens_to_ids(template.end_of_turn))
    return list(dict.fromkeys(i for i in ids if i is not None))  # in order, once each


def generation_metrics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, str]],
    template: PromptTemplate,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    metrics: Sequence[str] = GENERATION_METRICS,
) -> dict[str, float]:
    """Score the greedy responses to `records` against their `output` with the local metric modules `metrics`.

    Returns one value per metric, keyed by its name (`exact_match`, `token_f1`), the same on every process. The
    responses of all processes are gathered in record order before scoring, so N processes give exactly the
    1-process value; the texts are a few bytes per record, never logits.
    """
    if not records:
        raise ValueError("generation_metrics needs at least one record")
    # Loaded first: an unknown metric name fails before any generation.
    modules = [load_metric(name) for name in metrics]
    texts = generate_responses(model, tokenizer, records, template, max_new_tokens, batch_size)
    if PartialState().num_processes > 1:
        texts = gather_object(texts)
    if len(texts) != len(records):
        raise RuntimeError(f"generated {len(texts)} responses for {len(records)} records")
    references = [r["output"] for r in records]
    scores: dict[str, float] = {}
    for module in modules:
        result = module.compute(predictions=texts, references=references)
        scores.update({key: float(value) for key, value in result.items()})
    return scores


@dataclass
class GenerationEval:
    """Held-out records that `ScaleTrainer.evaluate()` answers greedily and scores, beside the eval loss.

    The scores appear as `eval_exact_match` and `eval_token_f1` (with the evaluation's prefix), so they can be
    `metric_for_best_model` and the early-stopping metric. `tokenizer` defaults to the trainer's
    processing_class.

    Example:
        trainer = ScaleTrainer(model=model, args=args, eval_dataset=held_out_tokens,
                               generation_eval=GenerationEval(held_out_records[:200], template, max_new_tokens=32))
        print(trainer.evaluate()["eval_exact_match"])
    """

    records: Sequence[dict[str, str]]
    template: PromptTemplate
    max_new_tokens: int = 16
    batch_size: int = 64
    metrics: Sequence[str] = GENERATION_METRICS
    tokenizer: PreTrainedTokenizerBase | None = None


def greedy_exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, str]],
    template: PromptTemplate,
    max_new_tokens: int = 16,
    batch_size: int = 64,
) -> float:
    """Share of `records` whose greedy generation, stripped, equals their stripped `output`."""
    return generation_metrics(model, tokenizer, records, template, max_new_tokens, batch_size, ("exact_match",))[
        "exact_match"
    ]
