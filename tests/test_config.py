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
