import json

import datasets.config
import httpx
import huggingface_hub.constants
import pytest
from datasets import Dataset
from datasets.exceptions import DatasetNotFoundError
from huggingface_hub.errors import HfHubHTTPError

import hf_scale.data.loading
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
        assert records.to_list() == GOOD and not check.skipped, name
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, record in enumerate(GOOD):
        (folder / f"part{i}.jsonl").write_text(json.dumps(record))
    assert load_records(str(folder))[0].to_list() == GOOD
    assert load_records(Dataset.from_list(GOOD))[0].to_list() == GOOD


def test_a_folder_of_mixed_kinds_is_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    Dataset.from_list(GOOD).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(ConfigError, match="mixes file kinds"):
        load_records(str(tmp_path))


def test_field_names_are_configurable():
    records = [{"prompt": "Say hi.", "response": "hi"}]
    loaded, _ = check_records(records, "mem", fields=FieldNames(instruction="prompt", output="response"))
    assert loaded.to_list() == [{"instruction": "Say hi.", "input": "", "output": "hi"}]


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
    assert loaded.to_list() == GOOD
    assert [index for index, _ in check.skipped] == list(range(1, len(BAD) + 1))
    assert str(check).startswith(f"data.jsonl: skipped {len(BAD)} of {len(records)} invalid records (first: record 1:")


def test_nothing_valid_left_is_an_error():
    with pytest.raises(DataError, match="no valid record left"):
        check_records([BAD[0][0]], "data.jsonl", on_bad_record="skip")


def test_split_is_disjoint_and_seeded():
    records = Dataset.from_list([{"instruction": str(i), "input": "", "output": "x"} for i in range(100)])
    train, held_out = split_records(records, 0.1, seed=0)
    assert len(held_out) == 10 and len(train) == 90
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held_out}
    again = split_records(records, 0.1, seed=0)
    assert (again[0].to_list(), again[1].to_list()) == (train.to_list(), held_out.to_list())


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize(
    "name, count, with_input", [("alpaca_en_demo.json", 999, 412), ("alpaca_zh_demo.json", 1000, 139)]
)
def test_real_alpaca_sets_load_whole(name, count, with_input):
    records, check = load_records(str(SHARED_DATA / name))
    assert len(records) == count and not check.skipped
    assert sum(1 for r in records if r["input"]) == with_input


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 as a user sets it, and as datasets and huggingface_hub read it (once, at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))  # nothing cached


@pytest.mark.parametrize("key", ["dataset", "eval_dataset"])
def test_a_hub_id_out_of_reach_names_the_key_the_id_and_what_to_do(offline, key):
    with pytest.raises(ConfigError) as caught:
        load_records("hf-scale-tests/no-such-dataset", key=key)
    message = str(caught.value)
    assert message.startswith(f"{key}: no local file or folder hf-scale-tests/no-such-dataset, and the Hugging Face")
    assert "check the path or the id, the network, or HF_HUB_OFFLINE" in message
    assert "\n" not in message


def test_a_malformed_hub_id_names_the_id(monkeypatch):
    # Online, as a user runs: huggingface_hub refuses the id before it makes any request.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(ConfigError) as caught:
        load_records("my-data/train--v2")
    message = str(caught.value)
    assert message.startswith("dataset: no local file or folder my-data/train--v2, and it is no valid hub dataset id")
    assert "Cannot have -- or .. in repo_id" in message and message.endswith("check the path")


def hub_dataset(monkeypatch, tmp_path, splits: dict[str, list]) -> None:
    """Any hub id resolves to a dataset laid out as on the hub: one file per split, named after it."""
    folder = tmp_path / "hub"
    folder.mkdir()
    for split, records in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))  # not the user's
    real = hf_scale.data.loading.load_dataset
    monkeypatch.setattr(hf_scale.data.loading, "load_dataset", lambda name, **kwargs: real(str(folder), **kwargs))


def test_a_hub_dataset_without_a_train_split_names_the_splits_and_what_to_do(monkeypatch, tmp_path):
    hub_dataset(monkeypatch, tmp_path, {"test": GOOD, "validation": GOOD})
    with pytest.raises(ConfigError) as caught:
        load_records("someone/only-test", key="eval_dataset")
    assert str(caught.value) == (
        "eval_dataset: hub dataset someone/only-test has no 'train' split (its splits: test, validation); hf_scale "
        "trains on the train split: save the split you want as a file, e.g. load_dataset('someone/only-test', "
        "split='test').to_json('data.jsonl'), and give that file"
    )


def test_a_hub_dataset_loads_its_train_split(monkeypatch, tmp_path):
    hub_dataset(monkeypatch, tmp_path, {"train": GOOD, "test": GOOD[:1]})
    assert load_records("someone/alpaca")[0].to_list() == GOOD


def test_a_bug_while_loading_a_hub_dataset_is_not_a_config_error(monkeypatch):
    def buggy(name, **kwargs):
        raise AttributeError("a bug, not a missing dataset")

    monkeypatch.setattr(hf_scale.data.loading, "load_dataset", buggy)
    with pytest.raises(AttributeError, match="a bug, not a missing dataset"):
        load_records("someone/alpaca")


# What datasets and huggingface_hub raise online (no network here): the answers the hub gives, raised as they are.
HUB_ANSWERS = [
    (
        DatasetNotFoundError("Dataset 'someone/alpaka' doesn't exist on the Hub or cannot be accessed."),
        "dataset: no local file or folder someone/alpaka, nor a hub dataset of that id (Dataset 'someone/alpaka' "
        "doesn't exist on the Hub or cannot be accessed.): check the path or the id (owner/name); a gated dataset "
        "needs `hf auth login` and access granted on its page",
    ),
    (
        HfHubHTTPError(
            "429 Too Many Requests\nRequest ID: abc",
            response=httpx.Response(429, request=httpx.Request("GET", "https://huggingface.co")),
        ),
        "dataset: the Hugging Face hub failed on dataset someone/alpaka: 429 Too Many Requests Request ID: abc",
    ),
]


@pytest.mark.parametrize("error, message", HUB_ANSWERS, ids=[type(error).__name__ for error, _ in HUB_ANSWERS])
def test_the_hub_refusing_a_dataset_is_one_line_naming_the_id(monkeypatch, error, message):
    def answer(name, **kwargs):
        raise error

    monkeypatch.setattr(hf_scale.data.loading, "load_dataset", answer)
    with pytest.raises(ConfigError) as caught:
        load_records("someone/alpaka")
    assert str(caught.value) == message
