"""Prompt templates: how an Alpaca record (`instruction`, `input`, `output`) becomes prompt and response text.

The prompt is everything the model is given; the response is what it learns to write. They are kept apart
(never joined into one string before tokenization) so that the label mask can be exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_scale.errors import ConfigError


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt wording with and without an `input` field; `{instruction}` and `{input}` are filled in."""

    name: str
    with_input: str
    without_input: str

    def format_prompt(self, instruction: str, input_text: str = "") -> str:
        if input_text:
            return self.with_input.format(instruction=instruction, input=input_text)
        return self.without_input.format(instruction=instruction)


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

TEMPLATES: dict[str, PromptTemplate] = {ALPACA.name: ALPACA}


def get_template(name: str) -> PromptTemplate:
    """Return the template called `name`; an unknown name is a `ConfigError` that lists the known ones."""
    if name not in TEMPLATES:
        raise ConfigError(f"template: unknown template {name!r}; known templates: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[name]
