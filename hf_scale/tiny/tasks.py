"""Generated Alpaca-format instruction tasks that a tiny model learns on one CPU core in about a minute.

Each task maps a three-digit number to a three-digit answer: the fixed width keeps every answer digit at
a fixed distance from the digits it depends on, which a 2-layer model finds quickly. A fixed share of the
numbers is held out: the eval split asks about numbers the model never saw in training, so exact match on
it measures learning, not memory. Every task is worded in English and in Chinese; some put the number in
`input`, some in the instruction itself (an empty `input`), as real Alpaca data does.

`generate_conversation_tasks` makes two-turn conversations of the same kind whose second question ("now add one
to that") can only be answered from the first answer: a model that scores on the second turn uses the history.
"""

from __future__ import annotations

import random

NUMBER_RANGE = range(100, 999)  # every answer stays three digits wide: 998 + 1 = 999, 101 - 1 = 100
HELD_OUT_SHARE = 0.1
TASK_SEED = 1234


# (wordings in English and Chinese, whether the number goes into `input` or into the instruction, what the answer
# adds to the number). A wording with `{n}` has the number written into it and an empty `input`.
TASKS: dict[str, tuple[list[str], bool, int]] = {
    "add_one": (["Add one to the number.", "给这个数加一。"], True, 1),
    "subtract_one": (["Subtract one from the number.", "给这个数减一。"], True, -1),
    "plus_one_question": (["What is {n} plus one?", "{n}加一等于多少？"], False, 1),
    "minus_one_question": (["What is {n} minus one?", "{n}减一等于多少？"], False, -1),
}


def split_numbers() -> tuple[list[int], list[int]]:
    """Split NUMBER_RANGE into (train numbers, held-out numbers), disjoint and fixed by TASK_SEED."""
    numbers = list(NUMBER_RANGE)
    random.Random(TASK_SEED).shuffle(numbers)
    n_held_out = int(len(numbers) * HELD_OUT_SHARE)
    return sorted(numbers[n_held_out:]), sorted(numbers[:n_held_out])


def _records_for(numbers: list[int]) -> list[dict[str, str]]:
    records = []
    for wordings, number_in_input, offset in TASKS.values():
        for n in numbers:
            if n + offset < NUMBER_RANGE.start:
                continue  # 99 is two digits wide
            for wording in wordings:
                if number_in_input:
                    records.append({"instruction": wording, "input": str(n), "output": str(n + offset)})
                else:
                    records.append({"instruction": wording.format(n=n), "input": "", "output": str(n + offset)})
    return records


def generate_tasks() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Return (train records, held-out records) in Alpaca format (`instruction`, `input`, `output`).

    The held-out records use only numbers that no train record mentions.
    """
    train_numbers, held_out_numbers = split_numbers()
    train, held_out = _records_for(train_numbers), _records_for(held_out_numbers)
    random.Random(TASK_SEED + 1).shuffle(train)
    random.Random(TASK_SEED + 2).shuffle(held_out)
    return train, held_out


# The follow-up questions of a conversation (English, Chinese) and what each adds to the previous answer.
FOLLOW_UPS: dict[str, tuple[tuple[str, str], int]] = {
    "add_one_more": (("Now add one to that.", "再加一。"), 1),
    "subtract_one_more": (("Now subtract one from that.", "再减一。"), -1),
}


def _conversations_for(numbers: list[int]) -> list[list[dict[str, str]]]:
    conversations = []
    for task in ("plus_one_question", "minus_one_question"):
        wordings, _, offset = TASKS[task]
        for (follow_ups, follow_offset), n in ((follow_up, n) for follow_up in FOLLOW_UPS.values() for n in numbers):
            first, second = n + offset, n + offset + follow_offset
            if not (first in NUMBER_RANGE and second in NUMBER_RANGE):
                continue  # every answer stays three digits wide
            for wording, follow_up in zip(wordings, follow_ups, strict=True):  # one language per conversation
                conversations.append(
                    [
                        {"role": "user", "content": wording.format(n=n)},
                        {"role": "assistant", "content": str(first)},
                        {"role": "user", "content": follow_up},
                        {"role": "assistant", "content": str(second)},
                    ]
                )
    return conversations


def generate_conversation_tasks() -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """Return (train conversations, held-out conversations), each two user/assistant turns in the normal form
    (`{"role": ..., "content": ...}`). The held-out conversations use only numbers no train conversation mentions.
    """
    train_numbers, held_out_numbers = split_numbers()
    train, held_out = _conversations_for(train_numbers), _conversations_for(held_out_numbers)
    random.Random(TASK_SEED + 3).shuffle(train)
    random.Random(TASK_SEED + 4).shuffle(held_out)
    return train, held_out


def generate_preference_tasks() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Return (train pairs, held-out pairs) in LLaMA-Factory's ranking Alpaca form (`instruction`, `input`, `chosen`,
    `rejected`): the tasks of `generate_tasks`, chosen the right answer, rejected a wrong one (the number itself, the
    opposite task's answer, or two off), drawn at a fixed seed. Held-out pairs use only held-out numbers."""
    pairs = []
    for records, seed in zip(generate_tasks(), (TASK_SEED + 5, TASK_SEED + 6), strict=True):
        draw = random.Random(seed)
        split = []
        for record in records:
            n = int(record["input"] or "".join(char for char in record["instruction"] if char.isdigit()))
            right = int(record["output"])
            wrong = draw.choice([n, 2 * n - right, right + (right - n)])  # itself, the opposite task's, two off
            if wrong not in NUMBER_RANGE:
                wrong = n
            split.append(
                {**{k: record[k] for k in ("instruction", "input")}, "chosen": str(right), "rejected": str(wrong)}
            )
        pairs.append(split)
    return pairs[0], pairs[1]
