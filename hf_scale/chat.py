"""`hf-scale chat RUN_DIR`: talk to a trained run, its prompts written by the chat template it was trained with.

A run folder holds a full model (config.json + weights) or a PEFT adapter (adapter_config.json naming its base;
a QLoRA run's base is quantized as its run_config.json says), and always the tokenizer with the run's chat template
(chat_template.jinja). Three modes: `--prompt TEXT` (one
answer on stdout), standard input that is not a terminal (one user turn per line, one answer per line), and an
interactive REPL with streamed answers and the commands /reset, /system TEXT and /exit.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    TextStreamer,
    set_seed,
)

from hf_scale.data.templates import through_end_of_turn
from hf_scale.errors import ConfigError, HfScaleError
from hf_scale.export import adapter_base, trained_quantization
from hf_scale.gguf_source import model_folder
from hf_scale.memory import quantized_base_bytes
from hf_scale.model_shapes import model_shape
from hf_scale.modeling import COMPUTE_DTYPES, ModelArguments, quantization_config

Turn = dict[str, str]

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# An answer no template rewrites, to find what a template writes after an answer.
ANSWER_MARKER = "hf-scale-answer"
COMMANDS_HELP = "commands: /reset (new conversation), /system TEXT (system prompt), /exit"


@dataclass
class Conversation:
    """The system prompt (kept by /reset) and the user/assistant turns so far."""

    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[Turn]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns


def run_kind(run_dir: Path) -> str:
    """ "adapter" or "model": what `run_dir` holds; a clear error naming what is missing, before loading anything."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such folder")
    if not any((run_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{run_dir}: no tokenizer (tokenizer.json or tokenizer_config.json) to chat with")
    if (run_dir / "adapter_config.json").is_file():
        if not any((run_dir / name).is_file() for name in ADAPTER_WEIGHT_FILES):
            raise ConfigError(f"{run_dir}: adapter_config.json but no adapter weights (adapter_model.safetensors)")
        return "adapter"
    if (run_dir / "config.json").is_file() and any((run_dir / name).is_file() for name in WEIGHT_FILES):
        return "model"
    raise ConfigError(
        f"{run_dir}: neither a model (config.json and model.safetensors) nor a PEFT adapter (adapter_config.json "
        "and adapter_model.safetensors); give a run's output_dir, one of its checkpoints or an export"
    )


def load_tokenizer(run_dir: Path) -> PreTrainedTokenizerBase:
    """The run's tokenizer; it must have the run's chat template, the only record of how prompts were written."""
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{run_dir}: its tokenizer has no chat template (no chat_template.jinja), so a conversation cannot be "
            "written as the model was trained (a run trained with a JSON user template has none); add a "
            "chat_template.jinja to the folder that renders prompts as training did"
        )
    return tokenizer


def chat_device(choice: str) -> torch.device:
    """The device of `--device`: auto is the GPU when torch sees one."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def load_model(run_dir: Path, kind: str, device: torch.device, quantized: ModelArguments | None) -> torch.nn.Module:
    """The run's model on `device` in eval mode: a full model, or an adapter on the base its config names (unmerged).

    A QLoRA run's base (`quantized`: its run's model arguments) is quantized as training loaded it: the adapter
    answers on the weights it was trained with, and a base that fit its GPU only quantized (a 13B on 24 GB) fits it
    again. bitsandbytes quantizes on the CPU too. Weights load straight onto `device` (`device_map`): a quantized
    model cannot be moved after loading, and a 16-bit one need not be held twice.
    """
    placement = {"device_map": {"": device.type}}
    if kind == "model":
        return AutoModelForCausalLM.from_pretrained(run_dir, **placement).eval()
    from peft import PeftModel

    base = adapter_base(run_dir)
    if quantized is not None:
        placement["quantization_config"] = quantization_config(quantized)
        placement["dtype"] = quantized.dtype
    try:
        base_model = AutoModelForCausalLM.from_pretrained(base, **placement)
    except OSError as error:
        raise ConfigError(f"{run_dir}: cannot load the base model {base!r} its adapter names: {error}") from error
    return PeftModel.from_pretrained(base_model, run_dir).eval()


def weights_size(name: str | Path, quantized: ModelArguments | None) -> str | None:
    """About how much memory the weights of the causal LM `name` take once loaded (quantized as `quantized` says,
    the rest in the dtype it loads in), "24.2 GiB"; None when its config cannot be read as a LLaMA-class model's."""
    try:
        shape = model_shape(str(name))
        dtype = AutoConfig.from_pretrained(name).dtype or torch.float32  # what dtype "auto" loads
    # Only a figure for the message: a config it cannot read (or without LLaMA's attribute names) leaves it out.
    except (ConfigError, OSError, ValueError, AttributeError):
        return None
    if quantized is None:
        total = shape.parameters * dtype.itemsize
    else:
        if quantized.dtype != "auto":
            dtype = COMPUTE_DTYPES[quantized.dtype]
        total = quantized_base_bytes(shape, quantized.quantization, quantized.double_quantization, dtype.itemsize)
    return f"{total / 2**30:.1f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"


