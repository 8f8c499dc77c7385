"""`hf-scale export --format gguf`: runs written as one GGUF file and read back by a real reader, transformers' GGUF
loader (which undoes llama.cpp's query/key layout and builds the tokenizer from the file).

Each export is compared with the model it was made from (the run's weights, or its adapter merged as `--format hf`
merges it): f16 read back equals the weights rounded to f16, q8_0 stays within its block error, and the greedy
answers to held-out prompts through the file's own tokenizer and chat template are the run's. The llama.cpp check
(llama-cpp-python, a 6-minute compile) is opt-in: `tests/test_gguf_llama_cpp.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.export import merge_adapter, merge_quantization
from tests.helpers import assert_succeeded, run_cli
from tests.test_export import greedy_answers, held_out_instructions

Q8_0_BLOCK = 32
ROUNDED_TO = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def read_back(path: Path):
    """The GGUF file as transformers reads it: (model, tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_weights_read_back(reference: dict[str, torch.Tensor], read: dict[str, torch.Tensor], gguf_type: str):
    """f32, f16, bf16: every 2-D weight exactly as rounded to the type; q8_0: within half a quantization step of its
    block, the step being the block's largest magnitude / 127, plus the f16 rounding of that step (stored in f16),
    times up to 127 (0.5 + 127 * 2**-11 = 0.562 steps); norms exact."""
    assert set(read) == set(reference)
    largest_error = 0.0
    for name, expected in reference.items():
        got = read[name]
        if expected.dim() == 1:
            assert torch.equal(got, expected), name
        elif gguf_type in ROUNDED_TO:
            assert torch.equal(got, expected.to(ROUNDED_TO[gguf_type]).float()), name
        else:
            blocks, errors = expected.reshape(-1, Q8_0_BLOCK), (got - expected).reshape(-1, Q8_0_BLOCK)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            assert (errors.abs() <= 0.563 * step + 1e-7).all(), name
            largest_error = max(largest_error, errors.abs().max().item())
    # Quantized indeed (a weight already on a coarser grid, as SmolLM2's from its Q4_1 file, can come back exact).
    assert gguf_type != "q8_0" or largest_error > 0


def export_gguf(capsys, run: Path, out: Path, gguf_type: str):
    result = run_cli(capsys, "export", str(run), str(out), "--format", "gguf", "--gguf_type", gguf_type)
    assert_succeeded(result)
    assert f"GGUF {gguf_type}" in result.stdout and out.is_file()
    return result


@pytest.mark.slow
def test_a_full_run_as_f16_and_q8_0_reads_back_with_its_weights_answers_and_template(
    trained_tiny_run, tmp_path, capsys
):
    run_model = AutoModelForCausalLM.from_pretrained(trained_tiny_run, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_run)
    assert tokenizer.chat_template  # the run's, which the file must carry
    instructions = held_out_instructions(20)
    run_answers = greedy_answers(run_model, tokenizer, instructions)
    for gguf_type in ("f16", "q8_0"):
        out = tmp_path / f"tiny-{gguf_type}.gguf"
        result = export_gguf(capsys, trained_tiny_run, out, gguf_type)
        assert "full model" in result.stdout and "with its chat template" in result.stdout
        model, read_tokenizer = read_back(out)
        assert_weights_read_back(run_model.state_dict(), model.state_dict(), gguf_type)
        assert read_tokenizer.chat_template == tokenizer.chat_template
        assert (read_tokenizer.bos_token_id, read_tokenizer.eos_token_id) == (
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
        )
        # The file's tokenizer through the file's template: the prompts tokenize as in training, answers as the run's.
        assert greedy_answers(model, read_tokenizer, instructions) == run_answers, gguf_type


@pytest.mark.slow
@pytest.mark.parametrize("run_name", ["trained_tiny_lora_run", "trained_tiny_qlora_run"])
def test_lora_and_qlora_runs_export_merged_as_the_adapter_model_answers(run_name, request, tmp_path, capsys):
    """The merge is the one `--format hf --merge-lora` makes (QLoRA: into the dequantized NF4 base it trained on);
    the answers are the adapter model's, loaded unmerged through peft as training left it."""
    from peft import PeftModel

    run = request.getfixturevalue(run_name)
    base_path = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    quantized = merge_quantization(run, None)
    assert (quantized is not None) == (run_name == "trained_tiny_qlora_run")
    merged = merge_adapter(run, base_path, "float32", quantized).eval()
    tokenizer = AutoTokenizer.from_pretrained(run)
    instructions = held_out_instructions(20)
    if quantized is None:  # LoRA: the unmerged adapter model answers
        adapter_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), run).eval()
        expected = greedy_answers(adapter_model, tokenizer, instructions)
        assert greedy_answers(merged, tokenizer, instructions) == expected
    else:
        expected = greedy_answers(merged, tokenizer, instructions)
    for gguf_type in ("f16", "q8_0"):
        out = tmp_path / f"{run_name}-{gguf_type}.gguf"
        result = export_gguf(capsys, run, out, gguf_type)
        assert "LoRA merged into its base" in result.stdout
        assert ("dequantized from the base it trained on" in result.stdout) == (quantized is not None)
        model, read_tokenizer = read_back(out)
        assert_weights_read_back(merged.state_dict(), model.state_dict(), gguf_type)
        assert greedy_answers(model, read_tokenizer, instructions) == expected, gguf_type


