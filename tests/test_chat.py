"""`hf-scale chat`: prompts from the run's chat template, its stop tokens, and the three modes (--prompt, standard
input, a real terminal) answering held-out questions with a trained run; a LoRA run's adapter on its base."""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.chat import Chat, Conversation, answer_lines, prompt_ids, stop_token_ids
from hf_scale.cli import main
from hf_scale.data.multiturn import CONVERSATION_TEMPLATES, LLAMA2_CHAT_TEMPLATE
from hf_scale.tiny import generate_tasks
from hf_scale.tiny.build import build_sentencepiece_tokenizer
from tests.helpers import REPO_ROOT, launch_env, run_cli

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TMUX = shutil.which("tmux") or "/usr/bin/tmux"


def questions(count: int, start: int = 0) -> list[dict[str, str]]:
    """Held-out English records whose number is in the instruction: the Alpaca chat template writes a user turn as
    the instruction alone, so these are asked exactly as they were trained."""
    _, held_out = generate_tasks()
    records = [r for r in held_out if not r["input"] and r["instruction"].isascii()]
    return records[start : start + count]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def greedy(model, tokenizer, messages: list[dict[str, str]], max_new_tokens: int = 16) -> str:
    """The reference: the chat template's prompt greedy-decoded with plain transformers, stopping at EOS."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip()


def chat_command(run_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "hf_scale.cli", "chat", str(run_dir), *flags]


# --- the pure logic, on a tokenizer only ---------------------------------------------------------------------------


def test_stop_tokens_are_eos_and_the_templates_end_of_turn(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for template in (CONVERSATION_TEMPLATES["alpaca"], LLAMA2_CHAT_TEMPLATE):
        tokenizer.chat_template = template
        assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_prompt_is_the_template_with_one_bos_and_the_answer_prompt():
    # This tokenizer adds BOS by itself (as LLaMA-2's does): a prompt tokenized with special tokens gets two.
    tokenizer = build_sentencepiece_tokenizer()
    tokenizer.chat_template = CONVERSATION_TEMPLATES["alpaca"]
    messages = [{"role": "system", "content": "Answer with a number."}, user("What is 417 plus one?")]
    ids = prompt_ids(tokenizer, messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert (
        tokenizer.decode(ids[1:])
        == "Answer with a number.\n\n### Instruction:\nWhat is 417 plus one?\n\n### Response:\n"
    )


def test_history_is_shortened_from_the_oldest_pair_to_fit_the_context(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CONVERSATION_TEMPLATES["alpaca"]
    system = [{"role": "system", "content": "Be brief."}]
    pairs = [[user(f"What is {n} plus one?"), {"role": "assistant", "content": str(n + 1)}] for n in (101, 202)]
    last = [user("What is 303 plus one?")]
    messages = system + pairs[0] + pairs[1] + last
    without_oldest = len(prompt_ids(tokenizer, system + pairs[1] + last))
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=without_oldest + 4))
    chat = Chat(model=model, tokenizer=tokenizer, max_new_tokens=4)
    assert chat.fit(messages) == prompt_ids(tokenizer, system + pairs[1] + last)
    chat.context = 10_000
    assert chat.fit(messages) == prompt_ids(tokenizer, messages)


def test_lines_are_one_conversation_that_reset_and_system_change(tiny_model_dir):
    seen: list[list[dict[str, str]]] = []

    def reply(messages):
        seen.append([dict(turn) for turn in messages])
        return f"answer {len(seen)}"

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CONVERSATION_TEMPLATES["alpaca"]
    chat = SimpleNamespace(tokenizer=tokenizer, reply=reply)
    lines = ["first\n", "\n", "second\n", "/reset\n", "third\n", "/system Be brief.\n", "fourth\n", "/exit\n", "x\n"]
    answers = list(answer_lines(chat, lines, Conversation(system="S")))
    assert answers == ["answer 1", "answer 2", "answer 3", "answer 4"]
    system = {"role": "system", "content": "S"}
    assert seen[1] == [system, user("first"), {"role": "assistant", "content": "answer 1"}, user("second")]
    assert seen[2] == [system, user("third")]  # /reset keeps the system prompt
    assert seen[3] == [{"role": "system", "content": "Be brief."}, user("fourth")]


# --- errors before anything loads ----------------------------------------------------------------------------------


def test_a_folder_without_a_model_is_one_line_naming_it(tmp_path, tiny_model_dir, capsys):
    assert main(["chat", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"hf-scale: error: {tmp_path / 'missing'}: no such folder"
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path)
    shutil.copy(tiny_model_dir / "tokenizer_config.json", tmp_path)
    assert main(["chat", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"error: {tmp_path}: neither a model (config.json and model.safetensors) nor a PEFT adapter" in err


@pytest.mark.slow
def test_a_run_without_a_chat_template_is_refused(trained_tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_tiny_run, run)
    (run / "chat_template.jinja").unlink()
    result = run_cli(capsys, "chat", str(run), "--prompt", "What is 417 plus one?")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"hf-scale: error: {run}: its tokenizer has no chat template"), result.stderr
    assert "Traceback" not in result.stderr


# --- a trained run answering held-out questions --------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(trained_tiny_run):
    """The trained run loaded here with plain transformers, to compare the command's answers against."""
    model = AutoModelForCausalLM.from_pretrained(trained_tiny_run).eval()
    return model, AutoTokenizer.from_pretrained(trained_tiny_run)


