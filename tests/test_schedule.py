"""The default schedule is linear warmup then cosine (transformers' own schedulers), optionally to a floor."""

import math

import pytest
import torch

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.trainer import ScaleTrainer

PEAK, STEPS, WARMUP = 1e-3, 100, 10


def learning_rates(tmp_path, **kwargs) -> list[float]:
    """The learning rate the scheduler gives at every step 0..STEPS."""
    args = ScaleTrainingArguments(output_dir=str(tmp_path), learning_rate=PEAK, warmup_steps=0.1, **kwargs)
    trainer = ScaleTrainer(model=torch.nn.Linear(2, 2), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    rates = []
    for _ in range(STEPS + 1):
        rates.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    return rates


def cosine(step: int, floor: float = 0.0) -> float:
    if step < WARMUP:
        return PEAK * step / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return floor + (PEAK - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def test_default_is_warmup_then_cosine(tmp_path):
    rates = learning_rates(tmp_path)
    assert ScaleTrainingArguments(output_dir=str(tmp_path)).lr_scheduler_type == "cosine"
    halfway = (WARMUP + STEPS) // 2  # halfway through the cosine: half the peak
    for step, expected in ((0, 0.0), (WARMUP, PEAK), (halfway, PEAK / 2), (STEPS, 0.0)):
        assert rates[step] == pytest.approx(expected, abs=1e-12), step
    assert rates[WARMUP // 2] == pytest.approx(PEAK / 2)  # linear warmup
    assert all(rates[s] == pytest.approx(cosine(s), abs=1e-12) for s in range(STEPS + 1))


def test_cosine_with_a_floor(tmp_path):
    rates = learning_rates(tmp_path, min_learning_rate=1e-4)
    assert rates[WARMUP] == pytest.approx(PEAK) and rates[STEPS] == pytest.approx(1e-4)
    assert all(rates[s] == pytest.approx(cosine(s, 1e-4), abs=1e-12) for s in range(STEPS + 1))
