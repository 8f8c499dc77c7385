"""`hf-scale export`: a run as a plain HF folder that transformers loads with no hf_scale (and no peft) installed.

The exported folders are loaded in fresh Python processes where `import hf_scale` and `import peft` fail, and
their greedy answers to 50 held-out prompts are compared with those of the run itself, loaded as training left it
(for a LoRA run: the base with the adapter, unmerged, through peft).
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.cli import main
from hf_scale.export import export_run
from hf_scale.model_card import CARD_EXAMPLE_MESSAGE
from hf_scale.tiny import generate_tasks
from tests.helpers import assert_same_weights, assert_succeeded, run_cli, run_command, torchrun

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def held_out_instructions(count: int = 50) -> list[str]:
    # Records whose number is in the instruction itself (empty input): 50 different prompts.
    _, held_out = generate_tasks()
    instructions = [record["instruction"] for record in held_out if not record["input"]][:count]
    assert len(set(instructions)) == count
    return instructions


def greedy_answers(model, tokenizer, instructions, max_new_tokens=8):
    """Each instruction as one user turn through the chat template, answered greedily: the new token ids."""
    answers = []
    for instruction in instructions:
        messages = [{"role": "user", "content": instruction}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            output = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        answers.append(output[0, ids.shape[1] :].tolist())
    return answers


# Run in a fresh interpreter: neither hf_scale nor peft can be imported there, as on a machine without them.
WITHOUT_HF_SCALE = """
import sys