@pytest.mark.slow
def test_prompt_prints_only_the_answer(trained_tiny_run, reference, capsys):
    records = questions(3)
    outputs = []
    for record in records:
        result = run_cli(capsys, "chat", str(trained_tiny_run), "--prompt", record["instruction"])
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout)
    # What transformers itself generates from the template's prompt, to the character, for every record...
    assert outputs == [greedy(*reference, [user(r["instruction"])]) + "\n" for r in records]
    # ...and mostly the right answers to questions the model never saw (it scores about 0.86; the standard-input
    # test below asks 19 more).
    correct = sum(output == record["output"] + "\n" for output, record in zip(outputs, records, strict=True))
    assert correct >= 2, list(zip(outputs, [r["output"] for r in records], strict=True))


@pytest.mark.slow
def test_standard_input_is_one_conversation_one_answer_per_line(trained_tiny_run, reference, capsys, monkeypatch):
    records = questions(20)
    lines = []
    for record in records[:-1]:
        lines += [record["instruction"], "/reset"]
    lines[-1] = records[-1]["instruction"]  # asked after records[-2] and its answer: a two-turn conversation
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    # The reference's budget of new tokens: an answer that does not end (the two-turn one may not) is cut alike.
    result = run_cli(capsys, "chat", str(trained_tiny_run), "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    answers = result.stdout.splitlines()
    assert len(answers) == len(records), result.stdout
    # Each answer after a /reset is the answer to its question alone, as transformers generates it...
    assert answers[:-1] == [greedy(*reference, [user(r["instruction"])]) for r in records[:-1]]
    # ...and mostly right (the model scores about 0.86 on held-out records; 15 of these 19 here).
    correct = sum(answer == record["output"] for answer, record in zip(answers, records[:-1], strict=False))
    assert correct >= 13, list(zip(answers, [r["output"] for r in records], strict=True))
    # Without a /reset the conversation goes on: the last question is answered after the one before and its answer.
    history = [user(records[-2]["instruction"]), {"role": "assistant", "content": answers[-2]}]
    assert answers[-1] == greedy(*reference, [*history, user(records[-1]["instruction"])])
    assert result.stderr.count("(conversation cleared)") == len(records) - 2


@pytest.mark.slow
@pytest.mark.parametrize("leave", ["/exit", "C-d", "C-c"])
def test_a_terminal_conversation_streams_answers(trained_tiny_run, tmp_path, leave):
    record = questions(1)[0]
    status = tmp_path / "status"
    env = launch_env()
    variables = " ".join(f"{name}={shlex.quote(env[name])}" for name in ("PYTHONPATH", "HF_SCALE_CACHE", "PATH"))
    command = f"cd {shlex.quote(str(REPO_ROOT))} && env {variables} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 "
    command += f"{shlex.join(chat_command(trained_tiny_run))}; echo $? > {shlex.quote(str(status))}"
    socket = f"hf-scale-chat-{uuid.uuid4().hex[:12]}"

    def tmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([TMUX, "-L", socket, *args], capture_output=True, text=True, timeout=30, check=False)

    def screen_when(predicate, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = tmux("capture-pane", "-p", "-J", "-t", "chat").stdout
            if predicate(screen):
                return screen
            time.sleep(0.3)
        raise AssertionError(f"the terminal never showed what was expected:\n{screen}")

    try:
        started = tmux("-f", "/dev/null", "new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", command)
        assert started.returncode == 0, started.stderr
        screen_when(lambda screen: screen.rstrip().endswith("you>"))
        tmux("send-keys", "-t", "chat", "-l", record["instruction"])
        tmux("send-keys", "-t", "chat", "Enter")
        screen = screen_when(lambda screen: screen.count("you>") == 2)
        assert f"you> {record['instruction']}\nmodel> {record['output']}\n" in screen, screen
        tmux("send-keys", "-t", "chat", "-l", "/help")
        tmux("send-keys", "-t", "chat", "Enter")
        screen = screen_when(lambda screen: screen.count("you>") == 3)
        assert "you> /help\nunknown command /help; commands: /reset" in screen, screen
        if leave.startswith("/"):
            tmux("send-keys", "-t", "chat", "-l", leave)
            tmux("send-keys", "-t", "chat", "Enter")
        else:
            tmux("send-keys", "-t", "chat", leave)
        deadline = time.monotonic() + 60
        while tmux("has-session", "-t", "chat").returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tmux("has-session", "-t", "chat").returncode != 0, "the chat did not end"
        assert status.read_text().strip() == "0"
    finally:
        tmux("kill-server")


# --- a LoRA run: the adapter on its base ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_lora_run_answers_with_its_adapter_on_its_base(trained_tiny_lora_run, capsys):
    from peft import PeftModel

    base_path = json.loads((trained_tiny_lora_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert not (trained_tiny_lora_run / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_lora_run)
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    base_answers = [greedy(base, tokenizer, [user(r["instruction"])], max_new_tokens=8) for r in questions(3)]
    adapted = PeftModel.from_pretrained(base, trained_tiny_lora_run).eval()
    expected = [greedy(adapted, tokenizer, [user(r["instruction"])], max_new_tokens=8) for r in questions(3)]
    assert expected != base_answers  # the adapter changes the answers, so the comparison below can tell
    for record, answer in zip(questions(3), expected, strict=True):
        flags = ["--prompt", record["instruction"], "--max-new-tokens", "8"]
        result = run_cli(capsys, "chat", str(trained_tiny_lora_run), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout == answer + "\n"


# --- a QLoRA run: its adapter on its base quantized as training loaded it ------------------------------------------


@pytest.mark.slow
def test_a_qlora_run_answers_on_its_quantized_base_on_cpu(trained_tiny_qlora_run, capsys):
    # bitsandbytes quantizes on the CPU too: the adapter answers on the NF4 weights it was trained with there as well.
    import bitsandbytes as bnb
    from peft import PeftModel

    from hf_scale.chat import load_model
    from hf_scale.export import trained_quantization
    from hf_scale.modeling import ModelArguments, quantization_config

    run = trained_tiny_qlora_run
    model = load_model(run, "adapter", torch.device("cpu"), trained_quantization(run))
    assert any(isinstance(module, bnb.nn.Linear4bit) for module in model.modules())
    base_path = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    settings = quantization_config(ModelArguments(lora_r=8, quantization="nf4"))
    base = AutoModelForCausalLM.from_pretrained(base_path, quantization_config=settings, device_map={"": "cpu"})
    reference = PeftModel.from_pretrained(base, run).eval()
    tokenizer = AutoTokenizer.from_pretrained(run)
    for record in questions(3):
        result = run_cli(capsys, "chat", str(run), "--prompt", record["instruction"], "--max-new-tokens", "8")
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout == greedy(reference, tokenizer, [user(record["instruction"])], max_new_tokens=8) + "\n"


class LoadStopped(Exception):
    """Raised by the recording loader: what the command would load is known, nothing is loaded."""


def record_loads(monkeypatch, raise_error: BaseException) -> list[tuple[tuple, dict]]:
    """`AutoModelForCausalLM.from_pretrained` replaced by one that records its arguments and raises `raise_error`."""
    calls: list[tuple[tuple, dict]] = []

    def from_pretrained(*args, **kwargs):
        calls.append((args, kwargs))
        raise raise_error

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return calls


@pytest.mark.slow
def test_a_qlora_run_on_cuda_loads_its_base_quantized_as_training_did(trained_tiny_qlora_run, monkeypatch):
    # A 13B QLoRA run trained on a 24 GB card does not fit it as a 16-bit base (26 GB): chat loads the base as the run
    # did, quantized, straight onto the GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = record_loads(monkeypatch, LoadStopped())
    with pytest.raises(LoadStopped):
        main(["chat", str(trained_tiny_qlora_run), "--prompt", "What is 417 plus one?"])
    (args, kwargs) = calls[-1]
    base = json.loads((trained_tiny_qlora_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert str(args[0]) == base
    settings = kwargs.get("quantization_config")
    assert settings is not None, kwargs
    trained = json.loads((trained_tiny_qlora_run / "run_config.json").read_text())["model"]
    assert (trained["quantization"], trained["double_quantization"]) == ("nf4", True)
    assert settings.load_in_4bit and settings.bnb_4bit_quant_type == "nf4" and settings.bnb_4bit_use_double_quant
    assert settings.bnb_4bit_compute_dtype == getattr(torch, trained["quantization_compute_dtype"])
    assert kwargs.get("device_map") == {"": "cuda"}  # one whole copy on the GPU, as loaded, never moved there after


@pytest.mark.slow
def test_out_of_gpu_memory_while_loading_is_one_line_saying_what_to_do(trained_tiny_qlora_run, monkeypatch, capsys):
    torch_message = (
        "CUDA out of memory. Tried to allocate 136.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which 3.06 MiB "
        "is free. Including non-PyTorch memory, this process has 23.64 GiB memory in use."
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    record_loads(monkeypatch, torch.OutOfMemoryError(torch_message))
    result = run_cli(capsys, "chat", str(trained_tiny_qlora_run), "--prompt", "What is 417 plus one?")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"hf-scale: error: {trained_tiny_qlora_run}: out of GPU memory loading"), line
    assert "quantized nf4" in line and "GPU 0 has a total capacity of 23.65 GiB of which 3.06 MiB is free" in line
    assert re.search(r"weights take about [\d.]+ (MiB|GiB)", line), line
    assert "--device cpu" in line


def test_device_cuda_without_one_is_refused(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_cli(capsys, "chat", str(tiny_model_dir), "--prompt", "x", "--device", "cuda")
    assert result.returncode == 2
    assert result.stderr.strip() == "hf-scale: error: --device cuda: torch sees no CUDA device here"