def test_f32_and_bf16_read_back_exactly_as_rounded(tiny_model_dir, tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for gguf_type in ("f32", "bf16"):
        out = tmp_path / f"tiny-{gguf_type}.gguf"
        export_gguf(capsys, tiny_model_dir, out, gguf_type)
        assert_weights_read_back(model.state_dict(), read_back(out)[0].state_dict(), gguf_type)


def test_a_sentencepiece_style_tokenizer_reads_back_tokenizing_as_it_did(tmp_path):
    """LLaMA-2's kind of tokenizer (BPE with byte fallback, "▁" for spaces) is written as llama.cpp's `llama`
    vocabulary: its merges, and scores that rank them; read back it splits text as before, bytes included."""
    from hf_scale.gguf_export import write_gguf
    from hf_scale.tiny import generate_tasks
    from hf_scale.tiny.build import build_sentencepiece_tokenizer, build_tiny_model

    train, held_out = generate_tasks()
    texts = [" ".join(record.values()) for record in train]
    tokenizer = build_sentencepiece_tokenizer(texts, vocab_size=600)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    model = build_tiny_model(tokenizer)
    out = tmp_path / "sentencepiece.gguf"
    write_gguf(model, tokenizer, out, "f32", "sentencepiece")
    read_model, read_tokenizer = read_back(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(read_model.state_dict()[name], tensor), name  # f32: exact
    samples = [" ".join(record.values()) for record in held_out[:50]] + ["  two spaces, émoji 🙂, 中文 and 0x41\n"]
    assert any("<0x" in piece for piece in tokenizer.tokenize(samples[-1]))  # bytes fall back
    for text in samples:
        assert read_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert read_tokenizer.chat_template == tokenizer.chat_template


def test_a_model_of_another_architecture_is_refused_in_one_line_before_loading(tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "gpt2-shaped"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 1, "n_head": 4}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not read: the architecture is refused first")
    out = tmp_path / "gpt2.gguf"
    result = run_cli(capsys, "export", str(folder), str(out), "--format", "gguf")
    assert result.returncode != 0 and not out.exists()
    (line,) = result.stderr.strip().splitlines()
    assert "--format gguf writes the LLaMA architecture" in line and "gpt2 model (GPT2LMHeadModel)" in line


def test_a_gguf_export_needs_a_new_gguf_file_and_no_dtype(tiny_model_dir, tmp_path, capsys):
    for out, flags, message in (
        (tmp_path / "folder", [], "give a path ending in .gguf"),
        (tmp_path / "model.gguf", ["--dtype", "bfloat16"], "--dtype bfloat16 is for --format hf"),
    ):
        result = run_cli(capsys, "export", str(tiny_model_dir), str(out), "--format", "gguf", *flags)
        assert result.returncode != 0 and message in result.stderr and not out.exists()
    (tmp_path / "taken.gguf").write_bytes(b"")
    result = run_cli(capsys, "export", str(tiny_model_dir), str(tmp_path / "taken.gguf"), "--format", "gguf")
    assert "exists: hf-scale export does not overwrite" in result.stderr
    assert (tmp_path / "taken.gguf").read_bytes() == b""


# --- llama.cpp itself (opt-in: `make test-llama-cpp` installs llama-cpp-python, compiling llama.cpp, and runs these) --

INSTALL_LLAMA_CPP = "llama.cpp's check needs llama-cpp-python: make test-llama-cpp (compiles it: about 6 minutes)"


def llama_cpp_model(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp", reason=INSTALL_LLAMA_CPP)
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, seed=0, verbose=False)


def assert_llama_cpp_answers_as_transformers(path: Path, model, tokenizer, questions: list[str], max_new_tokens: int):
    """llama.cpp reads the file and, question by question: tokenizes the prompt the HF tokenizer's template writes
    into the same ids, answers greedily with the same ids as `model`, and answers through the file's own chat
    template (llama-cpp-python's chat completion) with the same text. Prints the answers side by side."""
    llm = llama_cpp_model(path)
    for question in questions:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) == ids, question
        (expected,) = greedy_answers(model, tokenizer, [question], max_new_tokens=max_new_tokens)
        answer = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            answer.append(token)
            if token == llm.token_eos() or len(answer) == max_new_tokens:
                break
        assert answer == expected, question
        completion = llm.create_chat_completion(
            messages, temperature=0.0, max_tokens=max_new_tokens, repeat_penalty=1.0
        )
        text, expected_text = completion["choices"][0]["message"]["content"], tokenizer.decode(expected, True)
        if expected_text.endswith("\ufffd"):  # the answer stops inside a character: llama.cpp completes it
            assert text.strip().startswith(expected_text.rstrip("\ufffd").strip()), question
        else:
            assert text.strip() == expected_text.strip(), question
        print(f"{path.name} | {question!r} | transformers {expected_text!r} | llama.cpp {text!r}")


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_llama_cpp_answers_held_out_prompts_as_the_run_does(gguf_type, trained_tiny_run, tmp_path, capsys):
    out = tmp_path / f"tiny-{gguf_type}.gguf"
    export_gguf(capsys, trained_tiny_run, out, gguf_type)
    model = AutoModelForCausalLM.from_pretrained(trained_tiny_run, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_run)
    with capsys.disabled():
        assert_llama_cpp_answers_as_transformers(out, model, tokenizer, held_out_instructions(20), 8)
