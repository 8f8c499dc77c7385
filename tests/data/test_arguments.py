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
