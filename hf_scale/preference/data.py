"""Preference pairs: read in the forms the peers use, and tokenized with exactly the chosen and rejected responses
trained on.

A pair is a prompt (a conversation ending with a user turn) and two assistant answers. Each answer is appended to the
prompt and tokenized as a conversation whose last assistant turn alone is labelled (`tokenize_conversations`, so the
masks have SFT's exactness with any prefix-stable chat template, and over-long prompts lose their oldest pairs the
same way). A pair is kept when both halves are, and when both continue the same prompt tokens (they could differ if
one half had to be shortened more than the other); every pair left out is counted, with its reason.

Forms read (one record each):
- TRL standard: `{"prompt": str, "chosen": str, "rejected": str}`;
- TRL conversational: `{"prompt": [messages], "chosen": [assistant message], "rejected": [assistant message]}`, or
  without `prompt`, `chosen` and `rejected` the whole conversations (the prompt is what they share);
- LLaMA-Factory's ranking Alpaca form: `{"instruction", "input", "chosen", "rejected"}` (and `system`): written by a
  one-turn template (alpaca, alpaca_zh) exactly as SFT writes the record, or by a chat template as one user turn, the
  instruction, then the input after a blank line (as SFT does with a chat template);
- LLaMA-Factory's ranking ShareGPT form: `{"conversations": [{"from", "value"}], "chosen": {"from": "gpt",
  "value"}, "rejected": {...}}`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from hf_scale.data.multiturn import Turn, chat_template_for, render_all, tokenize_conversations
from hf_scale.data.templates import CHAT_TEMPLATE, TEMPLATES, PromptTemplate, get_template
from hf_scale.data.tokenize import IGNORE_INDEX, Truncation, tokenize_records
from hf_scale.errors import DataError
from hf_scale.tiny.tasks import generate_preference_tasks

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class PreferencePair:
    prompt: list[Turn]  # system (optional), then user/assistant turns ending with a user turn
    chosen: str
    rejected: str
    # An Alpaca-form pair's own `instruction` and `input`, for the one-turn templates (alpaca, alpaca_zh, ...), which
    # write `input` under a heading of its own as SFT did; None for a conversation.
    record: dict[str, str] | None = None


@dataclass
class PreferenceSummary:
    """What happened to the pairs on their way to examples; nothing is left out without being counted."""

    pairs: int
    kept: int = 0
    dropped_too_long: int = 0  # the chosen or the rejected conversation does not fit max_length
    prompts_differ: int = 0  # both fit, but one was shortened differently: not the same prompt tokens
    # Counted over each half's conversations, before pairing (a pair dropped for its other half included):
    chosen_cut: int = 0  # the end of the chosen answer cut at max_length
    rejected_cut: int = 0
    chosen_shortened: int = 0  # the prompt without its oldest user/assistant pairs, to fit
    rejected_shortened: int = 0
    tokens: int = 0
    label_tokens: int = 0
    dropped_indices: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        first = f" (first positions in this set: {self.dropped_indices[:5]})" if self.dropped_indices else ""
        return (
            f"{self.pairs} pairs -> {self.kept} kept, {self.tokens} tokens of which {self.label_tokens} trained on; "
            f"{self.dropped_too_long} dropped as too long and {self.prompts_differ} whose halves were shortened "
            f"differently{first}; {self.chosen_cut} chosen and {self.rejected_cut} rejected answers cut at "
            f"max_length, {self.chosen_shortened} chosen and {self.rejected_shortened} rejected conversations "
            "shortened by their oldest pairs"
        )


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: expected a non-empty string, got {value!r}"[:300])
    return value


def _messages(value: object, where: str) -> list[Turn]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: expected a list of messages, got {value!r}"[:300])
    turns = []
    for position, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise DataError(f"{where}[{position}]: expected {{'role': system|user|assistant, 'content': ...}}")
        turns.append(
            {"role": message["role"], "content": _text(message.get("content"), f"{where}[{position}].content")}
        )
    return turns


def _answer(value: object, where: str) -> str:
    """An answer: a string, one assistant message, or a list holding one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        role = value.get("role", SHAREGPT_ROLES.get(value.get("from", ""), ""))
        if role != "assistant":
            raise DataError(f"{where}: expected an assistant message, got role {role!r}")
        return _text(value.get("content", value.get("value")), where)
    return _text(value, where)


