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
from functools import partial
from typing import Literal

import numpy as np
import pyarrow as pa
from datasets import Dataset, Features, Value
from transformers import PreTrainedTokenizerBase

from hf_scale.data.templates import ALPACA, ALPACA_ZH, PromptTemplate, through_end_of_turn
from hf_scale.data.tokenize import (
    EXAMPLE_FEATURES,
    IGNORE_INDEX,
    Truncation,
    arrow_rows,
    check_not_columns,
    column,
    encode_texts,
    examples_kept,
    map_in_batches,
    percentile_99,
)
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


def render_all(
    tokenizer: PreTrainedTokenizerBase, template: str, conversations: list[list[Turn]], generation_prompt: bool
) -> list[str]:
    """`render` of many conversations in one call: the template's per-call cost is paid once."""
    if not conversations:
        return []
    # A conversation without turns (the generation prompt of a first answer with no system turn) renders alone:
    # apply_chat_template takes a batch for a conversation only when its first element is a list of turns.
    texts = [None if turns else render(tokenizer, template, [], generation_prompt) for turns in conversations]
    non_empty = [turns for turns in conversations if turns]
    if non_empty:
        rendered = iter(
            tokenizer.apply_chat_template(
                non_empty, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
            )
        )
        texts = [text if text is not None else next(rendered) for text in texts]
    return texts


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, template: str, turns: list[Turn]
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and, for each assistant turn, the characters `[start, end)` to train on.

    A span starts where the turn's generation prompt ends and runs through the first special token after the
    turn's content (its end of turn); what follows that token (ChatML's newline) belongs to no turn."""
    text = render(tokenizer, template, turns, generation_prompt=False)
    return text, spans_in_all(tokenizer, template, [turns], [text])[0]


def spans_in_all(
    tokenizer: PreTrainedTokenizerBase, template: str, conversations: list[list[Turn]], texts: list[str]
) -> list[list[tuple[int, int]]]:
    """`assistant_spans` of many conversations, whose `texts` are rendered already: every prompt of an assistant
    turn (the conversation before it, with the generation prompt) and every conversation through that turn are
    rendered in two calls, and the turn's span read between them."""
    turns_at = [
        (c, index) for c, turns in enumerate(conversations) for index, t in enumerate(turns) if t["role"] == "assistant"
    ]
    prompts = render_all(tokenizer, template, [conversations[c][:index] for c, index in turns_at], True)
    answered = render_all(tokenizer, template, [conversations[c][: index + 1] for c, index in turns_at], False)
    spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
    for (c, index), prompt, through_turn in zip(turns_at, prompts, answered, strict=True):
        if not (through_turn.startswith(prompt) and texts[c].startswith(through_turn)):
            raise ConfigError(
                "template: rendering a conversation does not extend the rendering of its beginning (the template "
                f"rewrites earlier turns, at turn {index}), so the prompt trained on would differ from the prompt "
                "generated from; use a template that renders turns in order"
            )
        tail = through_turn[len(prompt) :]
        content = conversations[c][index]["content"].strip()  # templates may strip it (LLaMA-2's does)
        after_content = tail.find(content) + len(content) if content in tail else 0
        through, end_of_turn = through_end_of_turn(tokenizer, tail[after_content:])
        if not end_of_turn:
            raise ConfigError(
                f"template: the assistant's turn {index} ends with no special token (such as EOS): a model trained "
                "on it could never learn where its turn ends"
            )
        spans[c].append((len(prompt), len(prompt) + after_content + len(through)))
    return spans


def tokenize_conversations(
    conversations: Dataset | list[list[Turn]],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    max_length: int,
    assistant_turns: AssistantTurns = "all",
    train_on_inputs: bool = False,
    truncation: Truncation = "keep_prompt",
    system_prompt: str | None = None,
    num_proc: int | None = None,
    cache_file_name: str | None = None,
) -> tuple[Dataset, ConversationSummary]:
    """Turn conversations into a `Dataset` of `input_ids`, `attention_mask` and `labels`.

    `conversations` are lists of turns, or a `Dataset` whose `turns` column holds them. `template` is a Jinja chat
    template (`chat_template_for`); `assistant_turns` trains on every assistant turn ("all") or the last one only
    ("last"); `train_on_inputs` trains on every token but the first; `system_prompt` is put first in every
    conversation that brings no system turn of its own. An over-long conversation loses its oldest user/assistant
    pairs; when the last pair alone is too long, "keep_prompt" cuts the end of its answer and "drop" (or
    "cut_prompt_left", which a conversation has no use for) drops it. Batches of conversations are rendered and
    tokenized together by `Dataset.map`, in `num_proc` processes, written to `cache_file_name` as
    `tokenize_records` does.

    Example:
        conversations, _ = load_conversations("chats.jsonl", fields=SHAREGPT)
        template = chat_template_for("llama2_chat", tokenizer)
        dataset, summary = tokenize_conversations(conversations, tokenizer, template, max_length=2048)
        print(summary)
    """
    if assistant_turns not in ("all", "last"):
        raise ConfigError(f"assistant_turns must be 'all' or 'last', got {assistant_turns!r}")
    if not isinstance(conversations, Dataset):
        check_not_columns(conversations)
        conversations = Dataset.from_dict({"turns": conversations})
    tokenize = partial(
        _tokenize_batch,
        tokenizer=tokenizer,
        template=template,
        max_length=max_length,
        assistant_turns=assistant_turns,
        train_on_inputs=train_on_inputs,
        truncation=truncation,
        system_prompt=system_prompt,
    )
    rows = map_in_batches(conversations, tokenize, CONVERSATION_ROW_FEATURES, num_proc, cache_file_name, "tokenizing")
    outcomes, pairs_removed = column(rows, "outcome"), column(rows, "pairs_removed")
    summary = ConversationSummary(
        conversations=len(rows),
        shortened=int(np.count_nonzero(pairs_removed)),
        pairs_removed=int(pairs_removed.sum()),
        answer_cut=int(np.count_nonzero(outcomes == "answer_cut")),
        dropped_too_long=int(np.count_nonzero(outcomes == "dropped_too_long")),
        boundary_merges=int(column(rows, "boundary_merges").sum()),
        length_for_99_percent=percentile_99(column(rows, "whole_length")),
        tokens=int(column(rows, "tokens").sum()),
        label_tokens=int(column(rows, "label_tokens").sum()),
    )
    if len(rows) and summary.dropped_too_long == len(rows):
        raise DataError(f"max_length={max_length} leaves no example: all {len(rows)} conversations dropped as too long")
    dataset, summary.dropped_indices = examples_kept(rows, outcomes != "dropped_too_long")
    summary.examples = len(dataset)
    return dataset, summary


