import dataclasses
import json
import re

import pytest
from datasets import Dataset

from hf_scale.data.conversations import (
    MESSAGES,
    SHAREGPT,
    ConversationFields,
    chain_conversations,
    check_conversations,
    load_conversations,
)
from hf_scale.data.loading import load_records
from hf_scale.errors import ConfigError, DataError
from tests.helpers import SHARED_DATA

NORMAL = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": " hi\n"},  # kept as written: no stripping
    ],
    [
        {"role": "user", "content": "Echo x."},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "And y?"},
        {"role": "assistant", "content": "y"},
    ],
]
NAMES = {"system": "system", "user": "human", "assistant": "gpt"}  # normal role -> ShareGPT's name


def turns_of(dataset):
    """The conversations a loaded set holds, as lists of turns."""
    return [row["turns"] for row in dataset]


def sharegpt(conversation):
    return {
        "id": "extra fields are ignored",
        "conversations": [{"from": NAMES[t["role"]], "value": t["content"]} for t in conversation],
    }


def messages(conversation):
    return {"messages": conversation}


def turns(*pairs):
    """A ShareGPT record from (from, value) pairs."""
    return {"conversations": [{"from": role, "value": value} for role, value in pairs]}


BAD = [
    (["not an object"], "not a JSON object, got list"),
    ({"messages": []}, "missing field 'conversations'"),
    ({"conversations": None}, "missing field 'conversations'"),
    ({"conversations": "human: hi"}, "field 'conversations' must be a list of turns, got str"),
    ({"conversations": []}, "field 'conversations' is empty: no turns"),
    (
        {"conversations": [{"from": "human", "value": "a"}, "gpt: b"]},
        "field 'conversations[1]' must be an object, got str",
    ),
    ({"conversations": [{"from": "human", "value": "a"}, {"value": "b"}]}, "missing field 'conversations[1].from'"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt"}]}, "missing field 'conversations[1].value'"),
    (
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": None}]},
        "missing field 'conversations[1].value'",
    ),
    (
        turns(("human", "a"), ("bot", "b")),
        "field 'conversations[1].from' is 'bot', not a sharegpt role (system, human, gpt)",
    ),
    (turns(("human", "a"), (["gpt"], "b")), "field 'conversations[1].from' is ['gpt'], not a sharegpt role"),
    (turns(("human", "a"), ("gpt", 3)), "field 'conversations[1].value' must be text, got int"),
    (turns(("human", "a"), ("gpt", ["b"])), "field 'conversations[1].value' must be text, got list"),
    (turns(("human", "a"), ("gpt", "")), "field 'conversations[1].value' is empty"),
    (turns(("human", " \n\t"), ("gpt", "b")), "field 'conversations[0].value' is empty"),
    (
        turns(("human", "a"), ("gpt", "caf\ufffd")),
        "field 'conversations[1].value' holds undecodable bytes (U+FFFD): the file is not valid UTF-8",
    ),
    (
        turns(("human", "a"), ("system", "s"), ("gpt", "b")),
        "field 'conversations[1].from' is 'system': a system turn may only come first",
    ),
    (
        turns(("gpt", "a"), ("human", "b")),
        "field 'conversations[0].from' is 'gpt' where 'human' was expected: after the optional system turn, "
        "turns alternate 'human', 'gpt', 'human', ...",
    ),
    (
        turns(("system", "s"), ("human", "a"), ("human", "b"), ("gpt", "c")),
        "field 'conversations[2].from' is 'human' where 'gpt' was expected",
    ),
    (
        turns(("human", "a"), ("gpt", "b"), ("gpt", "c")),
        "field 'conversations[2].from' is 'gpt' where 'human' was expected",
    ),
    (turns(("system", "s")), "field 'conversations' holds no 'gpt' turn: nothing to learn from"),
    (turns(("human", "a")), "field 'conversations' holds no 'gpt' turn: nothing to learn from"),
    (
        turns(("human", "a"), ("gpt", "b"), ("human", "c")),
        "field 'conversations[2].from' is 'human' in the last turn: no 'gpt' turn answers it",
    ),
]


@pytest.mark.parametrize("record, message", BAD, ids=[message for _, message in BAD])
def test_bad_records_are_named_with_index_and_field_path(record, message):
    with pytest.raises(DataError) as raised:
        check_conversations([sharegpt(NORMAL[0]), record], "chats.jsonl", SHAREGPT)
    assert str(raised.value).startswith(f"chats.jsonl: record 1: {message}")
    assert str(raised.value).endswith("(on_bad_record='skip' skips and counts such records)")


def test_messages_format_names_its_own_fields():
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "gpt", "content": "b"}]}
    with pytest.raises(
        DataError,
        match=re.escape("record 0: field 'messages[1].role' is 'gpt', not a messages role (system, user, assistant)"),
    ):
        check_conversations([record], "mem", MESSAGES)


def test_skip_counts_and_reports_the_first_indices():
    records = [sharegpt(NORMAL[0])] + [record for record, _ in BAD] + [sharegpt(NORMAL[1])]
    loaded, check = check_conversations(records, "chats.jsonl", SHAREGPT, on_bad_record="skip")
    assert turns_of(loaded) == NORMAL
    assert [index for index, _ in check.skipped] == list(range(1, len(BAD) + 1))
    assert [problem for _, problem in check.skipped][:2] == [BAD[0][1], BAD[1][1]]
    assert str(check).startswith(f"chats.jsonl: skipped {len(BAD)} of {len(records)} invalid records (first: record 1:")


