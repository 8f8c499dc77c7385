"""Multi-turn labels are exactly the assistant's turns, for LLaMA-2 chat and ChatML, on two kinds of tokenizer."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hf_scale.data.conversations import chain_conversations
from hf_scale.data.loading import load_records
from hf_scale.data.multiturn import chat_template_for, render, tokenize_conversations
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import IGNORE_INDEX, responses_cut_warning, tokenize_records
from hf_scale.errors import ConfigError, DataError
from hf_scale.tiny.build import build_sentencepiece_tokenizer
from tests.data.chat_tokenizers import chatml_tokenizer
from tests.helpers import SHARED_DATA

CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "Add 3 to 4."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Now double it."},
    {"role": "assistant", "content": "14"},
]


def shared_records(name):
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data (the real Alpaca sets) is absent")
    return load_records(str(SHARED_DATA / name))[0].to_list()


@pytest.fixture(scope="module")
def byte_level(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def sentencepiece():
    """LLaMA-2's kind of tokenizer (metaspace, byte fallback), trained on the shared English and Chinese sets."""
    records = shared_records("alpaca_en_demo.json") + shared_records("alpaca_zh_demo.json")
    return build_sentencepiece_tokenizer([" ".join(record.values()) for record in records])


def labelled_runs(labels):
    """The labelled positions, as runs of consecutive positions."""
    runs, previous = [], None
    for position, label in enumerate(labels):
        if label != IGNORE_INDEX:
            if previous != position - 1:
                runs.append([])
            runs[-1].append(position)
            previous = position
    return runs


