"""The preference losses: sigmoid, IPO and hinge equal TRL 1.16's DPOTrainer on the same tokens (per sequence and per
batch, fp32), SimPO and ORPO their published formulas, and the sigmoid loss is ln 2 when the policy is its
reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.data.templates import get_template
from hf_scale.preference import (
    PreferenceCollator,
    preference_losses,
    preference_pair,
    sequence_logps,
    tokenize_preferences,
)
from hf_scale.tiny.tasks import generate_preference_tasks
from tests.preference.test_data import labelled_runs


@pytest.fixture(scope="module")
def pair_rows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = generate_preference_tasks()[1][:6]
    pairs = [preference_pair(record, f"pair {index}") for index, record in enumerate(records)]
    rows, _ = tokenize_preferences(pairs, tokenizer, get_template("alpaca"), max_length=128)
    return tokenizer, rows.to_list()


def models(tiny_model_dir):
    """The tiny model as policy, and as reference the same weights moved a little (so that margins are not 0)."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return policy, reference


def ours(policy, reference, batch, loss_type, beta):
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        logps, lengths = sequence_logps(policy(**inputs).logits, batch["labels"])
        reference_logps, _ = sequence_logps(reference(**inputs).logits, batch["labels"])
    losses, chosen_rewards, rejected_rewards = preference_losses(logps, lengths, reference_logps, loss_type, beta)
    return losses.mean().item(), logps


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_sigmoid_ipo_and_hinge_equal_trl_dpo_trainer_on_the_same_tokens(tiny_model_dir, pair_rows, tmp_path, loss_type):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tokenizer, rows = pair_rows
    policy, reference = models(tiny_model_dir)
    trl_policy, trl_reference = models(tiny_model_dir)
    config = DPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.1, loss_type=[loss_type], report_to="none"
    )
    placeholder = Dataset.from_dict({"prompt": ["1"], "chosen": ["2"], "rejected": ["3"]})  # batches come from below
    trainer = DPOTrainer(
        model=trl_policy, ref_model=trl_reference, args=config, train_dataset=placeholder, processing_class=tokenizer
    )
    trl_collate = DataCollatorForPreference(pad_token_id=tokenizer.eos_token_id)
    collate = PreferenceCollator(pad_token_id=tokenizer.eos_token_id)

    def trl_examples(selected):
        examples = []
        for row in selected:
            start = labelled_runs(row["chosen_labels"])[0][0]  # both halves continue the same prompt tokens
            examples.append(
                {
                    "prompt_ids": row["chosen_input_ids"][:start],
                    "chosen_ids": row["chosen_input_ids"][start:],
                    "rejected_ids": row["rejected_input_ids"][start:],
                }
            )
        return trl_collate(examples)

    for selected in [[row] for row in rows] + [rows]:  # each pair alone (per sequence), then the batch of 6
        with torch.no_grad():
            trl_loss = trainer.compute_loss(trainer.model, trl_examples(selected)).item()
        metrics = trainer._metrics["eval"]  # TRL logs means (models in eval mode): one pair alone gives its own
        loss, logps = ours(policy, reference, collate(selected), loss_type, 0.1)
        assert abs(loss - trl_loss) < 1e-5, (loss, trl_loss)
        chosen, rejected = logps.chunk(2)
        assert abs(chosen.mean().item() - metrics["logps/chosen"][-1]) < 1e-5 * max(1.0, abs(chosen.mean().item()))
        assert abs(rejected.mean().item() - metrics["logps/rejected"][-1]) < 1e-5 * max(
            1.0, abs(rejected.mean().item())
        )


def test_simpo_and_orpo_are_their_published_formulas():
    logps = torch.tensor([-4.0, -9.0, -6.0, -8.0])  # chosen of 2 pairs, then rejected
    lengths = torch.tensor([2, 3, 4, 2])
    beta, gamma = 2.0, 0.5
    simpo, chosen_reward, rejected_reward = preference_losses(logps, lengths, None, "simpo", beta, simpo_gamma=gamma)
    # SimPO (Meng et al. 2024, eq. 6): -log σ(β/|y_w| log π(y_w|x) - β/|y_l| log π(y_l|x) - γ)
    expected = [
        -math.log(1 / (1 + math.exp(-(beta * w - beta * lose - gamma)))) for w, lose in ((-2.0, -1.5), (-3.0, -4.0))
    ]
    assert torch.allclose(simpo, torch.tensor(expected), atol=1e-6)
    assert torch.allclose(chosen_reward, torch.tensor([-4.0, -6.0])) and torch.allclose(
        rejected_reward, torch.tensor([-3.0, -8.0])
    )
    orpo, _, _ = preference_losses(logps, lengths, None, "orpo", 0.1)

    # ORPO (Hong et al. 2024, eq. 6-7): mean token NLL of y_w + λ(-log σ(log odds(y_w) - log odds(y_l))), odds = p/(1-p)
    def log_odds(mean_logp):
        return mean_logp - math.log(1 - math.exp(mean_logp))

    expected = [
        -w + 0.1 * -math.log(1 / (1 + math.exp(-(log_odds(w) - log_odds(lose)))))
        for w, lose in ((-2.0, -1.5), (-3.0, -4.0))
    ]
    assert torch.allclose(orpo, torch.tensor(expected), atol=1e-6)


def test_sigmoid_is_ln_2_with_zero_margins_and_label_smoothing_and_sft_weight_as_written():
    logps, lengths = torch.tensor([-3.0, -5.0, -2.0, -7.0]), torch.tensor([3, 5, 2, 7])
    losses, chosen, rejected = preference_losses(logps, lengths, logps.clone(), "sigmoid", 0.1)
    assert torch.allclose(losses, torch.full((2,), math.log(2))) and chosen.abs().max() == 0 == rejected.abs().max()
    reference = torch.tensor([-4.0, -5.0, -1.0, -9.0])
    smoothed, _, _ = preference_losses(logps, lengths, reference, "sigmoid", 0.1, label_smoothing=0.2, sft_weight=0.5)
    delta = torch.tensor([(-3 + 4) - (-2 + 1), (-5 + 5) - (-7 + 9)], dtype=torch.float32)
    expected = -0.8 * F.logsigmoid(0.1 * delta) - 0.2 * F.logsigmoid(-0.1 * delta) + 0.5 * torch.tensor([1.0, 1.0])
    assert torch.allclose(smoothed, expected)


def test_sequence_logps_sum_the_labelled_tokens_only():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 1, 2, 6, 0]])
    sums, counts = sequence_logps(logits, labels)
    logp = logits.log_softmax(-1)
    assert torch.allclose(sums[0], logp[0, 1, 3] + logp[0, 2, 4])
    assert torch.allclose(sums[1], logp[1, 0, 1] + logp[1, 1, 2] + logp[1, 2, 6] + logp[1, 3, 0])
    assert counts.tolist() == [2, 4]