def out_of_memory_message(
    run_dir: Path, kind: str, device: torch.device, quantized: ModelArguments | None, error: torch.OutOfMemoryError
) -> str:
    """One line for an out-of-memory while loading: what was loaded, how big, what the GPU had, what to do."""
    name = run_dir if kind == "model" else adapter_base(run_dir)
    what = "its model" if kind == "model" else f"its base {name}"
    if quantized is not None:
        what += f" quantized {quantized.quantization}"
    size = weights_size(name, quantized)
    # torch's own figures for the device, when it gave them: whether something else holds the memory
    found = re.search(r"GPU \d+ has a total capacity of [\d.]+ \w+ of which [\d.]+ \w+ is free", str(error))
    figures = "; ".join(part for part in (size and f"the weights take about {size}", found and found.group(0)) if part)
    return (
        f"{run_dir}: out of GPU memory loading {what} onto {device.type}{f' ({figures})' if figures else ''}: free "
        "the GPU or use one with more memory, or chat on the CPU with --device cpu (slower)"
    )


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Turn]) -> list[int]:
    """The token ids generation starts from: the conversation rendered by the chat template, then the answer prompt."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as error:  # the template refuses the conversation, e.g. a system turn it does not take
        raise ConfigError(f"the run's chat template refuses this conversation: {error}") from error
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes BOS itself


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS and the special token the chat template closes an assistant turn with (LLaMA-2's `</s>`, `<|im_end|>`)."""
    user = {"role": "user", "content": "?"}
    prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    answered = tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": ANSWER_MARKER}], add_generation_prompt=False, tokenize=False
    )
    after_answer = answered[len(prompt) :].split(ANSWER_MARKER, 1)[-1]
    _, end_of_turn = through_end_of_turn(tokenizer, after_answer)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if end_of_turn:
        ids.append(tokenizer.convert_tokens_to_ids(end_of_turn))
    return list(dict.fromkeys(ids))


@dataclass
class Chat:
    """A loaded run and how to decode; `reply` gives the assistant's next answer to a conversation."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9

    def __post_init__(self) -> None:
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.context = getattr(self.model.config, "max_position_embeddings", None)

    def fit(self, messages: list[Turn]) -> list[int]:
        """Prompt ids of `messages`, without their oldest user/assistant pairs while the answer would not fit in the
        model's context (the system turn stays)."""
        system, dialog = (messages[:1], messages[1:]) if messages[0]["role"] == "system" else ([], messages)
        ids = prompt_ids(self.tokenizer, messages)
        while self.context and len(ids) + self.max_new_tokens > self.context and len(dialog) > 2:
            dialog = dialog[2:]
            ids = prompt_ids(self.tokenizer, system + dialog)
        if self.context and len(ids) >= self.context:
            raise ConfigError(f"the message is {len(ids)} tokens, more than the model's context of {self.context}")
        return ids

    def reply(self, messages: list[Turn], streamer: TextStreamer | None = None) -> str:
        """The answer to `messages` (ending with a user turn): the new tokens decoded, special tokens skipped."""
        ids = torch.tensor([self.fit(messages)], device=self.model.device)
        max_new_tokens = self.max_new_tokens
        if self.context:
            max_new_tokens = min(max_new_tokens, self.context - ids.shape[1])
        # Greedy unsets the sampling settings: a generation_config.json that samples (LLaMA-2 chat's) would otherwise
        # be merged in (warnings, or top_k sampling left on).
        sampling = (
            dict(temperature=self.temperature, top_p=self.top_p)
            if self.do_sample
            else dict(temperature=None, top_p=None, top_k=None)
        )
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=self.do_sample,
                eos_token_id=self.stop_ids,
                pad_token_id=pad_id,
                streamer=streamer,
                **sampling,
            )
        return self.tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip()


