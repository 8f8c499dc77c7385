"""`PreferenceTrainer` on the tiny model after SFT (the shared `trained_tiny_run`), with generated pairs: the loss at
step 0 in every reference mode, and learning to prefer the right answer on held-out pairs."""

from __future__ import annotations

import math

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.templates import get_template
from hf_scale.modeling import ModelArguments, load_model
from hf_scale.preference import (
    PreferenceTrainer,
    ScalePreferenceArguments,
    load_preference_pairs,
    preference_pair,
    tokenize_preferences,
)
from hf_scale.tiny.tasks import generate_preference_tasks

pytestmark = pytest.mark.slow  # the SFT run it starts from


def pairs_dataset(tokenizer, pairs):
    parsed = [preference_pair(record, f"pair {index}") for index, record in enumerate(pairs)]
    dataset, summary = tokenize_preferences(parsed, tokenizer, get_template("alpaca"), max_length=128)
    assert summary.kept == len(pairs)
    return dataset


def trainer_for(
    run, tmp_path, lora_r=0, reference="auto", loss_type="sigmoid", train=64, held_out=64, quantization=None, **options
):
    tokenizer = AutoTokenizer.from_pretrained(run)
    model = load_model(ModelArguments(lora_r=lora_r, quantization=quantization), str(run), tokenizer)
    train_pairs, held_out_pairs = generate_preference_tasks()
    ref_model = AutoModelForCausalLM.from_pretrained(run) if reference == "model" else None
    args = ScalePreferenceArguments(
        output_dir=str(tmp_path / "out"),
        reference=reference,
        loss_type=loss_type,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        seed=0,
        **options,
    )
    return PreferenceTrainer(
        model=model,
        args=args,
        ref_model=ref_model,
        train_dataset=pairs_dataset(tokenizer, train_pairs[:train]),
        eval_dataset=pairs_dataset(tokenizer, held_out_pairs[:held_out]),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize(
    ("lora_r", "quantization", "reference", "expected_mode"),
    [
        (0, None, "auto", "precomputed"),
        (0, None, "model", "model"),
        (8, None, "auto", "adapters_off"),
        (8, None, "precomputed", "precomputed"),
        (8, "nf4", "auto", "adapters_off"),
        (8, "nf4", "precomputed", "precomputed"),
    ],
)
def test_the_sigmoid_loss_is_ln_2_at_step_0_with_every_reference(
    trained_tiny_run, tmp_path, lora_r, quantization, reference, expected_mode
):
    """Full, LoRA and QLoRA (NF4 base), one process: the policy is its reference at the start."""
    trainer = trainer_for(trained_tiny_run, tmp_path, lora_r, reference, quantization=quantization, max_steps=1)
    assert trainer.reference == expected_mode
    metrics = trainer.evaluate()
    assert abs(metrics["eval_loss"] - math.log(2)) < 1e-5, metrics
    assert abs(metrics["eval_rewards/margins"]) < 1e-5 and metrics["eval_rewards/accuracies"] == 0.0


def test_pairs_load_in_every_form(tmp_path):
    import json

    records = [
        {"prompt": "Say hi.", "chosen": "hi", "rejected": "bye"},
        {
            "prompt": [{"role": "user", "content": "Say hi."}],
            "chosen": [{"role": "assistant", "content": "hi"}],
            "rejected": [{"role": "assistant", "content": "bye"}],
        },
        {
            "chosen": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
            "rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "bye"}],
        },
        {"instruction": "Say hi.", "input": "", "chosen": "hi", "rejected": "bye"},
        {
            "conversations": [{"from": "human", "value": "Say hi."}],
            "chosen": {"from": "gpt", "value": "hi"},
            "rejected": {"from": "gpt", "value": "bye"},
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records))
    pairs = load_preference_pairs(path)
    assert {(tuple(map(str, p.prompt)), p.chosen, p.rejected) for p in pairs} == {
        ((str({"role": "user", "content": "Say hi."}),), "hi", "bye")
    }
    assert pairs[3].record == {"instruction": "Say hi.", "input": ""}


def test_the_reference_mode_must_fit_the_model(tiny_model_dir, tmp_path):
    from hf_scale.errors import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = ScalePreferenceArguments(output_dir=str(tmp_path), reference="adapters_off", report_to="none")
    with pytest.raises(ConfigError, match="adapters_off needs a model with LoRA adapters"):
        PreferenceTrainer(model=model, args=args, processing_class=tokenizer)
    with pytest.raises(ConfigError, match="reference-free"):
        ScalePreferenceArguments(output_dir=str(tmp_path), loss_type="simpo", reference="precomputed")


def test_the_divergence_guard_stops_a_preference_run_whose_loss_becomes_nan(tiny_model_dir, tmp_path):
    """A learning rate far too high: the guard stops at the first NaN step with its diagnosis checkpoint, as in SFT."""
    from hf_scale.callbacks import TrainingDiverged

    trainer = trainer_for(tiny_model_dir, tmp_path, learning_rate=1e30, max_steps=6, warmup_steps=0)
    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d: the loss is nan") as raised:
        trainer.train()
    assert raised.value.diagnosis.is_dir() and raised.value.diagnosis.parent.name.startswith("diverged-step-")
