import pytest

from hf_scale.errors import ConfigError
from hf_scale.presets import list_presets, zero_preset


def test_shipped_presets():
    assert {"zero2", "zero2_offload", "zero3", "zero3_offload"} <= set(list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_leaves_batch_numbers_to_the_trainer(name):
    config = zero_preset(name)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert config[key] == "auto", f"{name}: {key} must be 'auto' so the HF integration fills it in"
    if config["zero_optimization"]["stage"] == 3:
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_overrides_merge_one_level_and_do_not_leak():
    config = zero_preset("zero2", zero_optimization={"stage": 1}, gradient_clipping=1.0)
    assert config["zero_optimization"]["stage"] == 1
    assert config["zero_optimization"]["overlap_comm"] is True  # the rest of the section stays
    assert config["gradient_clipping"] == 1.0
    assert zero_preset("zero2")["zero_optimization"]["stage"] == 2


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'zero7'"):
        zero_preset("zero7")


def test_explicit_deepspeed_values_that_contradict_the_arguments_are_named(tmp_path):
    from hf_scale.arguments import ScaleTrainingArguments

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer": {"params": {"lr": 1e-4}}}
    config["zero_optimization"] = {"stage": 2}
    with pytest.raises(ConfigError) as error:
        ScaleTrainingArguments(
            output_dir=str(tmp_path), deepspeed=config, per_device_train_batch_size=8, learning_rate=2e-5
        )
    message = str(error.value)
    assert "train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=8" in message
    assert "optimizer.params.lr=0.0001 vs hf learning_rate=2e-05" in message
    assert "gradient_clipping" not in message  # 1.0 is the Trainer's max_grad_norm too


def test_deepspeed_file_problems_are_named(tmp_path):
    from hf_scale.arguments import ScaleTrainingArguments

    with pytest.raises(ConfigError, match="deepspeed: config file not found: .*nope.json"):
        ScaleTrainingArguments(output_dir=str(tmp_path), deepspeed=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 2")
    with pytest.raises(ConfigError, match="deepspeed: .*bad.json is not valid JSON"):
        ScaleTrainingArguments(output_dir=str(tmp_path), deepspeed=str(bad))
