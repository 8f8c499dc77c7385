"""Issue #8 part 4: random records, data files and config dicts meet no uncaught exception but hf_scale's own.

A user mistake must come out as an `HfScaleError` that the recipe prints as one `error:` line, never as a
traceback from datasets, pyarrow, argparse or transformers.
"""

import contextlib
import json
import re
import string

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import HfArgumentParser

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.loading import check_records, load_records
from hf_scale.data.templates import ALPACA, get_template
from hf_scale.data.tokenize import IGNORE_INDEX, TRUNCATION_POLICIES, check_examples_left, tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.modeling import ModelArguments, load_tokenizer

FIELDS = ["instruction", "input", "output"]
text = st.text(max_size=40)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | text
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3))
records = st.dictionaries(st.sampled_from([*FIELDS, "extra"]) | text, values, max_size=5)
record_lists = st.lists(records | values, max_size=8)  # a record may also be no mapping at all
wordy = st.text(string.ascii_letters + string.digits + " .,?!\n\u4e00\u00e9", min_size=1, max_size=60)
valid_records = st.fixed_dictionaries({"instruction": wordy, "input": st.just("") | wordy, "output": wordy})
# Mostly valid records, now and then a broken one: files that load, and files that fail deep inside datasets.
file_records = st.lists(st.integers(0, 4).flatmap(lambda n: valid_records if n else records | values), max_size=8)


@settings(max_examples=200, deadline=None)
@given(record_lists, st.sampled_from(["error", "skip"]))
def test_random_records_are_checked_or_refused_by_name(batch, on_bad_record):
    try:
        valid, check = check_records(batch, "fuzz.jsonl", on_bad_record=on_bad_record)
    except HfScaleError as error:
        assert str(error).startswith("fuzz.jsonl")  # the message names the source
        return
    assert len(valid) + len(check.skipped) == len(batch)
    assert all(isinstance(record[field], str) for record in valid for field in FIELDS)


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-data")


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory):
    """Keep the arrow files datasets writes for each random file out of the user's cache."""
    import datasets

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets-cache")))
        yield


def as_file_bytes(batch, style: str, junk: bytes) -> bytes:
    if style == "json":
        return json.dumps(batch).encode()
    if style == "jsonl":
        return "".join(json.dumps(record) + "\n" for record in batch).encode()
    return junk  # random bytes: broken JSON, bad UTF-8, anything


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file_records, st.sampled_from(["json", "jsonl", "junk.json", "junk.jsonl"]), st.binary(max_size=80))
def test_random_data_files_load_or_fail_with_a_data_error(data_folder, datasets_cache, batch, style, junk):
    path = data_folder / f"data.{style.split('.')[-1]}"
    path.write_bytes(as_file_bytes(batch, style.split(".")[0], junk))
    try:
        loaded, _ = load_records(str(path))
    except HfScaleError as error:
        event(f"refused: {type(error).__name__}")
        assert str(path) in str(error)  # the message names the file
        return
    event("loaded")
    assert loaded and all(isinstance(record[field], str) for record in loaded for field in FIELDS)


# Valid JSON on which the JSON reader of datasets 4.8 loops forever (found by the test above): hf_scale reads JSON
# files itself, so this one loads at once, its first record named for the field it lacks.
HUNG_DATASETS = (
    '[{"a": 1e159, "b": [], "": {"c": [2974], "": [[], {"d": 2.2e-308}, [true, "x", -267]], '
    '"e": {"f": [false, -559, null]}}}, {"instruction": "T", "output": "o", "input": ""}]'
)


@pytest.mark.timeout(60)
def test_a_file_that_hung_datasets_loads_at_once(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(HUNG_DATASETS)
    records, check = load_records(str(path), on_bad_record="skip")
    assert records.to_list() == [{"instruction": "T", "input": "", "output": "o"}]
    assert check.skipped == [(0, "missing field 'instruction'")]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(valid_records, min_size=1, max_size=6),
    st.integers(2, 80),
    st.sampled_from(TRUNCATION_POLICIES),
    st.booleans(),
)
def test_random_records_tokenize_within_max_length_or_are_counted(tokenizer, batch, max_length, truncation, inputs):
    dataset, summary = tokenize_records(
        batch, tokenizer, ALPACA, max_length, train_on_inputs=inputs, truncation=truncation
    )
    assert summary.examples + summary.dropped_too_long + summary.dropped_no_response == len(batch)
    for ids, labels in zip(dataset["input_ids"], dataset["labels"], strict=True):
        assert len(ids) == len(labels) <= max_length
        assert any(label != IGNORE_INDEX for label in labels)  # every kept example teaches something
    try:
        check_examples_left("train", summary, max_length, truncation)
    except HfScaleError as error:
        assert summary.examples == 0 and f"max_length={max_length}" in str(error)


@pytest.fixture(scope="module")
def parser():
    return HfArgumentParser((ModelArguments, DataArguments, ScaleTrainingArguments))


def config_actions() -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, ScaleTrainingArguments))
    # Keys that would make a valid config reach for the network or another machine's hardware are left out:
    # push_to_hub and the hub ids (no hub here), deepspeed and the launch layout (built by their own tests).
    left_out = {"help", "push_to_hub", "hub_model_id", "deepspeed", "zero_preset", "local_rank", "use_cpu"}
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in left_out}


def plausible(action) -> st.SearchStrategy:
    """Values of the key's own type, so that random configs get past argparse into the dataclasses' checks."""
    if action.choices:
        return st.sampled_from([str(getattr(choice, "value", choice)) for choice in action.choices])
    if action.nargs in ("+", "*"):
        return st.lists(text, min_size=1, max_size=3)
    kind = getattr(action.type, "__name__", "")
    return {
        "string_to_bool": st.booleans(),
        "int": st.integers(-2, 64),
        "float": st.sampled_from([0.0, 1e-5, 0.05, 0.5, 1.0, 2.0]) | st.floats(-1, 3),
        "dict": st.dictionaries(text, scalars, max_size=2),
    }.get(kind, text | st.sampled_from(["", "auto", "none", "alpaca", "./missing", "{}", "[]"]))


ACTIONS = config_actions()
REFUSAL = re.compile(r"unknown key|key '\w+'|invalid arguments(?:: \w+Error)?|^\w+:")  # how it was refused
config_values = scalars | st.lists(scalars, max_size=3) | st.dictionaries(text, scalars, max_size=2)
# Mostly values of the key's type, now and then anything; mostly known keys, now and then a made-up one.
known_entries = st.sampled_from(sorted(ACTIONS)).flatmap(
    lambda key: st.tuples(
        st.just(key), st.integers(0, 3).flatmap(lambda n: plausible(ACTIONS[key]) if n else config_values)
    )
)
entries = st.integers(0, 9).flatmap(lambda n: known_entries if n else st.tuples(text, config_values))
config_dicts = st.lists(entries, max_size=6).map(dict)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config_dicts)
def test_random_config_dicts_parse_or_fail_with_a_config_error(parser, tmp_path_factory, config):
    folder = tmp_path_factory.mktemp("config")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    # Relative paths in the config (output_dir: "abc") must land in the scratch folder, not in the repository.
    with contextlib.chdir(folder):
        try:
            _, data_args, _ = parse_config(parser, ["--config", str(path)])
            get_template(data_args.template, data_args.system_prompt)  # step 1 of the recipe checks it next
        except HfScaleError as error:
            event(f"refused: {' '.join(REFUSAL.findall(str(error)))}")
            assert str(error)  # a message for the user, never an empty one
        else:
            event("accepted")
