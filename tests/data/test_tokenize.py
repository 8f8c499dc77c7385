import json
import math

import pytest
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hf_scale.data.loading import load_records
from hf_scale.data.templates import ALPACA, TEMPLATES, get_template
from hf_scale.data.tokenize import IGNORE_INDEX, prompt_ids, responses_cut_warning, tokenize_records
from hf_scale.tiny import generate_tasks
from tests.data.chat_tokenizers import chatml_tokenizer, llama2_tokenizer
from tests.helpers import SHARED_DATA

RECORDS = [
    {"instruction": "Add one to the number.", "input": "41", "output": "42"},
    {"instruction": "What number comes after 9?", "input": "", "output": "10"},
    {"instruction": "给这个数减一。", "output": "7"},  # no `input` field at all
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def check_exact(tokenizer, template, records, dataset, summary):
    """The properties every tokenized example must have; returns nothing, asserts everything."""
    assert summary.boundary_merges == 0
    for record, example in zip(records, dataset, strict=True):
        prompt = template.format_prompt(record["instruction"], record.get("input") or "")
        response = template.format_response(record["output"])
        ids, labels = example["input_ids"], example["labels"]
        # no boundary drift: the example is the tokenization of the whole rendered text, BOS once
        full = tokenizer(prompt + response, add_special_tokens=False)["input_ids"]
        assert ids == [tokenizer.bos_token_id, *full, tokenizer.eos_token_id]
        assert ids.count(tokenizer.bos_token_id) == 1
        trained = [t for t in labels if t != IGNORE_INDEX]
        assert trained and trained[-1] == tokenizer.eos_token_id  # EOS present and trained on
        assert tokenizer.decode(trained[:-1]) == response  # the unmasked labels are exactly the response
        first = labels.index(trained[0])
        assert all(label == IGNORE_INDEX for label in labels[:first])  # every prompt token masked
        assert labels[first:] == ids[first:]


text = st.text(
    alphabet=st.sampled_from(list("abcxyz ABC019.,?!:#\n\t-'\"") + list("数字中文，。")), min_size=1, max_size=40
)
# Outputs start with a visible character, as real Alpaca outputs do; one that starts with a newline can merge
# with the template's last newline, which is counted (test_a_merge_across_the_boundary_is_counted_and_trained).
record = st.fixed_dictionaries(
    {
        "instruction": text.filter(str.strip),
        "input": st.one_of(st.just(""), text),
        "output": text.filter(lambda s: s.strip() and not s[0].isspace()),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(record, min_size=1, max_size=6), name=st.sampled_from(sorted(TEMPLATES)))
def test_labels_are_exact_on_random_records(tokenizer, records, name):
    template = get_template(name)
    dataset, summary = tokenize_records(records, tokenizer, template, max_length=4096)
    assert summary.examples == len(records)
    check_exact(tokenizer, template, records, dataset, summary)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
@pytest.mark.parametrize("name, template", [("alpaca_en_demo.json", "alpaca"), ("alpaca_zh_demo.json", "alpaca_zh")])
def test_labels_are_exact_on_the_real_alpaca_sets(tokenizer, name, template):
    records, check = load_records(str(SHARED_DATA / name))
    assert not check.skipped
    dataset, summary = tokenize_records(records, tokenizer, get_template(template), max_length=100_000)
    assert summary.examples == len(records) and summary.label_tokens > 0
    check_exact(tokenizer, get_template(template), records, dataset, summary)


def test_a_merge_across_the_boundary_is_counted_and_trained(tokenizer):
    record = {"instruction": "Add one to the number.", "input": "", "output": "\n0"}
    dataset, summary = tokenize_records([record], tokenizer, ALPACA, max_length=256)
    assert summary.boundary_merges == 1
    ids, labels = dataset[0]["input_ids"], dataset[0]["labels"]
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert "\n" in tokenizer.decode([ids[first]])  # the merged token, holding the response's first character
    assert labels[first:] == ids[first:]  # is trained on, with everything after it


def test_eos_is_trained_on_when_pad_is_eos(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.pad_token = tokenizer.eos_token
    with pytest.warns(UserWarning, match="pad == eos"):
        dataset, _ = tokenize_records(RECORDS[:1], tokenizer, ALPACA, max_length=256)
    assert dataset[0]["labels"][-1] == tokenizer.eos_token_id


def test_train_on_inputs_labels_the_prompt_too(tokenizer):
    dataset, summary = tokenize_records(RECORDS[:1], tokenizer, ALPACA, max_length=256, train_on_inputs=True)
    ids, labels = dataset[0]["input_ids"], dataset[0]["labels"]
    assert labels[0] == IGNORE_INDEX and labels[1:] == ids[1:]
    assert summary.label_tokens == len(ids) - 1


def lengths_of(tokenizer, record):
    prompt = prompt_ids(tokenizer, ALPACA.format_prompt(record["instruction"], record["input"]))
    return len(prompt), len(tokenizer(record["output"], add_special_tokens=False)["input_ids"]) + 1


LONG = {"instruction": "Add one to the number.", "input": "41", "output": "1234567"}


def test_keep_prompt_cuts_the_response_and_its_eos(tokenizer):
    n_prompt, n_response = lengths_of(tokenizer, LONG)
    dataset, summary = tokenize_records([LONG, RECORDS[0]], tokenizer, ALPACA, max_length=n_prompt + 3)
    assert (summary.response_cut, summary.examples) == (1, 2)
    cut = dataset[0]
    assert len(cut["input_ids"]) == n_prompt + 3 and tokenizer.eos_token_id not in cut["input_ids"]
    assert tokenizer.decode([t for t in cut["labels"] if t != IGNORE_INDEX]) == "123"
    assert dataset[1]["input_ids"][-1] == tokenizer.eos_token_id  # "42" and its EOS fit exactly: not cut


def test_a_record_without_a_response_token_left_is_dropped_and_counted(tokenizer):
    n_prompt, _ = lengths_of(tokenizer, LONG)
    dataset, summary = tokenize_records([RECORDS[0], LONG], tokenizer, ALPACA, max_length=n_prompt)
    assert summary.examples == 0 and summary.dropped_no_response == 2
    assert summary.dropped_indices == [0, 1] and "2 dropped (first positions in this set: [0, 1])" in str(summary)


def test_cut_prompt_left_keeps_bos_and_the_whole_response(tokenizer):
    n_prompt, n_response = lengths_of(tokenizer, LONG)
    dataset, summary = tokenize_records(
        [LONG], tokenizer, ALPACA, max_length=n_prompt + n_response - 5, truncation="cut_prompt_left"
    )
    assert summary.prompt_cut == 1
    ids, labels = dataset[0]["input_ids"], dataset[0]["labels"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == n_prompt + n_response - 5
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "1234567</s>"


def test_drop_policy_drops_and_counts(tokenizer):
    n_prompt, n_response = lengths_of(tokenizer, LONG)
    _, summary = tokenize_records([LONG], tokenizer, ALPACA, max_length=n_prompt + n_response - 1, truncation="drop")
    assert summary.examples == 0 and summary.dropped_too_long == 1 and summary.dropped_indices == [0]


def test_real_set_truncation_counts_add_up(tokenizer):
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data (the real Alpaca sets) is absent")
    records = json.loads((SHARED_DATA / "alpaca_en_demo.json").read_text())
    for policy in ("keep_prompt", "cut_prompt_left", "drop"):
        _, s = tokenize_records(records, tokenizer, ALPACA, max_length=256, truncation=policy)
        assert s.examples + s.dropped_too_long + s.dropped_no_response == len(records)
        assert s.response_cut + s.prompt_cut + s.dropped_too_long + s.dropped_no_response > 0


def test_a_token_across_the_boundary_is_trained_on_and_counted(tokenizer):
    joined = get_template(json.dumps({"with_input": "{instruction}", "without_input": "{instruction}"}))
    record = {"instruction": "Add one to the num", "input": "", "output": "ber."}
    assert "Ġnumber" in tokenizer.tokenize("Add one to the number.")  # the merge this test relies on
    dataset, summary = tokenize_records([record], tokenizer, joined, max_length=64)
    assert summary.boundary_merges == 1
    trained = [t for t in dataset[0]["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == " number.</s>"  # the Stanford-style mask would have cut this token


def test_several_processes_give_the_same_examples_and_summary(tokenizer):
    records = generate_tasks()[0][:64]
    records[5] = {**records[5], "instruction": "word " * 200}  # the prompt alone fills max_length: dropped
    records[9] = {**records[9], "output": "word " * 200}  # cut at max_length
    one, one_summary = tokenize_records(records, tokenizer, ALPACA, max_length=128)
    two, two_summary = tokenize_records(records, tokenizer, ALPACA, max_length=128, num_proc=2)
    assert one_summary == two_summary and one_summary.dropped_indices == [5] and one_summary.response_cut == 1
    assert one.to_dict() == two.to_dict() and len(one) == 63


def test_padding_left_on_the_tokenizer_by_an_earlier_call_does_not_leak_in(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer(["a few words"], padding="max_length", max_length=300, truncation=True)  # sets the Rust backend
    dataset, _ = tokenize_records(RECORDS[:2], tokenizer, ALPACA, max_length=256)
    assert all(len(ids) < 100 and tokenizer.pad_token_id not in ids for ids in dataset["input_ids"])


@pytest.mark.parametrize(
    "build, end_of_turn, response, eos_count",
    [
        # ChatML: the turn ends with <|im_end|>; EOS (<|endoftext|>) is not part of the chat format at all.
        (chatml_tokenizer, "<|im_end|>", "{}<|im_end|>", 0),
        # LLaMA-2 chat: the template's own " </s>" closes the turn; no second EOS after it.
        (llama2_tokenizer, "</s>", " {} </s>", 1),
    ],
)
def test_a_chat_templates_end_of_turn_is_trained_on_and_eos_is_not_doubled(
    tiny_model_dir, build, end_of_turn, response, eos_count
):
    tokenizer = build(tiny_model_dir)
    template = get_template("chat_template", tokenizer=tokenizer)
    dataset, summary = tokenize_records(RECORDS, tokenizer, template, max_length=256)
    assert summary.examples == len(RECORDS) and summary.boundary_merges == 0
    end_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    for record, example in zip(RECORDS, dataset, strict=True):
        ids, labels = example["input_ids"], example["labels"]
        prompt = prompt_ids(tokenizer, template.format_prompt(record["instruction"], record.get("input") or ""))
        assert ids[: len(prompt)] == prompt and ids.count(tokenizer.bos_token_id) == 1
        assert labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)  # the whole prompt is masked
        trained = labels[len(prompt) :]
        assert trained == ids[len(prompt) :]  # everything after it is trained on ...
        assert trained[-1] == end_id  # ... and ends where the chat format closes the turn
        assert ids.count(tokenizer.eos_token_id) == eos_count
        assert tokenizer.decode(trained) == response.format(record["output"])


def test_a_response_cut_at_max_length_loses_its_end_of_turn(tiny_model_dir):
    tokenizer = chatml_tokenizer(tiny_model_dir)
    template = get_template("chat_template", tokenizer=tokenizer)
    n_prompt = len(prompt_ids(tokenizer, template.format_prompt(LONG["instruction"], LONG["input"])))
    dataset, summary = tokenize_records([LONG], tokenizer, template, max_length=n_prompt + 3)
    assert summary.response_cut == 1
    trained = [t for t in dataset[0]["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "123"  # did not end: no end of turn taught here


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_a_max_length_that_cuts_many_responses_is_a_warning_with_the_length_that_keeps_them(tokenizer):
    """755 of 950 Chinese records of a real model's run had their response cut, said only as a count."""
    records, _ = load_records(str(SHARED_DATA / "alpaca_zh_demo.json"))
    template = get_template("alpaca_zh")
    examples, whole = tokenize_records(records, tokenizer, template, max_length=100_000)
    lengths = sorted(len(ids) for ids in examples["input_ids"])
    assert whole.length_for_99_percent == lengths[math.ceil(0.99 * len(lengths)) - 1]
    assert responses_cut_warning("train", whole, 100_000) == ""
    _, cut = tokenize_records(records, tokenizer, template, max_length=256)
    assert cut.response_cut > 0.05 * len(records)
    assert cut.length_for_99_percent == whole.length_for_99_percent  # measured before the cut
    warning = responses_cut_warning("train", cut, 256, "alpaca_zh_demo.json")
    assert warning == (
        f"{cut.response_cut} of 1000 train responses of alpaca_zh_demo.json ({cut.response_cut / 1000:.0%}) are cut at "
        f"max_length=256: the model learns answers that do not end; max_length {whole.length_for_99_percent} keeps "
        "99 % of them whole"
    )
    _, at_99 = tokenize_records(records, tokenizer, template, max_length=whole.length_for_99_percent)
    assert at_99.response_cut <= 0.01 * len(records)


def test_a_sliced_dataset_is_refused_with_the_way_to_take_its_first_rows(tokenizer):
    records = Dataset.from_list([{"instruction": "Add 1 and 2.", "input": "", "output": "3"}] * 4)
    with pytest.raises(TypeError, match=r"dataset\[:n\].*use dataset.select\(range\(n\)\)"):
        tokenize_records(records[:2], tokenizer, get_template("alpaca"), max_length=64)
    assert len(tokenize_records(records.select(range(2)), tokenizer, get_template("alpaca"), max_length=64)[0]) == 2
