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