sys.modules["hf_scale"] = None
sys.modules["peft"] = None
for name in ("hf_scale", "peft"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{name} is importable")
"""

LOAD_AND_ANSWER = (
    WITHOUT_HF_SCALE
    + "import json\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
    + textwrap.dedent(inspect.getsource(greedy_answers))
    + """
folder, instructions = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
result = {
    "answers": greedy_answers(model, tokenizer, instructions),
    "dtype": str(model.dtype),
    "chat_template": tokenizer.chat_template,
    "modules": sorted(name for name in sys.modules if name.split(".")[0] in ("hf_scale", "peft") and sys.modules[name]),
}
print("RESULT " + json.dumps(result))
"""
)


def export(capsys, run_dir: Path, out: Path, *flags: str):
    return run_cli(capsys, "export", str(run_dir), str(out), *flags)


def load_without_hf_scale(folder: Path, instructions: list[str]) -> dict:
    result = run_command([sys.executable, "-c", LOAD_AND_ANSWER, str(folder), json.dumps(instructions)], timeout=300)
    assert_succeeded(result)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    loaded = json.loads(line.removeprefix("RESULT "))
    assert loaded["modules"] == []
    return loaded


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors" or p.suffix in PICKLE_SUFFIXES)


def safetensors_dtypes(file: Path) -> set[torch.dtype]:
    return {tensor.dtype for tensor in load_file(file).values()}


@pytest.mark.slow
def test_merged_lora_export_answers_as_the_adapter_does_without_hf_scale(trained_tiny_lora_run, tmp_path, capsys):
    from peft import PeftModel

    out = tmp_path / "merged"
    result = export(capsys, trained_tiny_lora_run, out, "--merge-lora")
    assert_succeeded(result)
    assert "LoRA merged into its base" in result.stdout and "float32" in result.stdout

    assert weight_files(out) == ["model.safetensors"]  # no adapter files, no pickles
    assert {"config.json", "generation_config.json", "tokenizer.json", "README.md"} <= {p.name for p in out.iterdir()}
    instructions = held_out_instructions()
    exported = load_without_hf_scale(out, instructions)

    base_path = json.loads((trained_tiny_lora_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_lora_run)
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    bare_answers = greedy_answers(base, tokenizer, instructions)
    adapted = PeftModel.from_pretrained(base, trained_tiny_lora_run).eval()
    adapter_answers = greedy_answers(adapted, tokenizer, instructions)

    assert adapter_answers != bare_answers  # the adapter changes the answers, so equality below means something
    assert exported["answers"] == adapter_answers
    base_dtype = AutoModelForCausalLM.from_pretrained(base_path).dtype
    assert exported["dtype"] == str(base_dtype)
    assert json.loads((out / "config.json").read_text())["dtype"] == str(base_dtype).removeprefix("torch.")
    assert exported["chat_template"] == tokenizer.chat_template
    assert exported["chat_template"] == (trained_tiny_lora_run / "chat_template.jinja").read_text()

    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "LoRA: r 8, alpha 16" in card and "merged into its base" in card


@pytest.mark.slow
def test_qlora_export_merges_into_the_dequantized_base_it_trained_on(trained_tiny_qlora_run, tmp_path, capsys):
    """A QLoRA run's adapter was trained on the NF4 base: the merged weights are that base dequantized plus the
    adapter's update, not the original weights plus the update."""
    import bitsandbytes as bnb

    from hf_scale.modeling import ModelArguments, quantization_config

    run = trained_tiny_qlora_run
    assert not (run / "model.safetensors").exists() and (run / "adapter_model.safetensors").is_file()
    out = tmp_path / "merged"
    assert_succeeded(result := export(capsys, run, out, "--merge-lora"))
    merged = load_file(out / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]

    base_path = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    settings = quantization_config(ModelArguments(lora_r=8, quantization="nf4"))
    quantized = AutoModelForCausalLM.from_pretrained(base_path, quantization_config=settings, device_map={"": "cpu"})
    q_proj = quantized.model.layers[0].self_attn.q_proj.weight
    dequantized = bnb.functional.dequantize_4bit(q_proj.data, q_proj.quant_state).float()
    adapter = load_file(run / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    update = adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"] * (16 / 8)  # alpha / r
    assert update.abs().max() > 1e-4  # the adapter trained
    assert torch.allclose(merged, dequantized + update, atol=1e-6)
    original = load_file(Path(base_path) / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert (merged - (original + update)).abs().max() > 1e-3  # NF4 rounding: the original is not what it trained on
    assert "LoRA merged into its base" in result.stdout


@pytest.mark.slow
def test_qlora_adapter_without_its_run_config_merges_only_when_told(trained_tiny_qlora_run, tmp_path, capsys):
    """An adapter folder records nothing of how its base was loaded: without the run's run_config.json (a search's
    best-model, a checkpoint copied elsewhere) a QLoRA adapter would be merged into the unquantized base, silently."""
    run, adapter = trained_tiny_qlora_run, tmp_path / "best-model"
    adapter.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(run / name, adapter / name)

    result = export(capsys, adapter, tmp_path / "refused", "--merge-lora")
    assert result.returncode == 2, result.stdout[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"hf-scale: error: {adapter}: no run_config.json beside it or one folder up"), line
    assert "--quantization nf4" in line and "--quantization none" in line
    assert not (tmp_path / "refused").exists()
    result = export(capsys, adapter, tmp_path / "refused", "--quantization", "nf4")  # it only says how to merge
    assert result.returncode == 2 and "holds a LoRA adapter: add --merge-lora" in result.stderr

    # Told the run's quantization, it merges the weights that the export reading run_config.json merges.
    assert_succeeded(export(capsys, adapter, tmp_path / "told", "--merge-lora", "--quantization", "nf4"))
    assert_succeeded(export(capsys, run, tmp_path / "recorded", "--merge-lora"))
    assert_same_weights(tmp_path / "recorded" / "model.safetensors", tmp_path / "told" / "model.safetensors")
    # ...which are not the unquantized merge that `--quantization none` asks for
    assert_succeeded(export(capsys, adapter, tmp_path / "unquantized", "--merge-lora", "--quantization", "none"))
    with pytest.raises(AssertionError):
        assert_same_weights(tmp_path / "recorded" / "model.safetensors", tmp_path / "unquantized" / "model.safetensors")

    # A flag that contradicts the run's own record is refused, not obeyed.
    result = export(capsys, run, tmp_path / "contradicted", "--merge-lora", "--quantization", "none")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"{run / 'run_config.json'} says quantization nf4" in line and "--quantization none" in line, line
    assert not (tmp_path / "contradicted").exists()


@pytest.mark.slow
def test_lora_export_converts_dtype_or_copies_the_adapter(trained_tiny_lora_run, tmp_path, capsys):
    result = export(capsys, trained_tiny_lora_run, tmp_path / "bf16", "--merge-lora", "--dtype", "bfloat16")
    assert_succeeded(result)
    assert safetensors_dtypes(tmp_path / "bf16" / "model.safetensors") == {torch.bfloat16}

    result = export(capsys, trained_tiny_lora_run, tmp_path / "adapter")
    assert_succeeded(result)
    assert "needs peft and the base model" in result.stdout
    assert weight_files(tmp_path / "adapter") == ["adapter_model.safetensors"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == (
        trained_tiny_lora_run / "adapter_model.safetensors"
    ).read_bytes()
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "library_name: peft" in card and "AutoPeftModelForCausalLM" in card

    result = export(capsys, trained_tiny_lora_run, tmp_path / "refused", "--dtype", "float16")
    assert result.returncode == 2 and "add --merge-lora" in result.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_full_run_export_answers_as_the_run_and_its_card_tells_the_run(trained_tiny_run, tmp_path, capsys):
    out = tmp_path / "exported"
    result = export(capsys, trained_tiny_run, out)
    assert_succeeded(result)
    assert "full model, float32" in result.stdout
    assert weight_files(out) == ["model.safetensors"]

    instructions = held_out_instructions()
    exported = load_without_hf_scale(out, instructions)
    model = AutoModelForCausalLM.from_pretrained(trained_tiny_run).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_run)
    assert exported["answers"] == greedy_answers(model, tokenizer, instructions)
    assert exported["chat_template"] == tokenizer.chat_template

    metrics = json.loads((trained_tiny_run / "metrics.json").read_text())
    training = json.loads((trained_tiny_run / "run_config.json").read_text())["training"]
    card = (out / "README.md").read_text()
    assert f"- learning rate: {training['learning_rate']} " in card
    exact_match = f"{metrics['eval_before_exact_match']:.3f} -> {metrics['eval_after_exact_match']:.3f}"
    assert f"- exact match (before -> after training): {exact_match}" in card
    assert metrics["eval_after_exact_match"] > 0.5  # a trained run, so the numbers above are not all zeros
    assert f"{metrics['eval_after_loss']:.4g}" in card

    # The card's loading example, run as written where hf_scale cannot be imported, answers as the run does.
    (example,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    ran = run_command([sys.executable, "-c", WITHOUT_HF_SCALE + example], timeout=300)
    assert_succeeded(ran)
    messages = [{"role": "user", "content": CARD_EXAMPLE_MESSAGE}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    expected = model.generate(**ids, max_new_tokens=64, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert ran.stdout.strip() == tokenizer.decode(expected, skip_special_tokens=True).strip() != ""


def test_a_folder_without_run_records_exports_with_a_card_that_says_so(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is taken
    assert export_run(tiny_model_dir, out, dtype="float16") == out
    printed = capsys.readouterr().out
    assert f"to {out}: full model, float16" in printed
    card = (out / "README.md").read_text()
    assert "No run_config.json" in card and "No metrics.json" in card
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float16 and model.config.use_cache
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left beside it


def test_refuses_to_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(tiny_model_dir), str(out)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("hf-scale: error:") and f"{out} exists and is not empty" in stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_refuses_a_folder_with_no_model_before_any_work(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "no-model"
    run_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, run_dir / name)
    (run_dir / "metrics.json").write_text("{}")
    assert main(["export", str(run_dir), str(tmp_path / "out")]) == 2
    stderr = capsys.readouterr().err
    assert f"hf-scale: error: {run_dir}: neither a model" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero3_checkpoint_without_consolidated_weights_exports_the_trained_weights(tmp_path, tiny_model_dir, capsys):
    # The zero3 preset saves consolidated weights (stage3_gather_16bit_weights_on_model_save) next to the ZeRO shards
    # in checkpoint-20. Without model.safetensors, that folder is what a ZeRO-3 config with the gather off writes:
    # the export must rebuild the same weights from the shards alone.
    run_dir = tmp_path / "run"
    flags = ["--zero_preset", "zero3", "--max_steps", "20", "--save_steps", "20", "--eval_strategy", "no"]
    command = torchrun("recipes/finetune_llama2.py", "--output_dir", str(run_dir), *flags, "--exact_match_samples", "0")
    result = run_command(command, timeout=600)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    shards = tmp_path / "checkpoint-20"
    shutil.copytree(run_dir / "checkpoint-20", shards, ignore=shutil.ignore_patterns("model.safetensors"))
    assert list((shards / "global_step20").glob("*_model_states.pt"))

    out = tmp_path / "exported"
    result = export(capsys, shards, out)
    assert_succeeded(result)
    assert "consolidated from the DeepSpeed ZeRO checkpoint" in result.stdout
    assert weight_files(out) == ["model.safetensors"]
    assert_same_weights(run_dir / "model.safetensors", out / "model.safetensors")  # the run's final weights
    initial, exported = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert max((exported[name] - initial[name]).abs().max().item() for name in initial) > 1e-3  # not the initial ones
    assert "a checkpoint at step 20" in (out / "README.md").read_text()