def test_nothing_valid_left_and_bad_policy_are_errors():
    with pytest.raises(DataError, match="chats.jsonl: skipped 1 of 1 invalid records .*: no valid record left"):
        check_conversations([BAD[0][0]], "chats.jsonl", SHAREGPT, on_bad_record="skip")
    with pytest.raises(DataError, match="chats.jsonl: no records"):
        check_conversations([], "chats.jsonl", SHAREGPT)
    with pytest.raises(ConfigError, match="on_bad_record must be 'error' or 'skip'"):
        check_conversations([sharegpt(NORMAL[0])], "chats.jsonl", SHAREGPT, on_bad_record="warn")


def test_fields_can_be_varied_but_roles_must_differ():
    fields = dataclasses.replace(SHAREGPT, column="dialogue", user="user")
    record = {"dialogue": [{"from": "user", "value": "a"}, {"from": "gpt", "value": "b"}]}
    assert turns_of(check_conversations([record], "mem", fields)[0]) == [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ]
    with pytest.raises(ConfigError, match="three distinct names"):
        dataclasses.replace(MESSAGES, assistant="user")


@pytest.mark.parametrize(
    "fields, to_record", [(SHAREGPT, sharegpt), (MESSAGES, messages)], ids=["sharegpt", "messages"]
)
def test_files_of_every_kind_folders_and_datasets(tmp_path, fields, to_record):
    records = [to_record(conversation) for conversation in NORMAL]
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    # Parquet rows come back with a None for every key only other turns have: a `weight` on one turn here.
    weighted = json.loads(json.dumps(records))
    weighted[1][fields.column][1]["weight"] = 1.0
    Dataset.from_list(weighted).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.json", "a.jsonl", "a.parquet"):
        loaded, check = load_conversations(str(tmp_path / name), fields=fields)
        assert turns_of(loaded) == NORMAL and not check.skipped, name
        assert check.source == str(tmp_path / name)
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, record in enumerate(records):
        (folder / f"part{i}.jsonl").write_text(json.dumps(record))
    assert turns_of(load_conversations(str(folder), fields=fields)[0]) == NORMAL
    loaded, check = load_conversations(Dataset.from_list(records), fields=fields)
    assert turns_of(loaded) == NORMAL and check.source == "the given Dataset"


def test_a_bad_record_in_a_file_is_named_with_the_file(tmp_path):
    path = tmp_path / "bad.parquet"
    Dataset.from_list([sharegpt(NORMAL[1]), turns(("human", "a"), ("human", "b"))]).to_parquet(str(path))
    with pytest.raises(DataError, match=r"bad.parquet: record 1: field 'conversations\[1\].from' is 'human'"):
        load_conversations(str(path))
    loaded, check = load_conversations(str(path), on_bad_record="skip")
    assert turns_of(loaded) == [NORMAL[1]] and [index for index, _ in check.skipped] == [1]


def test_a_missing_file_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"eval_dataset: data file not found: .*nope.jsonl"):
        load_conversations(str(tmp_path / "nope.jsonl"), key="eval_dataset")


def test_fields_are_frozen_and_map_roles_to_the_normal_form():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SHAREGPT.column = "x"
    assert isinstance(SHAREGPT, ConversationFields) and SHAREGPT.roles == {
        "system": "system",
        "human": "user",
        "gpt": "assistant",
    }


ALPACA = [{"instruction": f"q{i}", "input": "ctx" if i % 3 == 0 else "", "output": f"a{i}"} for i in range(11)]


def test_chain_groups_records_in_order_into_pairs():
    chained = chain_conversations(ALPACA, seed=1)
    assert all(2 <= len(c) // 2 <= 4 and len(c) % 2 == 0 for c in chained)
    pairs = [(c[i]["content"], c[i + 1]["content"]) for c in chained for i in range(0, len(c), 2)]
    assert pairs == [(r["instruction"] + ("\n\nctx" if r["input"] else ""), r["output"]) for r in ALPACA]
    assert chain_conversations(ALPACA, seed=1) == chained
    assert turns_of(check_conversations([{"messages": c} for c in chained], "chained", MESSAGES)[0]) == chained


def test_chain_never_leaves_a_short_conversation():
    for count in [3, 4, *range(6, 40)]:  # 1, 2 and 5 records cannot make conversations of 3 to 4 pairs
        for seed in range(5):
            chained = chain_conversations(ALPACA[:1] * count, turns=(3, 4), seed=seed)
            assert all(3 <= len(c) // 2 <= 4 for c in chained) and sum(len(c) for c in chained) == 2 * count
    with pytest.raises(DataError, match="5 record\\(s\\) cannot be grouped into conversations of 3 to 4 turns"):
        chain_conversations(ALPACA[:5], turns=(3, 4))
    with pytest.raises(ConfigError, match="turns must be"):
        chain_conversations(ALPACA, turns=(3, 2))


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize("name", ["alpaca_en_demo.json", "alpaca_zh_demo.json"])
def test_real_alpaca_sets_chain_into_valid_conversations(name):
    records, _ = load_records(str(SHARED_DATA / name))
    chained = chain_conversations(records)
    assert all(2 <= len(c) // 2 <= 4 for c in chained)
    assert [turn["content"] for c in chained for turn in c[1::2]] == [r["output"] for r in records]  # each once
    assert chain_conversations(records) == chained and chain_conversations(records, seed=1) != chained
    loaded, check = check_conversations([{"messages": c} for c in chained], name, MESSAGES)
    assert turns_of(loaded) == chained and not check.skipped
