"""Chat tokenizers built locally from the tiny one: what chat models ship, without the hub.

- ChatML (Qwen and others): an assistant turn ends with `<|im_end|>`, which is not EOS (`<|endoftext|>`).
- LLaMA-2 chat: Meta's own template, verbatim: an assistant turn ends with `" " + eos_token`.
"""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hf_scale.data.multiturn import LLAMA2_CHAT_TEMPLATE

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_tokenizer(tiny_model_dir) -> PreTrainedTokenizerBase:
    """The tiny tokenizer with ChatML's special tokens and template, and `<|endoftext|>` as EOS."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], special_tokens=True)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.chat_template = CHATML_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") != tokenizer.eos_token_id
    return tokenizer


def llama2_tokenizer(tiny_model_dir) -> PreTrainedTokenizerBase:
    """The tiny tokenizer (BOS `<s>`, EOS `</s>`, as LLaMA-2's) with LLaMA-2 chat's template."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = LLAMA2_CHAT_TEMPLATE
    return tokenizer
