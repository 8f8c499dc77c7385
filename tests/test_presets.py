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
