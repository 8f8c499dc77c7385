import json

import pytest
from transformers import AutoTokenizer

from hf_scale.data.templates import ALPACA, get_template
from hf_scale.errors import ConfigError
from tests.data.chat_tokenizers import chatml_tokenizer, llama2_tokenizer


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
    # No special token closes this template's turn: the response is the output alone, and EOS is appended to it.
    assert template.format_response("{42}") == "{42}" and template.end_of_turn == ""


def test_a_chat_templates_response_closes_the_turn_as_the_template_does(tiny_model_dir):
    # ChatML: the turn ends with <|im_end|>, not EOS; the newline after it separates turns and is not trained.
    chatml = get_template("chat_template", system_prompt="Be brief.", tokenizer=chatml_tokenizer(tiny_model_dir))
    assert chatml.format_prompt("Add one.", "41") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd one.\n\n41<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chatml.format_response("{42}") == "{42}<|im_end|>"
    assert chatml.end_of_turn == "<|im_end|>"
    # LLaMA-2 chat: Meta's template ends an assistant turn with " </s>", so the response already holds EOS.
    llama2 = get_template("chat_template", tokenizer=llama2_tokenizer(tiny_model_dir))
    assert llama2.format_prompt("Hi") == "[INST] Hi [/INST]"  # BOS is the tokenizer step's to add
    assert llama2.format_response("Hello") == " Hello </s>"
    assert llama2.end_of_turn == "</s>"


def test_a_chat_template_that_renders_the_prompt_differently_once_answered_is_refused(tiny_model_dir):
    tokenizer = chatml_tokenizer(tiny_model_dir)
    # The generation prompt says "assistant", an answered turn "bot": training and generation would disagree.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "'<|im_start|>' + message['role']", "'<|im_start|>' + message['role'].replace('assistant', 'bot')"
    )
    with pytest.raises(ConfigError, match="does not start with the generation prompt"):
        get_template("chat_template", tokenizer=tokenizer)
