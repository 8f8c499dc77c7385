"""Per-sequence log-probabilities and the preference losses, written from their papers (and, for sigmoid, IPO and
hinge, as TRL 1.16's DPOTrainer computes them, which the tests check)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_scale.data.tokenize import IGNORE_INDEX


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the log-probabilities of each row's labelled tokens, how many there are), from logits (N, L, V) and
    labels (N, L) aligned with the inputs (the model's own shift: position t predicts label t + 1).

    A row's log-softmax is taken in fp32 one row at a time, so only one row's (L, V) copy exists beside the logits."""
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    targets = labels.masked_fill(~mask, 0).unsqueeze(-1)
    sums = []
    for row in range(logits.shape[0]):
        token_logps = logits[row, :-1].float().log_softmax(-1).gather(-1, targets[row]).squeeze(-1)
        sums.append((token_logps * mask[row]).sum())
    return torch.stack(sums), mask.sum(dim=1)


def packed_sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of a packed row: logits (1, T, V), labels and `sequence_ids` (1, T) as `PreferenceCollator`
    packs them. Position t predicts label t + 1 within its sequence (a sequence's first label is unlabelled, so nothing
    is predicted across a boundary); the log-softmax is taken in fp32 `chunk` positions at a time."""
    targets = labels[0, 1:]
    mask = targets != IGNORE_INDEX
    owners = sequence_ids[0, 1:]
    count = int(sequence_ids.max()) + 1
    sums = torch.zeros(count, dtype=torch.float32, device=logits.device)
    for start in range(0, targets.numel(), chunk):
        part = slice(start, start + chunk)
        token_logps = logits[0, :-1][part].float().log_softmax(-1)
        token_logps = token_logps.gather(-1, targets[part].masked_fill(~mask[part], 0).unsqueeze(-1)).squeeze(-1)
        sums = sums.index_add(0, owners[part], token_logps * mask[part])
    lengths = torch.zeros(count, dtype=torch.long, device=logits.device).index_add(0, owners, mask.long())
    return sums, lengths


def preference_losses(
    logps: torch.Tensor,
    lengths: torch.Tensor,
    reference_logps: torch.Tensor | None,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from the 2B rows' summed log-probs `logps` (chosen rows first),
    their labelled token counts and the reference's log-probs (None: reference-free).

    - sigmoid (DPO): -(1-ε) log σ(βΔ) - ε log σ(-βΔ), Δ = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))
    - hinge (SLiC): max(0, 1 - βΔ)
    - ipo: (Δ̄ - 1/(2β))², Δ̄ the same difference of log-ratios averaged per token (as TRL, with the IPO authors)
    - simpo: -(1-ε) log σ(β(ā_w - ā_l) - γ) - ε log σ(-(β(ā_w - ā_l) - γ)), ā the policy's mean token log-prob
    - orpo: -ā_w + β · (-log σ(log odds(y_w) - log odds(y_l))), odds(y) = p/(1-p) with p = exp(ā)
    Rewards (logged, and what reward accuracy compares): β x the log-ratio (DPO's implicit reward) with a reference,
    β x the mean token log-prob without one.
    """
    chosen, rejected = logps.float().chunk(2)
    chosen_length, rejected_length = lengths.clamp(min=1).float().chunk(2)
    chosen_mean, rejected_mean = chosen / chosen_length, rejected / rejected_length
    if reference_logps is None:
        chosen_ratio, rejected_ratio = chosen, rejected
    else:
        reference_chosen, reference_rejected = reference_logps.float().chunk(2)
        chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected
    delta = chosen_ratio - rejected_ratio

    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        mean_delta = chosen_ratio / chosen_length - rejected_ratio / rejected_length
        losses = (mean_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "simpo":
        margin = beta * (chosen_mean - rejected_mean) - simpo_gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    elif loss_type == "orpo":
        log_odds = (chosen_mean - rejected_mean) - (
            torch.log1p(-torch.exp(chosen_mean)) - torch.log1p(-torch.exp(rejected_mean))
        )
        losses = -chosen_mean - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if sft_weight and loss_type != "orpo":
        losses = losses - sft_weight * chosen_mean

    if reference_logps is None and loss_type in ("simpo", "orpo"):
        chosen_reward, rejected_reward = beta * chosen_mean, beta * rejected_mean
    else:
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    return losses, chosen_reward.detach(), rejected_reward.detach()
