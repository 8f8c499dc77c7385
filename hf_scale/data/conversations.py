"""Multi-turn conversation records: read ShareGPT- or messages-format data, check every conversation before any
work starts, and bring it to the normal form `tokenizer.apply_chat_template` takes; and `chain_conversations`,
which groups single-turn Alpaca records into multi-turn conversations (test and benchmark data).

The normal form of a conversation is a list of turns `{"role": "system" | "user" | "assistant", "content": str}`:
an optional system turn first, then user and assistant turns alternating, the last one from the assistant.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from datasets import Dataset, Features, List, Value

from hf_scale.data.loading import OnBadRecord, RecordCheck, check_each_record, read_records
from hf_scale.errors import ConfigError, DataError

Conversation = list[dict[str, str]]
# A loaded set: a row a conversation, its turns in the normal form.
CONVERSATION_FEATURES = Features({"turns": List({"role": Value("string"), "content": Value("string")})})


@dataclass(frozen=True)
class ConversationFields:
    """Where a record holds its conversation and how it names the roles. `SHAREGPT` and `MESSAGES` below are the
    two usual layouts; `dataclasses.replace(SHAREGPT, column="dialogue")` describes a variant."""

    format: Literal["sharegpt", "messages"]  # the layout's name, used in messages about unknown roles
    column: str  # the record's field holding the list of turns
    role_key: str  # the turn's field naming who speaks
    content_key: str  # the turn's field holding the text
    system: str  # the name this format gives the system role
    user: str  # ... the user role
    assistant: str  # ... the assistant role

    def __post_init__(self) -> None:
        if len({self.system, self.user, self.assistant}) < 3:
            raise ConfigError(f"{self.format}: the system, user and assistant roles need three distinct names")

    @property
    def roles(self) -> dict[str, str]:
        """This format's role names, mapped to the normal form's."""
        return {self.system: "system", self.user: "user", self.assistant: "assistant"}


SHAREGPT = ConversationFields("sharegpt", "conversations", "from", "value", "system", "human", "gpt")
MESSAGES = ConversationFields("messages", "messages", "role", "content", "system", "user", "assistant")


def load_conversations(
    data: str | Dataset,
    key: str = "dataset",
    fields: ConversationFields = SHAREGPT,
    on_bad_record: OnBadRecord = "error",
) -> tuple[Dataset, RecordCheck]:
    """Conversations from a .json/.jsonl/.parquet file or folder, a hub dataset id or a `Dataset`, checked.

    Returns the valid conversations in the normal form (a `Dataset` whose `turns` column holds them), and the
    check's outcome. `key` is the config key that
    named the data, for error messages.

    Example:
        conversations, check = load_conversations("data/chats.jsonl", fields=MESSAGES, on_bad_record="skip")
        print(check)  # records read, kept, skipped (with the first indices and why)
    """
    records, source = read_records(data, key)
    return check_conversations(records, source, fields, on_bad_record)


def check_conversations(
    records: Iterable, source: str, fields: ConversationFields, on_bad_record: OnBadRecord = "error"
) -> tuple[Dataset, RecordCheck]:
    """Check every record; stop at the first bad one (`"error"`) or skip and count them (`"skip"`).

    Content is kept as written (a chat template decides about whitespace); roles are renamed to the normal form.
    """

    def normal(record: dict) -> dict[str, Conversation]:
        turns = record[fields.column]
        return {"turns": [{"role": fields.roles[t[fields.role_key]], "content": t[fields.content_key]} for t in turns]}

    return check_each_record(
        records, source, on_bad_record, lambda record: _problem(record, fields), normal, CONVERSATION_FEATURES
    )


def _problem(record: object, fields: ConversationFields) -> str | None:
    """What is wrong with one record, naming the field path (e.g. `conversations[2].value`); None when valid."""
    if not isinstance(record, dict):
        return f"not a JSON object, got {type(record).__name__}"
    turns = record.get(fields.column)
    if turns is None:  # a parquet or hub row without the column holds None
        return f"missing field {fields.column!r}"
    if not isinstance(turns, list):
        return f"field {fields.column!r} must be a list of turns, got {type(turns).__name__}"
    if not turns:
        return f"field {fields.column!r} is empty: no turns"
    expected = fields.user  # after the optional system turn: user, assistant, user, ...
    for index, turn in enumerate(turns):
        at = f"{fields.column}[{index}]"
        if not isinstance(turn, dict):
            return f"field {at!r} must be an object, got {type(turn).__name__}"
        role, content = turn.get(fields.role_key), turn.get(fields.content_key)
        # A turn of a parquet or hub row holds None for a key only other turns have: the same as missing.
        for name, value in ((fields.role_key, role), (fields.content_key, content)):
            if value is None:
                return f"missing field {f'{at}.{name}'!r}"
        role_at, content_at = f"{at}.{fields.role_key}", f"{at}.{fields.content_key}"
        if not isinstance(role, str) or role not in fields.roles:
            return f"field {role_at!r} is {role!r}, not a {fields.format} role ({', '.join(fields.roles)})"
        if not isinstance(content, str):
            return f"field {content_at!r} must be text, got {type(content).__name__}"
        if not content.strip():
            return f"field {content_at!r} is empty"
        if "\ufffd" in content:
            return f"field {content_at!r} holds undecodable bytes (U+FFFD): the file is not valid UTF-8"
        if role == fields.system:
            if index > 0:
                return f"field {role_at!r} is {role!r}: a system turn may only come first"
            continue
        if role != expected:
            return (
                f"field {role_at!r} is {role!r} where {expected!r} was expected: after the optional system turn, "
                f"turns alternate {fields.user!r}, {fields.assistant!r}, {fields.user!r}, ..."
            )
        expected = fields.assistant if role == fields.user else fields.user
    if all(turn[fields.role_key] != fields.assistant for turn in turns):  # e.g. a system turn alone
        return f"field {fields.column!r} holds no {fields.assistant!r} turn: nothing to learn from"
    if turns[-1][fields.role_key] == fields.user:
        last = f"{fields.column}[{len(turns) - 1}].{fields.role_key}"
        return f"field {last!r} is {fields.user!r} in the last turn: no {fields.assistant!r} turn answers it"
    return None


def chain_conversations(
    records: Dataset | list[dict[str, str]], turns: tuple[int, int] = (2, 4), seed: int = 0
) -> list[Conversation]:
    """Group Alpaca records (instruction/input/output, as `load_records` returns them) into conversations of
    `turns[0]` to `turns[1]` user/assistant pairs, one pair a record.

    Every record is used exactly once and in its order (the conversations, read one after another, give the records
    back); `seed` draws the conversation lengths. The user turn is the instruction, followed by the input after a
    blank line when there is one; the assistant turn is the output.
    """
    if isinstance(records, Dataset):
        records = records.to_list()
    low, high = turns
    if not 1 <= low <= high:
        raise ConfigError(f"turns must be (low, high) with 1 <= low <= high, got {turns}")
    if not _can_group(len(records), low, high):
        raise DataError(f"{len(records)} record(s) cannot be grouped into conversations of {low} to {high} turns")
    rng = random.Random(seed)
    conversations, start = [], 0
    while start < len(records):
        left = len(records) - start
        # Only lengths that leave a remainder which can still be grouped: no short conversation at the end.
        size = rng.choice([n for n in range(low, min(high, left) + 1) if _can_group(left - n, low, high)])
        conversations.append([turn for record in records[start : start + size] for turn in _pair(record)])
        start += size
    return conversations


def _can_group(count: int, low: int, high: int) -> bool:
    """Whether `count` records split into groups of `low` to `high`: the fewest groups, ceil(count / high), must
    not need more than `count` records at `low` each."""
    return count == 0 or -(-count // high) * low <= count


def _pair(record: dict[str, str]) -> Conversation:
    """One Alpaca record as a user turn and the assistant turn answering it."""
    question = record["instruction"] + (f"\n\n{record['input']}" if record.get("input", "").strip() else "")
    return [{"role": "user", "content": question}, {"role": "assistant", "content": record["output"]}]
