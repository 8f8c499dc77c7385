import re

from hf_scale.tiny.tasks import TASKS, generate_tasks, split_numbers


def numbers_in(record):
    return {int(n) for n in re.findall(r"\d+", record["instruction"] + " " + record["input"])}


def test_held_out_numbers_never_appear_in_training():
    train_numbers, held_out_numbers = split_numbers()
    assert not set(train_numbers) & set(held_out_numbers)
    train, held_out = generate_tasks()
    seen = set().union(*(numbers_in(r) for r in train))
    asked = set().union(*(numbers_in(r) for r in held_out))
    assert asked and not seen & asked


def test_records_are_alpaca_with_and_without_input_in_two_languages():
    train, held_out = generate_tasks()
    for record in train + held_out:
        assert set(record) == {"instruction", "input", "output"}
        assert all(isinstance(v, str) for v in record.values()) and record["output"]
    assert any(r["input"] for r in train) and any(not r["input"] for r in train)
    assert any(re.search(r"[\u4e00-\u9fff]", r["instruction"]) for r in train)
    assert any(re.fullmatch(r"[A-Za-z .?\d]+", r["instruction"]) for r in train)
    wordings = {w for wordings, _, _ in TASKS.values() for w in wordings}
    assert {r["instruction"] for r in held_out if r["input"]} <= wordings


def test_answers_are_right():
    train, _ = generate_tasks()
    for record in train:
        if record["instruction"] == "Add one to the number.":
            assert int(record["output"]) == int(record["input"]) + 1
        if record["instruction"] == "Subtract one from the number.":
            assert int(record["output"]) == int(record["input"]) - 1


def test_generation_is_deterministic():
    assert generate_tasks() == generate_tasks()


def test_conversations_ask_only_held_out_numbers_and_the_second_answer_follows_the_first():
    from hf_scale.tiny.tasks import FOLLOW_UPS, generate_conversation_tasks

    train, held_out = generate_conversation_tasks()
    asked = [{int(n) for n in re.findall(r"\d+", turns[0]["content"])} for turns in held_out]
    seen = set().union(*({int(n) for n in re.findall(r"\d+", turns[0]["content"])} for turns in train))
    assert held_out and not seen & set().union(*asked)
    offsets = {wording: offset for wordings, offset in FOLLOW_UPS.values() for wording in wordings}
    for turns in train + held_out:
        assert [turn["role"] for turn in turns] == ["user", "assistant", "user", "assistant"]
        (n,) = map(int, re.findall(r"\d+", turns[0]["content"]))
        first, second = int(turns[1]["content"]), int(turns[3]["content"])
        assert abs(first - n) == 1 and second == first + offsets[turns[2]["content"]]
    chinese = [turns for turns in train if re.search(r"[\u4e00-\u9fff]", turns[0]["content"])]
    assert chinese and all(re.search(r"[\u4e00-\u9fff]", turns[2]["content"]) for turns in chinese)  # one language
    assert generate_conversation_tasks() == (train, held_out)