def _check_prompt(prompt: list[Turn], where: str) -> list[Turn]:
    if prompt[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt must end with a user turn, it ends with a {prompt[-1]['role']} turn")
    return prompt


def preference_pair(record: object, where: str) -> PreferencePair:
    """One record in any of the module docstring's forms; a `DataError` naming the record and field otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    if "chosen" not in record or "rejected" not in record:
        raise DataError(f"{where}: a preference pair needs 'chosen' and 'rejected' (keys: {sorted(record)})")
    if "instruction" in record:  # LLaMA-Factory's ranking Alpaca form
        user = _text(record["instruction"], f"{where}.instruction")
        if record.get("input"):
            user = f"{user}\n\n{_text(record['input'], f'{where}.input')}"
        system = (
            [{"role": "system", "content": _text(record["system"], f"{where}.system")}] if record.get("system") else []
        )
        alpaca = None if system else {"instruction": record["instruction"], "input": record.get("input") or ""}
        chosen, rejected = (
            _answer(record["chosen"], f"{where}.chosen"),
            _answer(record["rejected"], f"{where}.rejected"),
        )
        return PreferencePair([*system, {"role": "user", "content": user}], chosen, rejected, alpaca)
    elif "conversations" in record:  # LLaMA-Factory's ranking ShareGPT form
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}.conversations: expected a list of {{'from', 'value'}} turns")
        prompt = []
        for position, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
            if role is None:
                raise DataError(f"{where}.conversations[{position}]: expected 'from' human|gpt|system and 'value'")
            prompt.append({"role": role, "content": _text(turn.get("value"), f"{where}.conversations[{position}]")})
    elif "prompt" in record:  # TRL, explicit prompt
        value = record["prompt"]
        prompt = (
            [{"role": "user", "content": _text(value, f"{where}.prompt")}]
            if isinstance(value, str)
            else _messages(value, f"{where}.prompt")
        )
    else:  # TRL, implicit prompt: the turns both conversations share
        chosen, rejected = (
            _messages(record["chosen"], f"{where}.chosen"),
            _messages(record["rejected"], f"{where}.rejected"),
        )
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if chosen[:shared] != rejected[:shared] or shared + 1 != len(chosen) or shared + 1 != len(rejected):
            raise DataError(f"{where}: chosen and rejected must be the same conversation up to their last turn")
        return PreferencePair(
            _check_prompt(chosen[:shared], f"{where}.chosen"),
            _answer(chosen[-1], f"{where}.chosen[-1]"),
            _answer(rejected[-1], f"{where}.rejected[-1]"),
        )
    return PreferencePair(
        _check_prompt(prompt, where),
        _answer(record["chosen"], f"{where}.chosen"),
        _answer(record["rejected"], f"{where}.rejected"),
    )


def load_preference_pairs(path: str | Path) -> list[PreferencePair]:
    """The pairs of a JSON file (a list of records) or a JSON Lines file; every record checked before any work."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DataError(f"{path}: cannot be read: {error}") from None
    try:
        if path.suffix == ".jsonl":
            records = [
                (f"{path}: line {n}", json.loads(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()
            ]
        else:
            loaded = json.loads(text)
            if not isinstance(loaded, list):
                raise DataError(f"{path}: expected a JSON list of records")
            records = [(f"{path}: record {n}", record) for n, record in enumerate(loaded)]
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    if not records:
        raise DataError(f"{path}: no records")
    return [preference_pair(record, where) for where, record in records]


def _first_label(labels: list[int]) -> int:
    return next((position for position, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def tokenize_half(
    pairs: list[PreferencePair],
    half: str,
    tokenizer: PreTrainedTokenizerBase,
    template: str | PromptTemplate,
    max_length: int,
    truncation: Truncation,
    system_prompt: str | None,
) -> tuple[Dataset, list[int], int, int]:
    """(examples, dropped positions, answers cut, conversations shortened) of one half (chosen or rejected) of
    every pair, tokenized as SFT tokenizes: a one-turn template's records, or a chat template's conversations."""
    if isinstance(template, PromptTemplate):
        records = []
        for index, pair in enumerate(pairs):
            if pair.record is None:
                raise DataError(
                    f"pair {index}: a conversation (or a system turn), which the one-turn template cannot write: "
                    "use a chat template (template: chat_template, llama2_chat, ...)"
                )
            records.append({**pair.record, "output": getattr(pair, half)})
        examples, summary = tokenize_records(records, tokenizer, template, max_length, truncation=truncation)
        return examples, summary.dropped_indices, summary.response_cut, 0
    conversations = [[*pair.prompt, {"role": "assistant", "content": getattr(pair, half)}] for pair in pairs]
    examples, summary = tokenize_conversations(
        conversations, tokenizer, template, max_length, "last", truncation=truncation, system_prompt=system_prompt
    )
    return examples, summary.dropped_indices, summary.answer_cut, summary.shortened


def tokenize_preferences(
    pairs: list[PreferencePair],
    tokenizer: PreTrainedTokenizerBase,
    template: str | PromptTemplate,
    max_length: int,
    truncation: Truncation = "keep_prompt",
    system_prompt: str | None = None,
) -> tuple[Dataset, PreferenceSummary]:
    """A `Dataset` of `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`, `rejected_labels`, one row a kept
    pair, and the summary of what was kept, cut and left out (see the module docstring). `template`: a one-turn
    `PromptTemplate` (`get_template`: alpaca, alpaca_zh, ...) for Alpaca-form pairs, as SFT writes records, or a Jinja
    chat template (`chat_template_for`) for any pair.

    Example:
        pairs = load_preference_pairs("pairs.jsonl")
        dataset, summary = tokenize_preferences(pairs, tokenizer, chat_template_for("chat_template", tokenizer), 1024)
        print(summary)
    """
    halves = {}
    for half in ("chosen", "rejected"):
        examples, dropped, cut, shortened = tokenize_half(
            pairs, half, tokenizer, template, max_length, truncation, system_prompt
        )
        kept = np.ones(len(pairs), dtype=bool)
        kept[dropped] = False
        position = np.cumsum(kept) - 1  # where a kept pair's example is in `examples`
        halves[half] = (examples, kept, position, cut, shortened)

    result = PreferenceSummary(pairs=len(pairs))
    columns: dict[str, list[list[int]]] = {
        name: [] for name in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    }
    for index in range(len(pairs)):
        if not all(halves[half][1][index] for half in halves):
            result.dropped_too_long += 1
            result.dropped_indices.append(index)
            continue
        rows = {half: halves[half][0][int(halves[half][2][index])] for half in halves}
        prompts = {half: row["input_ids"][: _first_label(row["labels"])] for half, row in rows.items()}
        if prompts["chosen"] != prompts["rejected"]:
            result.prompts_differ += 1
            result.dropped_indices.append(index)
            continue
        for half, row in rows.items():
            columns[f"{half}_input_ids"].append(row["input_ids"])
            columns[f"{half}_labels"].append(row["labels"])
            result.tokens += len(row["input_ids"])
            result.label_tokens += sum(label != IGNORE_INDEX for label in row["labels"])
    result.kept = len(columns["chosen_input_ids"])
    if not result.kept:
        raise DataError(f"max_length={max_length} leaves no pair: {result}")
    result.chosen_cut, result.rejected_cut = halves["chosen"][3], halves["rejected"][3]
    result.chosen_shortened, result.rejected_shortened = halves["chosen"][4], halves["rejected"][4]
    return Dataset.from_dict(columns), result


@dataclass
class PreparedPairs:
    """A recipe's pairs as examples: train and held-out sets, what became of each pair, and the held-out prompts
    generation answers (Alpaca records, or `prompt_ids` with the chosen answer as `output`)."""

    train_dataset: Dataset
    eval_dataset: Dataset
    train_summary: PreferenceSummary
    eval_summary: PreferenceSummary
    template: str | PromptTemplate
    generation_records: list[dict[str, Any]]
    generation_template: PromptTemplate  # where generation stops (its end of turn)


def pairs_template(
    name: str, system_prompt: str | None, tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair]
) -> str | PromptTemplate:
    """The one-turn template `name` when every pair is an Alpaca record and the template writes one-turn records
    (as SFT wrote them), else the chat template `name` renders conversations with."""
    one_turn = name != CHAT_TEMPLATE and (name in TEMPLATES or name.lstrip().startswith("{"))
    if one_turn and all(pair.record is not None for pair in pairs):
        return get_template(name, system_prompt, tokenizer)
    return chat_template_for(name, tokenizer)


def prepare_pairs(
    dataset: str | None,
    eval_dataset: str | None,
    eval_ratio: float,
    template_name: str,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncation: Truncation = "keep_prompt",
    system_prompt: str | None = None,
    exact_match_samples: int = 0,
    seed: int = 42,
) -> PreparedPairs:
    """Pairs read (or the generated ones when `dataset` is None), `eval_ratio` held out unless `eval_dataset` is given,
    tokenized with exact masks; every pair is checked before any is tokenized."""
    if dataset is None:
        train_records, held_out_records = generate_preference_tasks()
        train = [preference_pair(record, f"generated pair {n}") for n, record in enumerate(train_records)]
        held_out = [
            preference_pair(record, f"generated held-out pair {n}") for n, record in enumerate(held_out_records)
        ]
    else:
        train = load_preference_pairs(dataset)
        if eval_dataset is not None:
            held_out = load_preference_pairs(eval_dataset)
        else:
            order = list(range(len(train)))
            random.Random(seed).shuffle(order)
            n_eval = max(1, round(len(train) * eval_ratio))
            if n_eval >= len(train):
                raise DataError(f"{dataset}: {len(train)} pair(s) are too few to hold out {eval_ratio:.0%}")
            train, held_out = [train[i] for i in order[n_eval:]], [train[i] for i in order[:n_eval]]
    template = pairs_template(template_name, system_prompt, tokenizer, train + held_out)
    train_dataset, train_summary = tokenize_preferences(
        train, tokenizer, template, max_length, truncation, system_prompt
    )
    eval_dataset_, eval_summary = tokenize_preferences(
        held_out, tokenizer, template, max_length, truncation, system_prompt
    )
    samples = held_out[:exact_match_samples]
    if isinstance(template, PromptTemplate):
        records = [{**pair.record, "output": pair.chosen} for pair in samples]
    else:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompts = [pair.prompt if pair.prompt[0]["role"] == "system" else system + pair.prompt for pair in samples]
        records = [
            {"prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "output": pair.chosen}
            for pair, text in zip(samples, render_all(tokenizer, template, prompts, True), strict=True)
        ]
    generation_template = (
        template if isinstance(template, PromptTemplate) else get_template(template_name, system_prompt, tokenizer)
    )
    return PreparedPairs(
        train_dataset, eval_dataset_, train_summary, eval_summary, template, records, generation_template
    )
