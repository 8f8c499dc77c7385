import pytest
from transformers import AutoTokenizer

from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, prompt_ids, tokenize_records

RECORDS = [
    {"instruction": "Add one to the number.", "input": "41", "output": "42"},
    {"instruction": "What number comes after 9?", "input": "", "output": "10"},
    {"instruction": "给这个数减一。", "output": "7"},  # no `input` field at all
]


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_labels_are_exactly_the_response_and_eos(tokenizer):
    dataset, summary = tokenize_records(RECORDS, tokenizer, ALPACA, max_length=256)
    assert summary.examples == 3 and summary.truncated == 0 and summary.dropped_no_response == 0
    for record, example in zip(RECORDS, dataset, strict=True):
        prompt = prompt_ids(tokenizer, ALPACA.format_prompt(record["instruction"], record.get("input", "")))
        response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert example["input_ids"] == prompt + response
        assert example["labels"] == [IGNORE_INDEX] * len(prompt) + response
        assert example["input_ids"][0] == tokenizer.bos_token_id
        assert example["input_ids"].count(tokenizer.bos_token_id) == 1
        assert tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX]) == record["output"] + "</s>"


def test_eos_is_trained_on_when_pad_is_eos(tokenizer):
    tokenizer.pad_token = tokenizer.eos_token
    dataset, _ = tokenize_records(RECORDS[:1], tokenizer, ALPACA, max_length=256)
    assert dataset[0]["labels"][-1] == tokenizer.eos_token_id


def test_long_records_are_cut_or_dropped_and_counted(tokenizer):
    prompt_length = len(prompt_ids(tokenizer, ALPACA.format_prompt(RECORDS[0]["instruction"], "41")))
    long_response = {"instruction": RECORDS[0]["instruction"], "input": "41", "output": "1234567"}
    dataset, summary = tokenize_records([long_response, RECORDS[0]], tokenizer, ALPACA, max_length=prompt_length + 3)
    assert summary.truncated == 1 and summary.examples == 2
    assert dataset[0]["labels"][-3:] == dataset[0]["input_ids"][-3:]  # the kept response tokens are trained on
    assert dataset[1]["input_ids"][-1] == tokenizer.eos_token_id  # "42" and its EOS fit exactly: not cut
    _, summary = tokenize_records([long_response], tokenizer, ALPACA, max_length=prompt_length)
    assert summary.examples == 0 and summary.dropped_no_response == 1
    assert "1 dropped because the prompt alone fills max_length" in str(summary)
