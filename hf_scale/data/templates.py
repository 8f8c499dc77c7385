"""Prompt templates: how an Alpaca record (`instruction`, `input`, `output`) becomes prompt and response text.

A template is data: a prompt wording with and without an `input`, and a response wording. The prompt is what
the model is given, the response what it learns to write; the boundary between them is where the label mask
starts. Templates never end the prompt with a space that the response's first word would absorb (LLaMA-2
chat puts that space at the start of the response instead), so tokenizing the whole text keeps the boundary
on a token boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from hf_scale.errors import ConfigError


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt wording with and without `input` (`{instruction}`, `{input}`, `{system}`), and a response wording."""

    name: str
    with_input: str
    without_input: str
    response: str = "{output}"
    system: str = ""

    def format_prompt(self, instruction: str, input_text: str = "") -> str:
        wording = self.with_input if input_text else self.without_input
        return wording.format(instruction=instruction, input=input_text, system=self.system)

    def format_response(self, output: str) -> str:
        return self.response.format(output=output)


ALPACA = PromptTemplate(
    name="alpaca",
    # The Stanford Alpaca wording, verbatim.
    with_input=(
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    ),
    without_input=(
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:\n"
    ),
)

ALPACA_ZH = PromptTemplate(
    name="alpaca_zh",
    # The wording of the Chinese Alpaca projects (Chinese-LLaMA-Alpaca), for Chinese instruction sets.
    with_input=(
        "以下是描述任务的指令，以及提供进一步上下文的输入。请编写适当完成请求的回答。\n\n"
        "### 指令:\n{instruction}\n\n### 输入:\n{input}\n\n### 回答:\n"
    ),
    without_input="以下是描述任务的指令。请编写适当完成请求的回答。\n\n### 指令:\n{instruction}\n\n### 回答:\n",
)

LLAMA2_CHAT = PromptTemplate(
    name="llama2_chat",
    # Meta's LLaMA-2 chat format without the BOS (the tokenizer step adds it once). The space after [/INST]
    # belongs to the response, so that " word" stays one token inside the response.
    with_input="[INST] {instruction}\n\n{input} [/INST]",
    without_input="[INST] {instruction} [/INST]",
    response=" {output}",
)

TEMPLATES: dict[str, PromptTemplate] = {t.name: t for t in (ALPACA, ALPACA_ZH, LLAMA2_CHAT)}
CHAT_TEMPLATE = "chat_template"  # the tokenizer's own chat template


def get_template(
    name: str, system_prompt: str | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> PromptTemplate:
    """The template called `name`, a user template given as JSON, or the tokenizer's chat template.

    - a registered name: alpaca, alpaca_zh, llama2_chat (the only one that takes `system_prompt`);
    - `chat_template`: the tokenizer's own chat template, rendered once with placeholders;
    - a JSON object `{"with_input": ..., "without_input": ..., "response": ...}` for a user template.
    An unknown name is a `ConfigError` that lists the known ones.

    Example:
        template = get_template("llama2_chat", system_prompt="You are a helpful assistant.")
        prompt = template.format_prompt("Translate to French", "good morning")
    """
    if name.lstrip().startswith("{"):
        return _user_template(name)
    if name == CHAT_TEMPLATE:
        return _chat_template(tokenizer, system_prompt)
    if name not in TEMPLATES:
        known = ", ".join([*sorted(TEMPLATES), CHAT_TEMPLATE, "or a JSON user template"])
        raise ConfigError(f"template: unknown template {name!r}; known templates: {known}")
    template = TEMPLATES[name]
    if system_prompt:
        if template is not LLAMA2_CHAT:
            raise ConfigError(f"system_prompt: template {name!r} has no system prompt; use llama2_chat")
        sys_block = "[INST] <<SYS>>\n{system}\n<</SYS>>\n\n"
        template = PromptTemplate(
            name=template.name,
            with_input=template.with_input.replace("[INST] ", sys_block, 1),
            without_input=template.without_input.replace("[INST] ", sys_block, 1),
            response=template.response,
            system=system_prompt,
        )
    return template


def _user_template(text: str) -> PromptTemplate:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"template: a user template must be a JSON object: {error}") from None
    required = {"with_input", "without_input"}
    if not isinstance(fields, dict) or not required <= set(fields) or set(fields) - {*required, "response"}:
        raise ConfigError("template: a user template needs with_input and without_input (and may set response)")
    template = PromptTemplate(name="user", **fields)
    try:
        template.format_prompt("i", "x"), template.format_prompt("i"), template.format_response("o")
    except (KeyError, IndexError) as error:
        raise ConfigError(
            f"template: unknown placeholder {error} (use {{instruction}}, {{input}}, {{output}})"
        ) from None
    return template


def _chat_template(tokenizer: PreTrainedTokenizerBase | None, system_prompt: str | None) -> PromptTemplate:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("template: chat_template needs a tokenizer that has a chat template")
    marker = "\x00INSTRUCTION\x00"

    def render(user: str) -> str:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
            text = text[len(tokenizer.bos_token) :]  # the tokenizer step adds BOS once
        return text.replace("{", "{{").replace("}", "}}").replace(marker, "{instruction}")

    with_input = render(marker + "\n\n\x00INPUT\x00").replace("\x00INPUT\x00", "{input}")
    return PromptTemplate(name=CHAT_TEMPLATE, with_input=with_input, without_input=render(marker))
