"""Tokenize conversations into examples whose labels are exactly the assistant's turns.

A conversation (turns `{"role": "system"|"user"|"assistant", "content": ...}`) is rendered to one text with a chat
template, as the model will read it, and tokenized once. Where each assistant turn lies in that text comes from
rendering the conversation's prefixes: the prompt of turn k is the turns before it rendered with the generation
prompt (what generation is given at that point), and the turn runs from there through the special token that
closes it (LLaMA-2's `</s>`, ChatML's `<|im_end|>`). Each token is labelled by where its characters lie, as
`tokenize.py` does for one turn: the mask follows whatever the tokenizer merged, and no `{% generation %}` tags
are needed in the template. A template whose rendering of a conversation does not start with the rendering of
its beginning (one that rewrites earlier turns) cannot be labelled this way and is refused.

Over-long conversations lose their oldest user/assistant pairs first (the system turn stays); when even the last
pair does not fit, the truncation policy decides (cut the end of its answer, or drop the conversation). Everything
is counted in `ConversationSummary`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from hf_scale.data.templates import ALPACA, ALPACA_ZH, PromptTemplate, through_end_of_turn
from hf_scale.data.tokenize import IGNORE_INDEX, Truncation, percentile_99
from hf_scale.errors import ConfigError, DataError

Turn = dict[str, str]
AssistantTurns = Literal["all", "last"]

# The chat_template of meta-llama/Llama-2-7b-chat-hf, verbatim: Meta's format (llama/generation.py), BOS before
# every [INST] and " " + EOS after every answer, the system prompt inside the first [INST].
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def alpaca_chat_template(template: PromptTemplate) -> str:
    """An Alpaca template (without input) extended to several turns, as a Jinja chat template.

    One turn renders exactly as the single-turn template with BOS and EOS: `<s>{preamble}### Instruction:\n{user}
    \n\n### Response:\n{assistant}</s>`. Each further turn follows the previous answer's EOS with `\n\n### Instruction:
    \n...`. A system turn replaces the preamble.
    """
    before, response_header = template.without_input.split("{instruction}")
    preamble_end = before.rindex("### ")
    preamble, instruction_header = before[:preamble_end], before[preamble_end:]

    def literal(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)  # a Jinja string literal

    return (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}"
        f"{{% set loop_messages = messages[1:] %}}{{% else %}}{{{{ {literal(preamble)} }}}}"
        "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
        f"{{{{ {literal(instruction_header)} + message['content'] }}}}"
        f"{{% else %}}{{{{ {literal(response_header)} + message['content'] + eos_token }}}}{{% endif %}}{{% endfor %}}"
        f"{{% if add_generation_prompt %}}{{{{ {literal(response_header)} }}}}{{% endif %}}"
    )


# By the names of `DataArguments.template`; None: the tokenizer's own.
CONVERSATION_TEMPLATES = {
    "alpaca": alpaca_chat_template(ALPACA),
    "alpaca_zh": alpaca_chat_template(ALPACA_ZH),
    "llama2_chat": LLAMA2_CHAT_TEMPLATE,
    "chat_template": None,
}


@dataclass
class ConversationSummary:
    """What happened to the conversations on their way to examples; nothing is dropped without being counted."""

    conversations: int
    examples: int = 0
    shortened: int = 0  # kept without their oldest user/assistant pairs
    pairs_removed: int = 0  # those pairs, all conversations together
    answer_cut: int = 0  # kept, the end of the last answer cut at max_length (truncation="keep_prompt")
    dropped_too_long: int = 0  # even the last pair does not fit (truncation="drop", or no answer token left)
    boundary_merges: int = 0  # a token spans the start of an assistant turn; it is trained on
    length_for_99_percent: int = 0  # tokens that 99 % of the conversations fit in whole, measured before any cut
    tokens: int = 0
    label_tokens: int = 0
    dropped_indices: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        first = f" (first positions in this set: {self.dropped_indices[:5]})" if self.dropped_indices else ""
        return (
            f"{self.conversations} conversations -> {self.examples} examples, {self.tokens} tokens of which "
            f"{self.label_tokens} trained on; {self.shortened} shortened by {self.pairs_removed} oldest "
            f"user/assistant pairs and {self.answer_cut} with the last answer cut at max_length; "
            f"{self.dropped_too_long} dropped{first}; {self.boundary_merges} tokens span an assistant turn's start"
        )


def chat_template_for(name: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja chat template called `name`: alpaca, alpaca_zh, llama2_chat, or chat_template (the tokenizer's)."""
    if name not in CONVERSATION_TEMPLATES:
        known = ", ".join(CONVERSATION_TEMPLATES)
        raise ConfigError(f"template: {name!r} cannot render conversations; use one of {known}")
    template = CONVERSATION_TEMPLATES[name] or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("template: chat_template needs a tokenizer that has a chat template")
    return template


def render(tokenizer: PreTrainedTokenizerBase, template: str, turns: list[Turn], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        turns, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, template: str, turns: list[Turn]
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and, for each assistant turn, the characters `[start, end)` to train on.

    A span starts where the turn's generation prompt ends and runs through the first special token after the
    turn's content (its end of turn); what follows that token (ChatML's newline) belongs to no turn."""
    text = render(tokenizer, template, turns, generation_prompt=False)
    spans = []
    for index, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        prompt = render(tokenizer, template, turns[:index], generation_prompt=True)
        answered = render(tokenizer, template, turns[: index + 1], generation_prompt=False)
        if not (answered.startswith(prompt) and text.startswith(answered)):
            raise ConfigError(
                "template: rendering a conversation does not extend the rendering of its beginning (the template "
                f"rewrites earlier turns, at turn {index}), so the prompt trained on would differ from the prompt "
                "generated from; use a template that renders turns in order"
            )
        tail = answered[len(prompt) :]
        content = turn["content"].strip()  # templates may strip it (LLaMA-2's does)
        after_content = tail.find(content) + len(content) if content in tail else 0
        through, end_of_turn = through_end_of_turn(tokenizer, tail[after_content:])
        if not end_of_turn:
            raise ConfigError(
                f"template: the assistant's turn {index} ends with no special token (such as EOS): a model trained "
                "on it could never learn where its turn ends"
            )
        spans.append((len(prompt), len(prompt) + after_content + len(through)))
    return text, spans


def tokenize_conversations(
    conversations: list[list[Turn]],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    max_length: int,
    assistant_turns: AssistantTurns = "all",
    train_on_inputs: bool = False,
    truncation: Truncation = "keep_prompt",
) -> tuple[Dataset, ConversationSummary]:
    """Turn conversations into a `Dataset` of `input_ids`, `attention_mask` and `labels`.

    `template` is a Jinja chat template (`chat_template_for`); `assistant_turns` trains on every assistant turn
    ("all") or the last one only; `train_on_inputs` trains on every token but the first. An over-long conversation
    loses its oldest user/assistant pairs; when the last pair alone is too long, "keep_prompt" cuts the end of its
    answer and "drop" (or "cut_prompt_left", which a conversation has no use for) drops it.

    Example:
        conversations, _ = load_conversations("chats.jsonl", fields=SHAREGPT)
        template = chat_template_for("llama2_chat", tokenizer)
        dataset, summary = tokenize_conversations(conversations, tokenizer, template, max_length=2048)
        print(summary)
    """
    if assistant_turns not in ("all", "last"):
        raise ConfigError(f"assistant_turns must be 'all' or 'last', got {assistant_turns!r}")
    summary = ConversationSummary(conversations=len(conversations))
    examples: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    whole_lengths = []
    for index, turns in enumerate(conversations):
        system, dialog = (turns[:1], turns[1:]) if turns[0]["role"] == "system" else ([], turns)
        for first_pair in range(0, len(dialog), 2):  # drop the oldest pairs until the rest fits
            ids, labels, merges = _label(tokenizer, template, system + dialog[first_pair:], assistant_turns)
            if first_pair == 0:
                whole_lengths.append(len(ids))
            if len(ids) <= max_length:
                break
        if first_pair:
            summary.shortened += 1
            summary.pairs_removed += first_pair // 2
        if len(ids) > max_length:
            if truncation != "keep_prompt" or all(label == IGNORE_INDEX for label in labels[:max_length]):
                summary.dropped_too_long += 1
                summary.dropped_indices.append(index)
                continue
            ids, labels = ids[:max_length], labels[:max_length]  # the answer did not end here: no end of turn
            summary.answer_cut += 1
        if train_on_inputs:
            labels = [IGNORE_INDEX, *ids[1:]]
        summary.boundary_merges += merges
        examples["input_ids"].append(ids)
        examples["attention_mask"].append([1] * len(ids))
        examples["labels"].append(labels)
    if conversations and not examples["input_ids"]:
        raise DataError(
            f"max_length={max_length} leaves no example: all {len(conversations)} conversations dropped as too long"
        )
    summary.examples = len(examples["input_ids"])
    summary.tokens = sum(map(len, examples["input_ids"]))
    summary.label_tokens = sum(len(labels) - labels.count(IGNORE_INDEX) for labels in examples["labels"])
    summary.length_for_99_percent = percentile_99(whole_lengths)
    return Dataset.from_dict(examples), summary


def _label(
    tokenizer: PreTrainedTokenizerBase, template: str, turns: list[Turn], assistant_turns: AssistantTurns
) -> tuple[list[int], list[int], int]:
    """(input ids, labels, tokens that span a turn's start) of one rendered conversation."""
    text, spans = assistant_spans(tokenizer, template, turns)
    if assistant_turns == "last":
        spans = spans[-1:]
    # Through the tokenizer's __call__: the template wrote BOS (and any other special token) into the text itself.
    encoding = tokenizer(text, add_special_tokens=False).encodings[0]
    labels, merges = [], 0
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
        trained = any(end > span_start and start < span_end for span_start, span_end in spans)
        merges += any(start < span_start < end for span_start, _ in spans)
        labels.append(token_id if trained else IGNORE_INDEX)
    return encoding.ids, labels, merges
