from transformers import AutoTokenizer

from hf_scale.data.cache import cached_tokenize_records, tokenization_key
from hf_scale.data.templates import ALPACA, get_template
from hf_scale.tiny import generate_tasks


def test_second_run_reuses_the_tokenized_set(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = generate_tasks()[0][:300]
    first, first_summary, hit = cached_tokenize_records(records, tokenizer, ALPACA, tmp_path, max_length=64)
    assert not hit
    second, second_summary, hit = cached_tokenize_records(records, tokenizer, ALPACA, tmp_path, max_length=64)
    assert hit and second.to_dict() == first.to_dict() and second_summary == first_summary
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_the_key_follows_every_input(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = generate_tasks()[0][:50]
    key = tokenization_key(records, tokenizer, ALPACA, max_length=64)
    assert key == tokenization_key(list(records), tokenizer, ALPACA, max_length=64)
    changed_record = [{**records[0], "output": records[0]["output"] + "!"}, *records[1:]]
    assert key != tokenization_key(changed_record, tokenizer, ALPACA, max_length=64)
    assert key != tokenization_key(records, tokenizer, get_template("alpaca_zh"), max_length=64)
    assert key != tokenization_key(records, tokenizer, ALPACA, max_length=65)
    assert key != tokenization_key(records, tokenizer, ALPACA, max_length=64, train_on_inputs=True)
    tokenizer.pad_token = tokenizer.eos_token
    assert key != tokenization_key(records, tokenizer, ALPACA, max_length=64)