def check_exact(tokenizer, template, turns, example, end_of_turn):
    """Every labelled run decodes to one assistant turn's content and its end of turn, in order, and the tokens
    before it are the conversation so far rendered with the generation prompt, tokenized alone."""
    ids, labels = example["input_ids"], example["labels"]
    assert ids == tokenizer(render(tokenizer, template, turns, False), add_special_tokens=False)["input_ids"]
    runs = labelled_runs(labels)
    answers = [index for index, turn in enumerate(turns) if turn["role"] == "assistant"]
    assert len(runs) == len(answers)
    for run, index in zip(runs, answers, strict=True):
        assert [labels[p] for p in run] == [ids[p] for p in run]
        decoded = tokenizer.decode([ids[p] for p in run])
        assert decoded.strip() == turns[index]["content"].strip() + end_of_turn
        prompt = render(tokenizer, template, turns[:index], True)
        assert ids[: run[0]] == tokenizer(prompt, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("tokenizer_name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("dataset", ["alpaca_en_demo.json", "alpaca_zh_demo.json"])
def test_llama2_chat_labels_every_answer_of_the_shared_sets_exactly(request, tokenizer_name, dataset):
    tokenizer = request.getfixturevalue(tokenizer_name)
    conversations = chain_conversations(shared_records(dataset), turns=(2, 4), seed=0)
    template = chat_template_for("llama2_chat", tokenizer)
    examples, summary = tokenize_conversations(conversations, tokenizer, template, max_length=100_000)
    assert summary.examples == len(conversations) and summary.boundary_merges == 0
    for turns, example in zip(conversations, examples, strict=True):
        check_exact(tokenizer, template, turns, example, " </s>")


text = st.text(alphabet=st.sampled_from(list("abcxyz ABC019.,?!:#\n-'\"") + list("数字中文，。")), max_size=30)
content = text.filter(lambda s: s.strip())


@st.composite
def conversations(draw):
    turns = [{"role": "system", "content": draw(content)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        turns += [{"role": "user", "content": draw(content)}, {"role": "assistant", "content": draw(content)}]
    return turns


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=conversations())
def test_any_conversation_is_labelled_exactly(byte_level, sentencepiece, tiny_model_dir, turns):
    for tokenizer in (byte_level, sentencepiece):
        template = chat_template_for("llama2_chat", tokenizer)
        examples, _ = tokenize_conversations([turns], tokenizer, template, max_length=100_000)
        check_exact(tokenizer, template, turns, examples[0], " </s>")
    chatml = chatml_tokenizer(tiny_model_dir)
    stripped = [{**turn, "content": turn["content"].strip()} for turn in turns]  # ChatML keeps spaces as written
    examples, _ = tokenize_conversations([stripped], chatml, chat_template_for("chat_template", chatml), 100_000)
    check_exact(chatml, chatml.chat_template, stripped, examples[0], "<|im_end|>")


def test_the_last_turn_only_and_train_on_inputs(byte_level):
    template = chat_template_for("llama2_chat", byte_level)
    (last,), _ = tokenize_conversations([CONVERSATION], byte_level, template, 512, assistant_turns="last")
    runs = labelled_runs(last["labels"])
    assert len(runs) == 1 and byte_level.decode([last["input_ids"][p] for p in runs[0]]).strip() == "14 </s>"
    (everything,), _ = tokenize_conversations([CONVERSATION], byte_level, template, 512, train_on_inputs=True)
    assert everything["labels"] == [IGNORE_INDEX, *everything["input_ids"][1:]]


def test_an_overlong_conversation_loses_its_oldest_pairs_first_and_everything_is_counted(byte_level):
    template = chat_template_for("llama2_chat", byte_level)
    whole = len(tokenize_conversations([CONVERSATION], byte_level, template, 512)[0][0]["input_ids"])
    (example,), summary = tokenize_conversations([CONVERSATION], byte_level, template, whole - 1)
    assert (summary.shortened, summary.pairs_removed, summary.dropped_too_long) == (1, 1, 0)
    kept = [CONVERSATION[0], *CONVERSATION[3:]]  # the system turn stays, the first pair goes
    check_exact(byte_level, template, kept, example, " </s>")
    last_pair = len(example["input_ids"])
    (cut,), summary = tokenize_conversations([CONVERSATION], byte_level, template, last_pair - 1)
    assert summary.answer_cut == 1 and len(cut["input_ids"]) == last_pair - 1
    assert cut["labels"][-1] != byte_level.eos_token_id  # the answer did not end: no end of turn trained
    with pytest.raises(DataError, match="all 1 conversations dropped as too long"):
        tokenize_conversations([CONVERSATION], byte_level, template, last_pair - 1, truncation="drop")
    dataset, summary = tokenize_conversations(
        [CONVERSATION, CONVERSATION[1:3]], byte_level, template, last_pair - 1, truncation="drop"
    )
    assert (summary.examples, summary.dropped_too_long, summary.dropped_indices) == (1, 1, [0])


def test_templates_that_cannot_be_labelled_are_refused(byte_level):
    with pytest.raises(ConfigError, match="'vicuna' cannot render conversations"):
        chat_template_for("vicuna", byte_level)
    rewriting = "{% for m in messages %}{{ m['content'] if loop.last else '' }}{{ eos_token }}{% endfor %}"
    with pytest.raises(ConfigError, match="does not extend the rendering of its beginning"):
        tokenize_conversations([CONVERSATION], byte_level, rewriting, 512)
    no_end = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match="turn 2 ends with no special token"):
        tokenize_conversations([CONVERSATION], byte_level, no_end, 512)


@pytest.mark.parametrize("name", ["alpaca", "alpaca_zh"])
def test_alpaca_conversations_of_one_turn_are_the_one_turn_examples(byte_level, name):
    """The Alpaca templates extended to several turns render a one-turn conversation as the one-turn template renders
    an Alpaca record without input (BOS, prompt, response, EOS), and on the tiny tokenizer label it identically: a
    run mixing both formats trains on one format. (A metaspace tokenizer that prefixes "▁" to the first word only
    reads the rendered `<s>` as text before that word, as LLaMA's own does with its chat template; its masks are
    checked by the tests above.)"""
    template = get_template(name)
    records = shared_records("alpaca_zh_demo.json" if name == "alpaca_zh" else "alpaca_en_demo.json")
    records = [r for r in records if not r["input"]][:50]
    turns = [
        [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}] for r in records
    ]
    chat_template = chat_template_for(name, byte_level)
    for record, conversation in zip(records, turns, strict=True):
        one_turn = template.format_prompt(record["instruction"], "") + record["output"]
        assert render(byte_level, chat_template, conversation, False) == "<s>" + one_turn + "</s>"
    one_turn, _ = tokenize_records(records, byte_level, template, max_length=512)
    conversations, _ = tokenize_conversations(turns, byte_level, chat_template, 512)
    assert conversations["input_ids"] == one_turn["input_ids"]
    assert conversations["labels"] == one_turn["labels"]
    short = sorted(turns, key=lambda t: len(t[0]["content"] + t[1]["content"]))[:2]
    two_turns = short[0] + short[1]  # a second turn follows the first answer's EOS
    (example,), _ = tokenize_conversations([two_turns], byte_level, chat_template, 1024)
    check_exact(byte_level, chat_template, two_turns, example, "</s>")


def test_a_max_length_that_cuts_many_conversations_is_a_warning_with_the_length_that_keeps_them(byte_level):
    """As for one-turn records: more than 5 % of conversations that lose their last answer's end or their oldest turns
    to max_length is a warning naming the length that keeps 99 % of them whole (it was a count in the summary only)."""
    conversations = chain_conversations(shared_records("alpaca_en_demo.json")[:200], turns=(2, 3), seed=0)
    template = chat_template_for("llama2_chat", byte_level)
    examples, whole = tokenize_conversations(conversations, byte_level, template, max_length=100_000)
    lengths = sorted(len(ids) for ids in examples["input_ids"])
    assert whole.length_for_99_percent == lengths[math.ceil(0.99 * len(lengths)) - 1]
    assert responses_cut_warning("train", whole, 100_000) == ""
    _, cut = tokenize_conversations(conversations, byte_level, template, max_length=200)
    assert cut.answer_cut + cut.shortened > 0.05 * len(conversations) and cut.answer_cut and cut.shortened
    assert cut.length_for_99_percent == whole.length_for_99_percent  # measured before the cut
    count = cut.answer_cut + cut.shortened
    assert responses_cut_warning("train", cut, 200, "chats.jsonl") == (
        f"{count} of {len(conversations)} train conversations of chats.jsonl ({count / len(conversations):.0%}) are "
        f"cut at max_length=200: {cut.answer_cut} with the last answer cut (the model learns answers that do not end), "
        f"{cut.shortened} without their oldest turns; max_length {whole.length_for_99_percent} keeps 99 % of them whole"
    )
    _, at_99 = tokenize_conversations(conversations, byte_level, template, max_length=whole.length_for_99_percent)
    assert at_99.answer_cut + at_99.shortened <= 0.01 * len(conversations)
