"""Prompt templates: how an Alpaca record (`instruction`, `input`, `output`) becomes prompt and response text.

A template is data: a prompt wording with and without an `input`, and a response wording. The prompt is what
the model is given, the response what it learns to write; the boundary between them is where the label mask
starts. Templates never end the prompt with a space that the response's first word would absorb (LLaMA-2
chat puts that space at the start of the response instead), so tokenizing the whole text keeps the boundary
on a token boundary.

A response ends with EOS, which the tokenizer step appends, unless the template closes the turn itself: a
tokenizer's chat template ends an assistant turn with its own token (ChatML's `<|im_end|>`, LLaMA-3's
`<|eot_id|>`, LLaMA-2's `</s>`), and that token is then the end of the response, trained on, and where
generation stops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

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
    # The special token that `response` ends with and that closes the turn (a chat template's `<|im_end|>`);
    # empty: the tokenizer step appends EOS instead. Generation stops at it too.
    end_of_turn: str = ""

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
    if not system_prompt:
        return template
    if template is not LLAMA2_CHAT:
        raise ConfigError(f"system_prompt: template {name!r} has no system prompt; use llama2_chat")
    sys_block = "[INST] <<SYS>>\n{system}\n<</SYS>>\n\n"
    return replace(
        template,
        with_input=template.with_input.replace("[INST] ", sys_block, 1),
        without_input=template.without_input.replace("[INST] ", sys_block, 1),
        system=system_prompt,
    )


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
    """The tokenizer's chat template rendered once with placeholders: the prompt and the assistant's turn.

    The prompt is the generation prompt (`add_generation_prompt=True`). The response is what the same template
    renders after it for an answered turn, up to the first special token that follows the answer: the turn's
    end (`<|im_end|>`, `<|eot_id|>`, LLaMA-2's `</s>`), which the model must learn to write, since generation
    with the chat format stops there and not at EOS. What follows that token (ChatML's newline) separates turns
    and is not part of the response. A turn closed by no special token keeps its text without trailing
    whitespace, and EOS is appended to it as to any template's.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("template: chat_template needs a tokenizer that has a chat template")
    marker, answer = "\x00INSTRUCTION\x00", "\x00OUTPUT\x00"

    def render(user: str, output: str | None = None) -> str:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": user})
        if output is not None:
            messages.append({"role": "assistant", "content": output})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=output is None)
        return text.removeprefix(tokenizer.bos_token or "")  # the tokenizer step adds BOS once

    def escaped(text: str) -> str:  # literal braces survive str.format
        return text.replace("{", "{{").replace("}", "}}")

    prompt, answered = render(marker), render(marker, answer)
    if not answered.startswith(prompt) or answer not in answered[len(prompt) :]:
        raise ConfigError(
            "template: the tokenizer's chat template renders an answered conversation that does not start with the "
            "generation prompt followed by the answer, so the prompt trained on would differ from the prompt "
            "generated from; use a template that renders both alike, or a JSON user template"
        )
    before, after = answered[len(prompt) :].split(answer, 1)
    after, end_of_turn = through_end_of_turn(tokenizer, after)
    with_input = escaped(render(marker + "\n\n\x00INPUT\x00")).replace("\x00INPUT\x00", "{input}")
    return PromptTemplate(
        name=CHAT_TEMPLATE,
        with_input=with_input.replace(marker, "{instruction}"),
        without_input=escaped(prompt).replace(marker, "{instruction}"),
        response=escaped(before) + "{output}" + escaped(after),
        end_of_turn=end_of_turn,
    )


def through_end_of_turn(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[str, str]:
    """`text` (what a chat template writes after the answer) up to and with its first special token, and that token.

    Without a special token: `text` without trailing whitespace, and no end-of-turn token.
    """
    special = set(tokenizer.all_special_ids)
    # Added special tokens that are none of bos/eos/unk/pad (ChatML's <|im_end|>) are marked on the token itself.
    special.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            token = tokenizer.convert_ids_to_tokens(token_id)
            start = text.find(token)
            if start >= 0:  # special tokens are matched verbatim, so it is there
                return text[: start + len(token)], token
    return text.rstrip(), ""
