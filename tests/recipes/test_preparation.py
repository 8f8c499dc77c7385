"""The recipe's data step (hf_scale/recipes/preparation.py): the tokenizer's template kept; a source's examples made
once, by the first process, and read back by every other process and relaunch."""

import json
import os
import shutil
import time

import pytest

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.arguments import DataArguments
from hf_scale.data.templates import ALPACA
from hf_scale.modeling import ModelArguments, load_tokenizer
from hf_scale.recipes.preparation import parse_recipe_arguments, prepare_data, prepare_source
from hf_scale.tiny import generate_tasks
from tests.data.chat_tokenizers import CHATML_TEMPLATE, chatml_tokenizer
from tests.helpers import assert_succeeded, run_command, torchrun


def test_template_chat_template_keeps_the_models_own_template_for_the_saved_tokenizer(tmp_path, tiny_model_dir):
    """A chat model trained on Alpaca records through its own template (`--template chat_template`) saves that
    template with its tokenizer: `hf-scale chat` and `apply_chat_template` prompt the run as it was trained."""
    model_dir = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model_dir)
    chatml_tokenizer(tiny_model_dir).save_pretrained(model_dir)  # a ChatML template beside the weights
    records = tmp_path / "records.json"
    records.write_text(json.dumps(generate_tasks()[0][:40]))
    flags = ["--model_name_or_path", str(model_dir), "--dataset", str(records), "--template", "chat_template"]
    flags += ["--output_dir", str(tmp_path / "run"), "--exact_match_samples", "2"]
    model_args, data_args, args = parse_recipe_arguments(
        flags, (ModelArguments, DataArguments, ScaleTrainingArguments), "tiny_cpu", ""
    )
    data = prepare_data(model_args, data_args, args)
    assert data.tokenizer.chat_template == CHATML_TEMPLATE
    data.tokenizer.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == CHATML_TEMPLATE


def write_records(path, count, offset=0):
    """`count` short, distinct arithmetic records as JSON Lines."""
    with path.open("w") as out:
        for index in range(offset, offset + count):
            out.write(json.dumps({"instruction": f"Add {index} and 3.", "input": "", "output": str(index + 3)}) + "\n")


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SCALE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def prepare(path, tokenizer, **settings):
    data_args = DataArguments(dataset=str(path), exact_match_samples=3, **settings)
    return prepare_source(data_args.sources()[0], tokenizer, ALPACA, data_args, seed=0)


def test_a_second_preparation_reads_the_first_ones_examples_until_an_input_changes(tmp_path, own_cache, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    path = tmp_path / "data.jsonl"
    write_records(path, 400)
    first = prepare(path, tokenizer, max_length=64)
    again = prepare(path, tokenizer, max_length=64)
    assert (first.reused, again.reused) == (False, True)
    assert again.train_dataset.to_dict() == first.train_dataset.to_dict()
    assert again.eval_dataset.to_dict() == first.eval_dataset.to_dict()
    assert (again.train_summary, again.eval_summary) == (first.train_summary, first.eval_summary)
    assert again.record_checks == first.record_checks and again.held_out == first.held_out
    assert len(first.held_out) == 3 and first.train_summary.records == 380  # 5 % held out
    assert not prepare(path, tokenizer, max_length=65).reused
    assert not prepare(path, tokenizer, max_length=64, train_on_inputs=True).reused
    assert not prepare(path, tokenizer, max_length=64, eval_ratio=0.1).reused
    assert not prepare(path, tokenizer, max_length=64, cache_tokenized=False).reused
    time.sleep(0.01)
    write_records(path, 400, offset=1)  # the same size, other records: the modification time tells
    changed = prepare(path, tokenizer, max_length=64)
    assert not changed.reused and changed.train_dataset["input_ids"] != first.train_dataset["input_ids"]
    entries = [entry for entry in os.listdir(own_cache / "tokenized") if not entry.startswith(".")]
    assert len(entries) == 5  # one a distinct input; cache_tokenized off left none


@pytest.mark.slow
def test_two_processes_tokenize_a_200k_record_file_once_and_a_relaunch_not_at_all(tmp_path, tiny_model_dir):
    path = tmp_path / "big.jsonl"
    write_records(path, 200_000)
    cache = tmp_path / "cache"
    flags = ["--model_name_or_path", str(tiny_model_dir), "--dataset", str(path), "--eval_ratio", "0.001"]
    flags += ["--max_steps", "1", "--eval_strategy", "no", "--exact_match_samples", "0", "--save_strategy", "no"]
    outputs = []
    for launch in ("first", "relaunch"):
        command = torchrun("recipes/finetune_llama2.py", *flags, "--output_dir", str(tmp_path / launch))
        result = run_command(command, timeout=480, HF_SCALE_CACHE=str(cache))
        assert_succeeded(result, result.stderr[-3000:])
        outputs.append(result.stdout)
    first, relaunch = outputs
    assert f"process 0: examples of {path} tokenized" in first
    assert f"process 1: examples of {path} read from the cache" in first
    assert f"process 0: examples of {path} read from the cache" in relaunch
    assert f"process 1: examples of {path} read from the cache" in relaunch
    assert "200000 records, all valid" in first and "199800 records -> 199800 examples" in first
    assert len([entry for entry in os.listdir(cache / "tokenized") if not entry.startswith(".")]) == 1
