"""hf_scale.flops against torch's FlopCounterMode on a real forward + backward, and against LLaMA-2 7B's figures."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_scale.data.batching import make_collator
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import tokenize_records
from hf_scale.flops import (
    attention_flops_per_token,
    effective_seq_len,
    matmul_parameters,
    mfu,
    training_flops_per_token,
)
from hf_scale.model_shapes import KNOWN_CONFIGS, count_parameters
from hf_scale.tiny import generate_tasks
from hf_scale.tiny.build import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = tokenizer.unk_token
    model = build_tiny_model(tokenizer)
    # Eager attention: its QK^T and AV are bmm calls that FlopCounterMode counts. On CPU, sdpa runs
    # _scaled_dot_product_flash_attention_for_cpu, which torch 2.13's counter has no formula for (counts 0).
    model.set_attn_implementation("eager")
    return tokenizer, model


def counted_training_flops(model, batch: dict) -> tuple[int, int]:
    """(all FLOPs, attention-product FLOPs) that torch counts for one forward + backward of `batch`."""
    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops(), counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0)


def test_matmul_parameters_are_the_parameters_less_embedding_and_norms(tiny):
    _, model = tiny
    config = model.config
    # the tiny model ties its LM head to the embedding: the parameters hold that matrix once, the FLOPs twice
    # over (lookup: none; LM head: a product), so the product count is parameters - norms
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert config.tie_word_embeddings
    assert matmul_parameters(config) == model.num_parameters() - norms


def test_tiny_model_flops_agree_with_flop_counter_on_a_long_batch(tiny):
    tokenizer, model = tiny
    seq_len = 256  # long enough that attention is a third of the FLOPs: leaving it out would fail by far
    batch = {"input_ids": torch.randint(0, len(tokenizer), (2, seq_len))}
    batch["labels"] = batch["input_ids"]
    total, attention = counted_training_flops(model, batch)
    tokens = batch["input_ids"].numel()
    assert total == pytest.approx(tokens * training_flops_per_token(model.config, seq_len), rel=0.10)
    assert attention == pytest.approx(tokens * attention_flops_per_token(model.config, seq_len), rel=0.01)
    assert attention > 0.25 * total


def test_tiny_model_flops_agree_with_flop_counter_on_a_real_padded_batch(tiny):
    tokenizer, model = tiny
    dataset, _ = tokenize_records(generate_tasks()[0][:8], tokenizer, ALPACA, max_length=128)
    batch = make_collator(tokenizer, packing=False)([dataset[i] for i in range(8)])
    rows, width = batch["input_ids"].shape
    total, _ = counted_training_flops(model, batch)
    # the kernels work on the padded rectangle, so that is what the counter sees
    assert total == pytest.approx(rows * width * training_flops_per_token(model.config, width), rel=0.10)


def test_effective_seq_len_gives_the_total_of_sequences_of_different_lengths(tiny):
    _, model = tiny
    lengths = [10, 30, 200]
    direct = sum(n * training_flops_per_token(model.config, n) for n in lengths)
    seq_len = effective_seq_len(sum(lengths), sum(n * n for n in lengths))
    assert sum(lengths) * training_flops_per_token(model.config, seq_len) == pytest.approx(direct)
    assert effective_seq_len(0, 0) == 0.0


def test_llama2_7b_is_six_times_its_weights_plus_attention():
    config = KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]
    embedding = config.vocab_size * config.hidden_size
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert count_parameters(config) == 6_738_415_616  # the published 6.7B
    assert matmul_parameters(config) == 6_738_415_616 - embedding - norms == 6_607_077_376
    # the dense part is ~6 x 6.7e9 (6.6e9 without the embedding lookup)
    assert 6 * matmul_parameters(config) == pytest.approx(6 * 6.7e9, rel=0.02)
    # attention at LLaMA-2's 4096 context: 12 x 32 layers x 4096 x 4096 = 6.4e9 per token, 14 % of the total
    per_token = training_flops_per_token(config, 4096)
    assert per_token - 6 * matmul_parameters(config) == 12 * 32 * 4096 * 4096
    assert per_token == pytest.approx(4.61e10, rel=0.01)


def test_mfu_is_achieved_over_peak():
    # 7B at 4096 on an A100 (312 TFLOP/s): 3000 tokens/s per GPU is about 44 % MFU
    per_token = training_flops_per_token(KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"], 4096)
    assert mfu(3000, per_token, 312e12) == pytest.approx(3000 * 4.61e10 / 312e12, rel=0.01)
    assert mfu(3000, per_token, 312e12) == pytest.approx(0.443, abs=0.002)
