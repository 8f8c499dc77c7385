"""Several sources in one run: the `datasets` setting checked entry by entry, and the mix counted per source."""

import pytest
from datasets import Dataset

from hf_scale.data.mixture import DataSource, describe_draws, mix, parse_sources
from hf_scale.errors import ConfigError

DEFAULTS = {"data_format": "alpaca", "output_field": "output", "role_field": None}


@pytest.mark.parametrize(
    "entries, message",
    [
        ("[{path: a.json}]", r"datasets: not a JSON list of sources"),
        ("[]", r"datasets: must be a non-empty list"),
        (["a.json"], r"datasets\[0\]: must be a mapping"),
        ([{"path": "a.json"}, {"path": "b.json", "wieght": 2}], r"datasets\[1\]: unknown key 'wieght' \(did you mean"),
        ([{"weight": 2}], r"datasets\[0\]: needs a path"),
        ([{"path": "a.json", "weight": 0}], r"datasets\[0\]: weight must be a positive number, got 0"),
        ([{"path": "a.json", "weight": True}], r"datasets\[0\]: weight must be a positive number"),
        ([{"path": "a.json", "data_format": "chatml"}], r"datasets\[0\]: data_format must be one of alpaca, sharegpt"),
        ([{"path": "a.json", "role_field": 3}], r"datasets\[0\]: role_field must be text, got 3"),
    ],
)
def test_every_mistake_names_the_entry_and_key(entries, message):
    with pytest.raises(ConfigError, match=message):
        parse_sources(entries, DEFAULTS)


def test_keys_left_out_take_the_runs_values():
    text = '[{"path": "a.json", "output_field": "answer"}, {"path": "b.jsonl", "data_format": "sharegpt", "weight": 3}]'
    first, second = parse_sources(text, DEFAULTS)
    assert first == DataSource("a.json", output_field="answer")
    assert second == DataSource("b.jsonl", data_format="sharegpt", weight=3)
    assert second.is_conversations and second.conversation_fields.column == "conversations"
    assert (
        parse_sources([{"path": "c.json", "role_field": "speaker"}], {**DEFAULTS, "data_format": "messages"})[
            0
        ].conversation_fields.role_key
        == "speaker"
    )


def numbered(source: int, count: int) -> Dataset:
    return Dataset.from_dict({"input_ids": [[source, i] for i in range(count)]})


def test_concatenate_takes_every_example_once():
    mixed, drawn = mix([numbered(0, 30), numbered(1, 10)], [1.0, 5.0], "concatenate", seed=0)
    assert drawn == [30, 10] and len(mixed) == 40
    assert sorted(map(tuple, mixed["input_ids"])) == [(s, i) for s, n in ((0, 30), (1, 10)) for i in range(n)]
    assert mixed.column_names == ["input_ids"]  # the source tag is not left for the collator


def test_interleave_draws_by_weight_until_the_first_source_is_used_up():
    mixed, drawn = mix([numbered(0, 1000), numbered(1, 1000)], [3.0, 1.0], "interleave", seed=0)
    assert 1000 in drawn and sum(drawn) == len(mixed)
    assert drawn[0] / drawn[1] == pytest.approx(3.0, rel=0.15)  # the weights are the ratio of what is drawn
    assert len(set(map(tuple, mixed["input_ids"]))) == len(mixed)  # nothing drawn twice
    again, _ = mix([numbered(0, 1000), numbered(1, 1000)], [3.0, 1.0], "interleave", seed=0)
    assert again["input_ids"] == mixed["input_ids"]  # a fixed seed: the same mix on every process and relaunch


def test_interleave_all_draws_the_smaller_source_again_and_says_so():
    mixed, drawn = mix([numbered(0, 100), numbered(1, 10)], [1.0, 1.0], "interleave_all", seed=1)
    assert drawn[0] == 100 and drawn[1] > 10
    line = describe_draws(["big.json", "small.json"], [100, 10], drawn, "interleave_all", seed=1)
    assert line == (
        f"mixture (interleave_all, seed 1): {sum(drawn)} train examples; big.json: 100 of 100 examples (0 drawn "
        f"again); small.json: {drawn[1]} of 10 examples ({drawn[1] - 10} drawn again)"
    )
    assert "(5 not drawn)" in describe_draws(["a"], [10], [5], "interleave", seed=0)


def test_one_source_is_not_mixed():
    dataset = numbered(0, 7)
    assert mix([dataset], [2.0], "interleave", seed=0) == (dataset, [7])
