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

These are MODEL FLOPs: gradient checkpointing recomputes the forward (2N more per token of hardware work) but
does not count here, so MFU stays comparable across runs with and without it.
"""

from __future__ import annotations

from typing import Any


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


def training_flops_per_token(config: Any, seq_len: float) -> float:
    """Forward + backward FLOPs per token of a sequence of `seq_len` tokens: 6 x matmul weights + attention."""
    return 6.0 * matmul_parameters(config) + attention_flops_per_token(config, seq_len)


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
