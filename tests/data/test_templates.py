import json

import pytest
from transformers import AutoTokenizer

from hf_scale.data.templates import ALPACA, get_template
from hf_scale.errors import ConfigError


def test_registry_and_unknown_names():
    assert get_template("alpaca") is ALPACA
    assert "### 指令:" in get_template("alpaca_zh").format_prompt("你好")
    with pytest.raises(ConfigError, match="unknown template 'vicuna'; known templates: alpaca, alpaca_zh, llama2_chat"):
        get_template("vicuna")


def test_llama2_chat_with_and_without_system_prompt():
    plain = get_template("llama2_chat")
    assert plain.format_prompt("Hi") == "[INST] Hi [/INST]"
    assert plain.format_response("Hello") == " Hello"  # the space belongs to the response's first token
    chat = get_template("llama2_chat", system_prompt="Be brief. {not a placeholder}")
    assert (
        chat.format_prompt("Hi", "ctx")
        == "[INST] <<SYS>>\nBe brief. {not a placeholder}\n<</SYS>>\n\nHi\n\nctx [/INST]"
    )
    with pytest.raises(ConfigError, match="system_prompt: template 'alpaca' has no system prompt"):
        get_template("alpaca", system_prompt="x")


def test_user_templates_from_a_config_string():
    spec = json.dumps(
        {
            "with_input": "Q: {instruction} ({input})\nA:",
            "without_input": "Q: {instruction}\nA:",
            "response": " {output}",
        }
    )
    template = get_template(spec)
    assert template.format_prompt("hi", "x") == "Q: hi (x)\nA:" and template.format_response("yo") == " yo"
    with pytest.raises(ConfigError, match="needs with_input and without_input"):
        get_template(json.dumps({"with_input": "{instruction}"}))
    with pytest.raises(ConfigError, match="unknown placeholder 'question'"):
        get_template(json.dumps({"with_input": "{question}", "without_input": "{instruction}"}))


def test_the_tokenizers_own_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="needs a tokenizer that has a chat template"):
        get_template("chat_template", tokenizer=tokenizer)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    template = get_template("chat_template", system_prompt="Be {brief}.", tokenizer=tokenizer)
    assert template.format_prompt("Add one.", "41") == "<|system|>Be {brief}.\n<|user|>Add one.\n\n41\n<|assistant|>"
    assert template.format_prompt("Add one.") == "<|system|>Be {brief}.\n<|user|>Add one.\n<|assistant|>"
