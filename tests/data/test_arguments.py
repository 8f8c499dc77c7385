"""DataArguments refuse a bad value when they are built, naming the field, from Python and from a config file."""

import pytest
from transformers import HfArgumentParser

from hf_scale.config import parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.errors import ConfigError


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(eval_ratio=1.0), "eval_ratio must be between 0 and 1"),
        (dict(max_length=1), "max_length must be at least 2 tokens"),
        (dict(exact_match_samples=-1), "exact_match_samples must be 0 or more"),
        (dict(truncation="cut_left"), "truncation must be one of keep_prompt, cut_prompt_left, drop, got 'cut_left'"),
        (dict(on_bad_record="drop"), "on_bad_record must be one of error, skip, got 'drop'"),
        (dict(data_format="chatml"), "data_format must be one of alpaca, sharegpt, messages, got 'chatml'"),
        (dict(mixture="zip"), "mixture must be one of interleave, interleave_all, concatenate, got 'zip'"),
        (dict(assistant_turns="first"), "assistant_turns must be one of all, last, got 'first'"),
        (dict(dataset="a.json", datasets='[{"path": "b.json"}]'), "datasets and dataset/eval_dataset are both set"),
        (dict(datasets='[{"path": "b.json", "weight": -1}]'), r"datasets\[0\]: weight must be a positive number"),
    ],
)
def test_a_bad_value_is_refused_when_the_arguments_are_built(bad, message):
    with pytest.raises(ConfigError, match=message):
        DataArguments(**bad)


def test_a_bad_choice_in_a_config_file_names_the_file_and_key(tmp_path):
    config = tmp_path / "data.yaml"
    config.write_text("truncation: cut_left\n")
    with pytest.raises(ConfigError, match=r"data\.yaml: key 'truncation': invalid choice: 'cut_left'"):
        parse_config(HfArgumentParser(DataArguments), ["--config", str(config)])


def test_datasets_as_a_yaml_list_in_a_config_file(tmp_path):
    """A config file lists the sources in YAML; each entry's own keys win over the run's."""
    config = tmp_path / "mix.yaml"
    config.write_text(
        "data_format: sharegpt\n"
        "datasets:\n"
        "  - {path: alpaca.json, data_format: alpaca, weight: 2}\n"
        "  - path: chats.jsonl\n"
        "    eval_path: chats_eval.jsonl\n"
        "mixture: concatenate\n"
    )
    (data_args,) = parse_config(HfArgumentParser(DataArguments), ["--config", str(config)])
    alpaca, chats = data_args.sources()
    assert (alpaca.path, alpaca.data_format, alpaca.weight) == ("alpaca.json", "alpaca", 2)
    assert (chats.path, chats.data_format, chats.eval_path) == ("chats.jsonl", "sharegpt", "chats_eval.jsonl")
    assert data_args.mixture == "concatenate"


def test_a_bad_source_in_a_config_file_names_the_entry(tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text("datasets:\n  - {path: a.json, weihgt: 2}\n")
    with pytest.raises(ConfigError, match=r"datasets\[0\]: unknown key 'weihgt' \(did you mean 'weight'\?\)"):
        parse_config(HfArgumentParser(DataArguments), ["--config", str(config)])
