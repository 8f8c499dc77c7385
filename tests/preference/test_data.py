"""Preference pairs tokenized with exactly the chosen and the rejected answers trained on: for the Alpaca templates
(the same examples SFT makes of the records), LLaMA-2 chat and ChatML, prompts of 1 to 4 turns, English and Chinese,
on the byte-level and SentencePiece-style tokenizers; every pair left out counted."""

from __future__ import annotations

import pytest

from hf_scale.data.conversations import chain_conversations
from hf_scale.data.multiturn import chat_template_for, render
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import tokenize_records
from hf_scale.errors import DataError
from hf_scale.preference import PreferencePair, preference_pair, tokenize_preferences
from tests.data.chat_tokenizers import chatml_tokenizer
from tests.data.test_multiturn import byte_level, labelled_runs, sentencepiece, shared_records

__all__ = ["byte_level", "sentencepiece"]  # fixtures


def conversation_pairs(dataset: str, count: int) -> list[PreferencePair]:
    """Shared records chained into conversations of 1 to 4 turns; the last answer is the chosen one, another
    conversation's last answer the rejected one."""
    conversations = chain_conversations(shared_records(dataset)[: count * 3], turns=(1, 4), seed=1)[:count]
    assert {len(turns) // 2 for turns in conversations} == {1, 2, 3, 4}
    return [
        PreferencePair(turns[:-1], turns[-1]["content"], conversations[index - 1][-1]["content"])
        for index, turns in enumerate(conversations)
    ]


def check_pair_exact(tokenizer, template, pair, example, end_of_turn):
    """Each half is the conversation with that answer, rendered and tokenized alone; its one labelled run decodes to
    the answer and its end of turn, after exactly the prompt rendered with the generation prompt; both halves
    continue the same prompt tokens."""
    prompt_ids = tokenizer(render(tokenizer, template, pair.prompt, True), add_special_tokens=False)["input_ids"]
    for half in ("chosen", "rejected"):
        turns = [*pair.prompt, {"role": "assistant", "content": getattr(pair, half)}]
        ids, labels = example[f"{half}_input_ids"], example[f"{half}_labels"]
        assert ids == tokenizer(render(tokenizer, template, turns, False), add_special_tokens=False)["input_ids"]
        (run,) = labelled_runs(labels)
        assert [labels[p] for p in run] == [ids[p] for p in run]
        assert tokenizer.decode([ids[p] for p in run]).strip() == getattr(pair, half).strip() + end_of_turn
        assert ids[: run[0]] == prompt_ids
    chosen_start = labelled_runs(example["chosen_labels"])[0][0]
    rejected_start = labelled_runs(example["rejected_labels"])[0][0]
    assert example["chosen_input_ids"][:chosen_start] == example["rejected_input_ids"][:rejected_start]


@pytest.mark.parametrize("tokenizer_name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("dataset", ["alpaca_en_demo.json", "alpaca_zh_demo.json"])
def test_llama2_chat_and_chatml_pairs_train_exactly_the_two_answers(request, tiny_model_dir, tokenizer_name, dataset):
    tokenizer = request.getfixturevalue(tokenizer_name)
    pairs = conversation_pairs(dataset, 60)
    template = chat_template_for("llama2_chat", tokenizer)
    examples, summary = tokenize_preferences(pairs, tokenizer, template, max_length=100_000)
    assert summary.kept == len(pairs) and summary.dropped_indices == []
    for pair, example in zip(pairs, examples, strict=True):
        check_pair_exact(tokenizer, template, pair, example, " </s>")
    if tokenizer_name == "byte_level":
        chatml = chatml_tokenizer(tiny_model_dir)
        examples, _ = tokenize_preferences(pairs, chatml, chatml.chat_template, max_length=100_000)
        for pair, example in zip(pairs, examples, strict=True):
            check_pair_exact(chatml, chatml.chat_template, pair, example, "<|im_end|>")


@pytest.mark.parametrize(
    ("dataset", "template_name"), [("alpaca_en_demo.json", "alpaca"), ("alpaca_zh_demo.json", "alpaca_zh")]
)
def test_alpaca_pairs_are_the_examples_sft_makes_of_their_records(byte_level, dataset, template_name):
    records = shared_records(dataset)[:80]
    assert any(record["input"] for record in records)  # the with-input wording is covered too
    ranking = [
        {
            "instruction": r["instruction"],
            "input": r["input"],
            "chosen": r["output"],
            "rejected": records[i - 1]["output"],
        }
        for i, r in enumerate(records)
    ]
    pairs = [preference_pair(record, f"record {index}") for index, record in enumerate(ranking)]
    template = get_template(template_name)
    examples, summary = tokenize_preferences(pairs, byte_level, template, max_length=100_000)
    assert summary.kept == len(pairs)
    for half in ("chosen", "rejected"):
        sft_records = [{"instruction": r["instruction"], "input": r["input"], "output": r[half]} for r in ranking]
        sft, _ = tokenize_records(sft_records, byte_level, template, max_length=100_000)
        assert examples[f"{half}_input_ids"] == sft["input_ids"] and examples[f"{half}_labels"] == sft["labels"]
        for record, labels, ids in zip(ranking, examples[f"{half}_labels"], examples[f"{half}_input_ids"], strict=True):
            (run,) = labelled_runs(labels)
            assert byte_level.decode([ids[p] for p in run]) == record[half] + byte_level.eos_token


def test_every_pair_left_out_is_counted_with_its_reason(byte_level):
    template = chat_template_for("llama2_chat", byte_level)
    short = PreferencePair([{"role": "user", "content": "Add 3 to 4."}], "7", "8")
    long_rejected = PreferencePair([{"role": "user", "content": "Add 3 to 4."}], "7", "8 " * 200)
    two_turns = [
        {"role": "user", "content": "Add 3 to 4. " * 5},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Double it."},
    ]
    # 70 tokens: the chosen conversation fits whole (68), the rejected one (101) only without its first pair (55).
    unequal = PreferencePair(two_turns, "14", "14 " * 12)
    pairs = [short, long_rejected, unequal, short]
    examples, summary = tokenize_preferences(pairs, byte_level, template, max_length=70, truncation="drop")
    assert (summary.pairs, summary.kept, summary.dropped_too_long, summary.prompts_differ) == (4, 2, 1, 1)
    assert summary.dropped_indices == [1, 2] and summary.rejected_shortened == 1 and len(examples) == 2
    assert "4 pairs -> 2 kept" in str(summary) and "1 dropped as too long and 1 whose halves" in str(summary)


def test_a_one_turn_template_refuses_a_conversation_naming_the_pair(byte_level):
    pair = PreferencePair(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
        "d",
        "e",
    )
    with pytest.raises(DataError, match="pair 0: a conversation"):
        tokenize_preferences([pair], byte_level, get_template("alpaca"), 128)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "hi", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
        ({"prompt": "hi", "chosen": "a", "rejected": ""}, "record 7.rejected: expected a non-empty string"),
        ({"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"}, "must end with a user"),
        (
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}],
            },
            "the same conversation up to their last turn",
        ),
    ],
)
def test_a_bad_pair_is_one_message_naming_the_record_and_field(record, message):
    with pytest.raises(DataError, match=message):
        preference_pair(record, "record 7")
