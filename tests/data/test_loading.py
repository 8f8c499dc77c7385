import json

import pytest

from hf_scale.data.loading import load_records, split_records
from hf_scale.data.templates import get_template
from hf_scale.errors import ConfigError, DataError
from tests.helpers import SHARED_DATA


def test_json_and_jsonl_files(tmp_path):
    records = [
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Echo.", "input": "x", "output": "x"},
    ]
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert load_records(str(tmp_path / "a.json")) == records
    assert load_records(str(tmp_path / "a.jsonl")) == records


def test_missing_file_names_the_key_and_path(tmp_path):
    with pytest.raises(ConfigError, match=r"eval_dataset: data file not found: .*nope.json"):
        load_records(str(tmp_path / "nope.json"), key="eval_dataset")


@pytest.mark.parametrize(
    "record, message",
    [
        ({"input": "", "output": "x"}, r"record 1: missing field 'instruction'"),
        ({"instruction": "a", "input": 3, "output": "x"}, r"record 1: field 'input' must be text, got int"),
        ({"instruction": "a", "input": "", "output": "  "}, r"record 1: field 'output' is empty"),
    ],
)
def test_bad_records_are_named(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message):
        load_records(str(path))


def test_split_is_disjoint_and_seeded():
    records = [{"instruction": str(i), "input": "", "output": "x"} for i in range(100)]
    train, held_out = split_records(records, 0.1, seed=0)
    assert len(held_out) == 10 and len(train) == 90
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held_out}
    assert split_records(records, 0.1, seed=0) == (train, held_out)


def test_unknown_template_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown template 'vicuna'; known templates: alpaca"):
        get_template("vicuna")


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize("name, count", [("alpaca_en_demo.json", 999), ("alpaca_zh_demo.json", 1000)])
def test_real_alpaca_sets_load_whole(name, count):
    records = load_records(str(SHARED_DATA / name))
    assert len(records) == count