def slash_command(line: str, conversation: Conversation, chat: Chat) -> tuple[bool, str]:
    """Apply a `/command` line to `conversation`: (whether to go on, a message for the user)."""
    name, _, argument = line.strip().partition(" ")
    if name in ("/exit", "/quit"):
        return False, ""
    if name == "/reset":
        conversation.turns.clear()
        return True, "(conversation cleared" + (", system prompt kept)" if conversation.system else ")")
    if name == "/system":
        system = argument.strip() or None
        if system:  # refused now rather than at the next message, when the template takes no system turn
            prompt_ids(chat.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "?"}])
        conversation.system, conversation.turns = system, []
        return True, "(system prompt set, conversation cleared)" if system else "(system prompt removed)"
    return True, f"unknown command {name}; {COMMANDS_HELP}"


def answer_lines(chat: Chat, lines: Iterable[str], conversation: Conversation) -> Iterator[str]:
    """One answer per line of `lines`, all one conversation; /commands apply and yield nothing (messages go to
    stderr, so that stdout holds the answers only)."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            go_on, message = slash_command(line, conversation, chat)
            if message:
                print(message, file=sys.stderr)
            if not go_on:
                return
            continue
        conversation.turns.append({"role": "user", "content": line})
        answer = chat.reply(conversation.messages())
        conversation.turns.append({"role": "assistant", "content": answer})
        yield answer


def repl(chat: Chat, conversation: Conversation) -> None:
    """The interactive loop: `you> ` reads a message, `model> ` streams the answer; /exit, EOF or Ctrl-C leave."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"{COMMANDS_HELP} (or Ctrl-D)")
    streamer = TextStreamer(chat.tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                return
            if not line:
                continue
            if line.startswith("/"):
                try:
                    go_on, message = slash_command(line, conversation, chat)
                except ConfigError as error:
                    go_on, message = True, f"error: {error}"
                if message:
                    print(message)
                if not go_on:
                    return
                continue
            conversation.turns.append({"role": "user", "content": line})
            print("model> ", end="", flush=True)
            try:
                answer = chat.reply(conversation.messages(), streamer=streamer)
            except ConfigError as error:
                conversation.turns.pop()
                print(f"error: {error}")
                continue
            conversation.turns.append({"role": "assistant", "content": answer})
    except KeyboardInterrupt:
        print()


def chat_with_run(options: argparse.Namespace) -> None:
    """`hf-scale chat`: load the run in `options.run_dir` and answer `--prompt`, standard input, or a terminal."""
    run_dir = model_folder(options.run_dir)
    device = chat_device(options.device)
    kind = run_kind(run_dir)
    tokenizer = load_tokenizer(run_dir)
    conversation = Conversation(system=options.system)
    if options.system:  # a template that takes no system turn fails here, before the model is loaded
        prompt_ids(tokenizer, [{"role": "system", "content": options.system}, {"role": "user", "content": "?"}])
    if options.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be positive, got {options.max_new_tokens}")
    quantized = trained_quantization(run_dir) if kind == "adapter" else None
    try:
        model = load_model(run_dir, kind, device, quantized)
    except torch.OutOfMemoryError as error:
        raise HfScaleError(out_of_memory_message(run_dir, kind, device, quantized, error)) from None
    chat = Chat(
        model=model,
        tokenizer=tokenizer,
        max_new_tokens=options.max_new_tokens,
        do_sample=options.do_sample,
        temperature=options.temperature,
        top_p=options.top_p,
    )
    if options.do_sample:
        set_seed(options.seed)
    if options.prompt is not None:
        conversation.turns.append({"role": "user", "content": options.prompt})
        print(chat.reply(conversation.messages()))
    elif not sys.stdin.isatty():
        for answer in answer_lines(chat, sys.stdin, conversation):
            print(answer, flush=True)
    else:
        repl(chat, conversation)
