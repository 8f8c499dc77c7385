from dataclasses import dataclass

import pytest
from transformers import HfArgumentParser

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.errors import ConfigError
from hf_scale.modeling import ModelArguments


@pytest.fixture
def parser():
    return HfArgumentParser((ModelArguments, DataArguments, ScaleTrainingArguments))


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_values_and_command_line_overrides(parser, tmp_path):
    config = write(
        tmp_path,
        f"output_dir: {tmp_path}/out\nlearning_rate: 2e-5\nbf16: false\nmax_length: 64\n"
        "lora_target_modules: [q_proj, v_proj]\ngradient_checkpointing_kwargs: {use_reentrant: false}\n",
    )
    model_args, data_args, args = parse_config(parser, ["--config", config, "--max_length", "128"])
    # YAML 1.1 reads 2e-5 as a string; it must still arrive as a float.
    assert args.learning_rate == pytest.approx(2e-5) and isinstance(args.learning_rate, float)
    assert data_args.max_length == 128  # the flag wins over the file
    assert model_args.lora_target_modules == ["q_proj", "v_proj"]
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.output_dir == f"{tmp_path}/out"


def test_null_in_yaml_means_none(parser, tmp_path):
    config = write(tmp_path, f"output_dir: {tmp_path}/out\neval_dataset: null\nmodel_name_or_path: ~\n")
    model_args, data_args, _ = parse_config(parser, ["--config", config])
    assert model_args.model_name_or_path is None and data_args.eval_dataset is None


def test_unknown_yaml_key_names_key_file_and_suggestion(parser, tmp_path):
    config = write(tmp_path, "lerning_rate: 1e-4\n")
    with pytest.raises(
        ConfigError, match=r"config file .*config.yaml: unknown key 'lerning_rate' \(did you mean 'learning_rate'\?\)"
    ):
        parse_config(parser, ["--config", config])


def test_unknown_flag_names_the_command_line(parser):
    with pytest.raises(ConfigError, match=r"command line: unknown key 'max_lenght' \(did you mean 'max_length'\?\)"):
        parse_config(parser, ["--max_lenght", "3"])


def test_bad_value_is_blamed_on_its_source(parser, tmp_path):
    config = write(tmp_path, "learning_rate: fast\n")
    with pytest.raises(
        ConfigError, match=r"config file .*config.yaml: key 'learning_rate': invalid float value: 'fast'"
    ):
        parse_config(parser, ["--config", config])
    with pytest.raises(ConfigError, match=r"command line: key 'max_length': invalid int value: 'long'"):
        parse_config(parser, ["--config", config, "--learning_rate", "1e-4", "--max_length", "long"])


def test_list_for_a_single_value_key(parser, tmp_path):
    config = write(tmp_path, "learning_rate: [1e-4, 2e-4]\n")
    with pytest.raises(ConfigError, match="key 'learning_rate' takes one value"):
        parse_config(parser, ["--config", config])


@pytest.mark.parametrize(
    "text, message",
    [(None, "config file not found"), ("- a\n- b\n", "must be a mapping"), ("a: [1, 2\n", "not valid YAML")],
)
def test_unreadable_config_files(parser, tmp_path, text, message):
    path = tmp_path / "config.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_config(parser, ["--config", str(path)])


def test_transformers_own_checks_become_config_errors(parser, tmp_path):
    with pytest.raises(ConfigError, match="invalid arguments"):
        parse_config(parser, ["--output_dir", str(tmp_path), "--bf16", "--fp16"])


@dataclass
class BuggyArguments:
    """A `__post_init__` with a bug in its code: whatever the value, it raises."""

    name: str = "x"
    error: str = "AttributeError"

    def __post_init__(self):
        if self.error == "AttributeError":
            self.name.no_such_method()
        elif self.error == "KeyError":
            {}["no_such_key"]
        else:
            len(5)


@pytest.mark.parametrize("error", ["AttributeError", "KeyError", "TypeError"])
def test_a_bug_in_a_post_init_propagates_with_its_traceback(error):
    with pytest.raises(Exception) as caught:
        parse_config(HfArgumentParser(BuggyArguments), ["--name", "y", "--error", error])
    assert type(caught.value).__name__ == error  # the bug itself, not a ConfigError that hides it
    assert caught.traceback[-1].name == "__post_init__"  # its stack reaches the line at fault


# The nested configs that transformers, accelerate and DeepSpeed read without checking their shape: a section that
# is not a mapping, an unknown key, a path to no file. Each is still one line naming the key.
NESTED_CONFIG_MISTAKES = [
    (["--deepspeed", '{"zero_optimization": 3}'], r"deepspeed: .*AttributeError"),
    (["--deepspeed", '{"optimizer": {"type": "AdamW", "params": 3}}'], r"deepspeed: .*AttributeError"),
    (["--deepspeed", '{"tensor_parallel": 5}'], r"deepspeed: tensor_parallel must be a mapping .*got 5"),
    (["--deepspeed", '{"tensor_parallel": {"autotp_size": 0}}'], r"deepspeed: tensor_parallel.autotp_size must be"),
    (["--accelerator_config", "./no-such-file.json"], r"accelerator_config: .*no-such-file.json"),
    (["--accelerator_config", '{"bogus_key": 1}'], r"accelerator_config: .*bogus_key"),
    (["--fsdp", "full_shard", "--fsdp_config", "./no-such-file.json"], r"fsdp_config: .*no-such-file.json"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"transformer_layer_cls_to_wrap": 5}'], r"fsdp_config: .*TypeError"),
]


@pytest.mark.parametrize("flags, message", NESTED_CONFIG_MISTAKES, ids=[" ".join(f) for f, _ in NESTED_CONFIG_MISTAKES])
def test_a_malformed_nested_config_is_one_line_naming_its_key(parser, tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(parser, ["--output_dir", str(tmp_path), *flags])
    assert "\n" not in str(caught.value)


def test_a_deepspeed_file_that_is_not_a_mapping_names_the_file(parser, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"deepspeed: .*ds.json must hold a JSON object \(a mapping\), got list"):
        parse_config(parser, ["--output_dir", str(tmp_path), "--deepspeed", str(path)])


def test_report_to_null_is_refused_by_name(parser, tmp_path):
    # transformers 5 keeps a null report_to as [None] and fails only once the Trainer starts
    config = write(tmp_path, f"output_dir: {tmp_path}/out\nreport_to: null\n")
    with pytest.raises(ConfigError, match=r"report_to: names integrations \(or none, or all\), got \[None\]"):
        parse_config(parser, ["--config", config])
