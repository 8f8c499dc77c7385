import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from hf_scale.tiny.build import build_tiny_model, build_tiny_tokenizer, ensure_tiny_model


def test_saved_folder_loads_with_auto_classes(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>" and tokenizer.pad_token is None
    assert model.config.vocab_size == len(tokenizer)


def test_digits_are_single_tokens_and_text_round_trips(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.tokenize("417") == ["4", "1", "7"]
    text = "给这个数加一。\n\n### Response:\n418"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_build_is_deterministic(tmp_path, tiny_model_dir):
    tokenizer = build_tiny_tokenizer()
    first, second = build_tiny_model(tokenizer), build_tiny_model(tokenizer)
    pairs = zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()


def test_ensure_reuses_a_complete_build(tmp_path):
    path = ensure_tiny_model(tmp_path / "tiny")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no staging folder left behind
