"""Training FLOPs of a LLaMA-architecture model per token, and model FLOPs utilisation (MFU).

Accounting (PaLM appendix B, Megatron-LM): a weight of N parameters costs 2N FLOPs per token forward (one
multiply and one add per weight) and 4N backward (the gradient of the input and the gradient of the weight),
so 6N to train. N counts the matrix weights a token goes through: q/k/v/o and gate/up/down of every layer
plus the LM head. The input embedding is NOT counted: it is a table lookup, not a product (its backward is a
scatter-add, no multiplies either); the LM head is counted even when tied to the embedding, because it is a
real product. Norm weights and biases are elementwise work and are left out, as every MFU figure does.

Attention adds the two products that have no weights: QK^T and (softmax)V, each 2 x seq_len x d_attn FLOPs per
token forward (d_attn = heads x head_dim, the hidden size in LLaMA), x3 to train: 12 x layers x seq_len x d_attn
per token. For causal attention this counts the full seq_len x seq_len square, as PaLM, Megatron-LM and
torch's FlopCounterMode do, although a causal kernel skips about half of it: figures stay comparable with the
published ones, and the term is small for instruction data (seq_len / (6 x hidden) of 6N: 4 % at 512 tokens
and hidden 2048). For a batch of sequences of different lengths the attention work is sum(len^2), not
tokens x longest: `effective_seq_len` turns that into the seq_len that gives the same total.

Frozen weights (LoRA: the base is frozen, only the adapters train) still pass the gradient on to their input
(2N) but compute no gradient of their own (no 2N): training costs 6N less 2 x the frozen matmul weights. The
adapters are products too (LoRA's A and B), trained: 6 x their weights, on top of the config's N. One detail is
left out: when nothing before the first layer trains (embedding frozen) autograd skips the gradient of that
layer's input (q/k/v, and of K in its QK^T): under 1 % of a 7B LoRA step, and not skipped at all with gradient
checkpointing, which makes the embedding output require a gradient.

Preference tuning with a reference that runs at every step (a second model, or the policy with its adapters off)
adds that forward: 2N + a third of the attention term per token (`reference_forward`). A reference precomputed
once costs nothing per step and is not counted.

These are MODEL FLOPs: gradient checkpointing recomputes the forward (2N more per token of hardware work) but
does not count here, so MFU stays comparable across runs with and without it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


def head_dim(config: Any) -> int:
    """Width of one attention head: `config.head_dim` when set, otherwise hidden / heads (LLaMA's rule)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def matmul_parameters(config: Any) -> int:
    """Weights a token is multiplied by: attention and MLP projections of every layer plus the LM head.

    The input embedding is not included (a lookup); the LM head is, even when tied to it."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    q_width, kv_width = heads * head_dim(config), kv_heads * head_dim(config)
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden  # q, k, v, o
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return config.num_hidden_layers * (attention + mlp) + hidden * config.vocab_size


def attention_flops_per_token(config: Any, seq_len: float) -> float:
    """Training FLOPs of QK^T and (softmax)V per token, full square (see the module docstring)."""
    return 12.0 * config.num_hidden_layers * seq_len * config.num_attention_heads * head_dim(config)


def training_flops_per_token(
    config: Any, seq_len: float, frozen: int = 0, adapters: int = 0, reference_forward: bool = False
) -> float:
    """Forward + backward FLOPs per token of a sequence of `seq_len` tokens: 6 x matmul weights + attention,
    less 2 x the `frozen` matmul weights (no weight gradient), plus 6 x the `adapters`' weights (LoRA A and B);
    with `reference_forward`, plus one forward of the model without its adapters (a preference reference).

    Full fine-tuning: frozen = adapters = 0. Count them with `frozen_matmul_parameters` and `adapter_parameters`."""
    weights = matmul_parameters(config) + adapters
    # every weight: 2 forward + 2 for its input's gradient; only a trained weight: 2 more for its own gradient
    flops = 6.0 * weights - 2.0 * frozen + attention_flops_per_token(config, seq_len)
    if reference_forward:
        flops += 2.0 * matmul_parameters(config) + attention_flops_per_token(config, seq_len) / 3
    return flops


def _linear_weights(linear: nn.Linear) -> int:
    # From the layer's shape, not weight.numel(): under ZeRO-3 a weight holds only this rank's shard (often
    # empty), and a 4-bit quantised weight (QLoRA) packs two values per element.
    return linear.in_features * linear.out_features


def _lora_layers(model: nn.Module) -> list[Any]:
    """The model's PEFT LoRA layers; none when peft was never imported (then the model cannot have any)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def _running_adapters(layer: Any) -> list[str]:
    """Names of the adapters of a LoRA layer that its forward runs (none while adapters are disabled)."""
    if layer.disable_adapters:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]  # a layer an adapter leaves alone


def adapter_parameters(model: nn.Module) -> int:
    """Weights of the running LoRA adapters (A and B of every adapted layer): products the config does not hold."""
    total = 0
    for layer in _lora_layers(model):
        for name in _running_adapters(layer):
            total += _linear_weights(layer.lora_A[name]) + _linear_weights(layer.lora_B[name])
    return total


def _idle_peft_modules(model: nn.Module) -> set[nn.Module]:
    """Modules that PEFT keeps but the forward does not run: the original of a module in `modules_to_save`
    while its trainable copy runs (or the copies while the original runs), and the A and B of adapters that
    are not active."""
    idle: set[nn.Module] = set()
    if "peft" not in sys.modules:
        return idle
    from peft.utils.other import ModulesToSaveWrapper

    for module in model.modules():
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters
            # the wrapper's own rule: the original runs when adapters are off or the active one has no copy here
            passthrough = module.disable_adapters or not active or any(a not in module.modules_to_save for a in active)
            running = module.original_module if passthrough else module.modules_to_save[active[0]]
            idle.update(set(module.modules()) - set(running.modules()) - {module})
    for layer in _lora_layers(model):
        for name in layer.lora_A.keys() - set(_running_adapters(layer)):
            idle.update([*layer.lora_A[name].modules(), *layer.lora_B[name].modules()])
    return idle


def frozen_matmul_parameters(model: nn.Module) -> int:
    """Weights of the model's linear layers that the forward runs but that do not train (requires_grad False).

    LoRA: the whole base, LM head included (tied or not; the input embedding is no product, see
    `matmul_parameters`). Full fine-tuning: 0. Layers that DeepSpeed AutoTP replaced are not `nn.Linear`
    and count as trained."""
    idle = _idle_peft_modules(model)
    return sum(
        _linear_weights(module)
        for module in model.modules()
        if isinstance(module, nn.Linear) and not module.weight.requires_grad and module not in idle
    )


def effective_seq_len(tokens: float, sum_squared_lengths: float) -> float:
    """The seq_len for which tokens x training_flops_per_token(config, seq_len) is the FLOPs of a batch of
    sequences whose lengths sum to `tokens` and whose squared lengths sum to `sum_squared_lengths`.

    Attention costs each token the length of its own sequence, so the average a token sees is
    sum(len^2) / sum(len): padding and the other examples of a packed row cost nothing here."""
    return sum_squared_lengths / tokens if tokens else 0.0


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak FLOP/s of the same devices.

    Pass the tokens/s of one device with one device's peak (or the total of all devices with the total peak).
    """
    return tokens_per_second * flops_per_token / peak_flops
