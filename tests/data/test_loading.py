import json

import pytest
from datasets import Dataset

from hf_scale.data.loading import FieldNames, check_records, load_records, split_records
from hf_scale.errors import ConfigError, DataError
from tests.helpers import SHARED_DATA

GOOD = [{"instruction": "Say hi.", "input": "", "output": "hi"}, {"instruction": "Echo.", "input": "x", "output": "x"}]


def test_files_of_every_kind_and_folders(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in GOOD))
    Dataset.from_list(GOOD).to_csv(str(tmp_path / "a.csv"), index=False)
    Dataset.from_list(GOOD).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.json", "a.jsonl", "a.csv", "a.parquet"):
        records, check = load_records(str(tmp_path / name))
        assert records == GOOD and not check.skipped, name
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, record in enumerate(GOOD):
        (folder / f"part{i}.jsonl").write_text(json.dumps(record))
    assert load_records(str(folder))[0] == GOOD
    assert load_records(Dataset.from_list(GOOD))[0] == GOOD


def test_a_folder_of_mixed_kinds_is_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    Dataset.from_list(GOOD).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(ConfigError, match="mixes file kinds"):
        load_records(str(tmp_path))


def test_field_names_are_configurable():
    records = [{"prompt": "Say hi.", "response": "hi"}]
    loaded, _ = check_records(records, "mem", fields=FieldNames(instruction="prompt", output="response"))
    assert loaded == [{"instruction": "Say hi.", "input": "", "output": "hi"}]


def test_missing_file_names_the_key_and_path(tmp_path):
    with pytest.raises(ConfigError, match=r"eval_dataset: data file not found: .*nope.json"):
        load_records(str(tmp_path / "nope.json"), key="eval_dataset")


BAD = [
    ({"input": "", "output": "x"}, "missing field 'instruction'"),
    ({"instruction": "a", "input": "", "output": None}, "missing field 'output'"),
    ({"instruction": "a", "input": 3, "output": "x"}, "field 'input' must be text, got int"),
    ({"instruction": ["a"], "input": "", "output": "x"}, "field 'instruction' must be text, got list"),
    ({"instruction": "a", "input": "", "output": "  "}, "field 'output' is empty"),
    ({"instruction": " ", "input": "", "output": "x"}, "field 'instruction' is empty"),
    ({"instruction": "a\ufffdb", "input": "", "output": "x"}, "field 'instruction' holds undecodable bytes"),
]


@pytest.mark.parametrize("record, message", BAD, ids=[message for _, message in BAD])
def test_bad_records_are_named(record, message):
    with pytest.raises(DataError, match=rf"data.jsonl: record 1: {message}"):
        check_records([GOOD[0], record], "data.jsonl")


def test_bad_records_in_a_file_are_named_with_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n" + json.dumps({"instruction": "a", "input": 3, "output": "b"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: record 1: field 'input' must be text, got int"):
        load_records(str(path))


def test_broken_json_lines_and_non_utf8_files(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GOOD[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"dataset: could not read .*broken.jsonl"):
        load_records(str(broken))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"instruction": "caf\xe9", "input": "", "output": "x"}\n')
    with pytest.raises(DataError, match=r"dataset: .*latin.jsonl is not valid UTF-8 text"):
        load_records(str(latin))


def test_skip_counts_and_reports_the_first_indices():
    records = [GOOD[0]] + [record for record, _ in BAD] + [GOOD[1]]
    loaded, check = check_records(records, "data.jsonl", on_bad_record="skip")
    assert loaded == GOOD
    assert [index for index, _ in check.skipped] == list(range(1, len(BAD) + 1))
    assert str(check).startswith(f"data.jsonl: skipped {len(BAD)} of {len(records)} invalid records (first: record 1:")


def test_nothing_valid_left_is_an_error():
    with pytest.raises(DataError, match="no valid record left"):
        check_records([BAD[0][0]], "data.jsonl", on_bad_record="skip")


def test_split_is_disjoint_and_seeded():
    records = [{"instruction": str(i), "input": "", "output": "x"} for i in range(100)]
    train, held_out = split_records(records, 0.1, seed=0)
    assert len(held_out) == 10 and len(train) == 90
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held_out}
    assert split_records(records, 0.1, seed=0) == (train, held_out)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize(
    "name, count, with_input", [("alpaca_en_demo.json", 999, 412), ("alpaca_zh_demo.json", 1000, 139)]
)
def test_real_alpaca_sets_load_whole(name, count, with_input):
    records, check = load_records(str(SHARED_DATA / name))
    assert len(records) == count and not check.skipped
    assert sum(1 for r in records if r["input"]) == with_input