# One row a conversation: the example (empty lists when dropped), and what the summary counts.
CONVERSATION_ROW_FEATURES = Features(
    {
        **EXAMPLE_FEATURES,
        "outcome": Value("string"),  # whole (perhaps shortened), answer_cut or dropped_too_long
        "pairs_removed": Value("int32"),  # oldest user/assistant pairs removed to fit
        "boundary_merges": Value("int32"),
        "whole_length": Value("int32"),  # tokens before any cut
        "tokens": Value("int32"),
        "label_tokens": Value("int32"),
    }
)


def _tokenize_batch(
    columns: dict[str, list],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    max_length: int,
    assistant_turns: AssistantTurns,
    train_on_inputs: bool,
    truncation: Truncation,
    system_prompt: str | None,
) -> pa.Table:
    """Conversations (the `turns` column) to one row each.

    Each conversation is rendered and tokenized whole; only those too long are rendered again, without their oldest
    pair, until they fit or one pair is left. Then every assistant turn of the conversations as they stand is
    located and labelled (`spans_in_all`)."""
    systems, dialogs = [], []  # each conversation's system turn (or none) and its user/assistant turns
    for turns in columns["turns"]:
        turns = [{"role": turn["role"], "content": turn["content"]} for turn in turns]
        has_system = turns[0]["role"] == "system"
        systems.append(
            turns[:1] if has_system else [{"role": "system", "content": system_prompt}] * bool(system_prompt)
        )
        dialogs.append(turns[1:] if has_system else turns)
    first_pairs = [0] * len(dialogs)

    def current(c: int) -> list[Turn]:
        return systems[c] + dialogs[c][first_pairs[c] :]

    texts = render_all(tokenizer, template, [current(c) for c in range(len(dialogs))], False)
    encodings = encode_texts(tokenizer, texts) if texts else []
    whole_lengths = [len(encoding.ids) for encoding in encodings]
    too_long = list(range(len(dialogs)))
    while too_long := [
        c for c in too_long if len(encodings[c].ids) > max_length and first_pairs[c] + 2 < len(dialogs[c])
    ]:
        for c in too_long:
            first_pairs[c] += 2  # the oldest user/assistant pair goes
        shortened = render_all(tokenizer, template, [current(c) for c in too_long], False)
        for c, text, encoding in zip(too_long, shortened, encode_texts(tokenizer, shortened), strict=True):
            texts[c], encodings[c] = text, encoding
    final = [current(c) for c in range(len(dialogs))]
    spans = spans_in_all(tokenizer, template, final, texts)
    rows: dict[str, list] = {name: [] for name in CONVERSATION_ROW_FEATURES if name != "attention_mask"}
    for encoding, turn_spans, first_pair, whole_length in zip(
        encodings, spans, first_pairs, whole_lengths, strict=True
    ):
        ids, labels, merges = _labels(encoding, turn_spans[-1:] if assistant_turns == "last" else turn_spans)
        outcome = "whole"
        if len(ids) > max_length:
            if truncation != "keep_prompt" or all(label == IGNORE_INDEX for label in labels[:max_length]):
                outcome, ids, labels, merges = "dropped_too_long", [], [], 0
            else:
                outcome = "answer_cut"
                ids, labels = ids[:max_length], labels[:max_length]  # the answer did not end here: no end of turn
        if train_on_inputs and ids:
            labels = [IGNORE_INDEX, *ids[1:]]
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["outcome"].append(outcome)
        rows["pairs_removed"].append(first_pair // 2)
        rows["boundary_merges"].append(merges)
        rows["whole_length"].append(whole_length)
        rows["tokens"].append(len(ids))
        rows["label_tokens"].append(len(labels) - labels.count(IGNORE_INDEX))
    return arrow_rows(rows, CONVERSATION_ROW_FEATURES)


def _labels(encoding, spans: list[tuple[int, int]]) -> tuple[list[int], list[int], int]:
    """(input ids, labels, tokens that span a turn's start) of one tokenized conversation: a token is trained on
    when its characters overlap an assistant span."""
    labels, merges = [], 0
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
        trained = any(end > span_start and start < span_end for span_start, span_end in spans)
        merges += any(start < span_start < end for span_start, _ in spans)
        labels.append(token_id if trained else IGNORE_INDEX)
    return encoding.ids, labels, merges
