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


def test_a_missing_bitsandbytes_names_the_extra_to_install(monkeypatch):
    """Without bitsandbytes a quantized base stops at the arguments, naming `pip install 'hf-scale[qlora]'`, and
    that extra brings it."""
    import importlib.util
    import tomllib

    from tests.helpers import REPO_ROOT

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"quantization: nf4 needs bitsandbytes, .*pip install 'hf-scale\[qlora\]'"):
        ModelArguments(lora_r=8, quantization="nf4")
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [requirement.split(">")[0] for requirement in extras["qlora"]] == ["bitsandbytes"]


@pytest.mark.parametrize(
    "quantization, layer", [("nf4", "Linear4bit"), ("fp4", "Linear4bit"), ("int8", "Linear8bitLt")]
)
def test_a_quantized_base_is_bitsandbytes_layers_frozen_under_fp32_adapters(tiny_model_dir, quantization, layer):
    import bitsandbytes as bnb
    import torch

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_model(ModelArguments(lora_r=8, quantization=quantization), str(tiny_model_dir), tokenizer)
    projections = [m for m in model.modules() if isinstance(m, getattr(bnb.nn, layer))]
    assert len(projections) == 21  # 3 layers x 7 projections
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name and p.dtype == torch.float32 for name, p in trainable.items())
    if quantization != "int8":
        assert projections[0].weight.quant_state.quant_type == quantization
    batch = tokenizer(["Add one to 41."], return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert all(p.grad is not None for p in trainable.values())  # gradients reach every adapter through the base


@pytest.mark.parametrize("quantization", ["nf4", "fp4"])
def test_an_evaluation_leaves_a_quantized_base_training_as_before(tiny_model_dir, quantization):
    """The adapters' gradients after an evaluation (eval mode, inputs without gradients) are those of a model that
    never evaluated. bitsandbytes on a CPU with AVX512-BF16 re-packs a 4-bit weight for its inference kernel at
    such a forward, rounding its constants, and gradients no longer reach the layer's input afterwards: the adapters
    of every earlier layer then trained on a wrong gradient, with nothing said."""
    import torch

    tokenizer = load_tokenizer(str(tiny_model_dir))
    batch = tokenizer(["Add one to 41.", "Subtract one from 7."], return_tensors="pt", padding=True)

    def adapter_gradients(evaluate_first: bool) -> dict:
        torch.manual_seed(0)  # the same initial adapters in both models
        args = ModelArguments(lora_r=8, lora_dropout=0.0, quantization=quantization)
        model = load_model(args, str(tiny_model_dir), tokenizer)
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(**batch)
            model.train()
        for name, parameter in model.named_parameters():  # LoRA's B starts at zero: give A a gradient too
            if "lora_B" in name:
                parameter.data.normal_(0, 0.02)
        model(**batch, labels=batch["input_ids"]).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}

    fresh, evaluated = adapter_gradients(False), adapter_gradients(True)
    assert fresh.keys() == evaluated.keys()
    for name, gradient in fresh.items():
        assert gradient.abs().sum() > 0, name
        assert torch.allclose(gradient, evaluated[name], atol=1e-6), name
