"""`PreferenceCollator`: padded rows and one packed row give every sequence the same log-prob within 1e-5 (fp32), with
transformers' sdpa mask and with hf_scale's per-example attention; training on packed batches trains what padded
batches train."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.templates import get_template
from hf_scale.packed_attention import use_packed_sdpa
from hf_scale.preference import (
    PreferenceCollator,
    PreferenceTrainer,
    ScalePreferenceArguments,
    preference_pair,
    sequence_logps,
    tokenize_preferences,
)
from hf_scale.preference.collator import pad_token_id
from hf_scale.preference.losses import packed_sequence_logps
from hf_scale.tiny.tasks import generate_preference_tasks

TOLERANCE = 1e-5


def pairs_dataset(tokenizer, count: int):
    records = generate_preference_tasks()[0][:count]  # English and Chinese wordings, with and without input
    pairs = [preference_pair(record, f"pair {n}") for n, record in enumerate(records)]
    return tokenize_preferences(pairs, tokenizer, get_template("alpaca"), max_length=128)[0]


@pytest.mark.parametrize("attention", ["sdpa", "hf_scale_packed_sdpa"])
def test_packed_log_probs_equal_padded(tiny_model_dir, attention):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    if attention != "sdpa":
        use_packed_sdpa(model)
    features = list(pairs_dataset(tokenizer, 8))
    padded = PreferenceCollator(pad_token_id(tokenizer))(features)
    packed = PreferenceCollator(pad_token_id(tokenizer), packing=True)(features)
    assert packed["input_ids"].shape[0] == 1 and packed["input_ids"].numel() == int(padded["attention_mask"].sum())
    with torch.no_grad():
        logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False).logits
        expected, expected_lengths = sequence_logps(logits, padded["labels"])
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        actual, lengths = packed_sequence_logps(logits, packed["labels"], packed["sequence_ids"], chunk=50)
    assert torch.equal(lengths, expected_lengths) and len(actual) == 16
    assert (actual - expected).abs().max().item() <= TOLERANCE, (actual, expected)


def train(tiny_model_dir, tmp_path, monkeypatch, packing: bool):
    monkeypatch.setenv("HF_SCALE_CACHE", str(tmp_path / f"cache-{packing}"))  # each computes its own reference
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = ScalePreferenceArguments(
        output_dir=str(tmp_path / f"run-{packing}"),
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        warmup_steps=0,
        max_steps=8,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    trainer = PreferenceTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        train_dataset=pairs_dataset(tokenizer, 32),
        data_collator=PreferenceCollator(pad_token_id(tokenizer), packing=packing),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model()
    assert trainer.reference == "precomputed" and trainer.reference_origin["train"][0] == "computed"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, load_file(tmp_path / f"run-{packing}" / "model.safetensors")


def test_training_on_packed_batches_trains_what_padded_batches_train(tiny_model_dir, tmp_path, monkeypatch):
    """8 steps of 4 pairs, full weights, the reference precomputed through each collator: the same logged losses
    (logged to 4 digits) and the same weights within 1e-5."""
    padded_losses, padded = train(tiny_model_dir, tmp_path, monkeypatch, packing=False)
    packed_losses, packed = train(tiny_model_dir, tmp_path, monkeypatch, packing=True)
    assert len(packed_losses) == 8 and packed_losses == pytest.approx(padded_losses, abs=1e-4)
    gaps = {name: (padded[name] - packed[name]).abs().max().item() for name in padded}
    assert max(gaps.values()) <= TOLERANCE, sorted(gaps.items(), key=lambda item: -item[1])[:3]
