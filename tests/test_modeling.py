import pytest

from hf_scale.errors import ConfigError
from hf_scale.modeling import ModelArguments, check_model_path, load_model, load_tokenizer


def test_hub_ids_are_left_to_from_pretrained():
    check_model_path("meta-llama/Llama-2-7b-hf")
    check_model_path("gpt2")


@pytest.mark.parametrize("name", ["./missing-model", "/nowhere/model", "runs/a/b"])
def test_missing_local_folders(name):
    with pytest.raises(ConfigError, match=f"model_name_or_path: model folder not found: {name}"):
        check_model_path(name)


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        check_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no weights"):
        check_model_path(str(tmp_path))


def test_pad_token_is_unk_not_eos(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert tokenizer.pad_token == "<unk>" and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_lora_trains_only_adapters(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_model(
        ModelArguments(lora_r=4, lora_target_modules=["q_proj", "v_proj"]), str(tiny_model_dir), tokenizer
    )
    assert model.config.pad_token_id == tokenizer.pad_token_id
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


def test_bad_model_arguments():
    with pytest.raises(ConfigError, match="dtype: expected auto"):
        ModelArguments(dtype="fp8")
    with pytest.raises(ConfigError, match="lora_r must be 0"):
        ModelArguments(lora_r=-1)
