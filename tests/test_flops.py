"""hf_scale.flops against torch's FlopCounterMode on a real forward + backward, and against LLaMA-2 7B's figures."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from hf_scale.data.batching import make_collator
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import tokenize_records
from hf_scale.flops import (
    adapter_parameters,
    attention_flops_per_token,
    effective_seq_len,
    frozen_matmul_parameters,
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


# The tiny model: hidden 64, 3 layers, MLP 256, vocab 517, LM head tied to the embedding.
TINY_MATMUL = 3 * (4 * 64 * 64 + 3 * 64 * 256) + 64 * 517  # q, k, v, o + gate, up, down per layer + LM head
TINY_ATTENTION = 12 * 3 * 64  # per token, x seq_len
LORA_ON_Q_AND_V = 3 * 2 * (8 * 64 + 64 * 8)  # rank 8: A (8 x 64) and B (64 x 8) on q and v of 3 layers


def lora_model(tiny_model_dir, **lora) -> torch.nn.Module:
    """The tiny model, eager attention (FlopCounterMode counts its products), rank 8 LoRA on q and v."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.set_attn_implementation("eager")
    return get_peft_model(model, LoraConfig(r=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **lora))


def counted_per_token(model, seq_len: int = 256) -> float:
    """FLOPs that FlopCounterMode counts per token of one forward + backward, with the embedding output requiring
    a gradient (as gradient checkpointing makes it): otherwise autograd skips the first layer's input gradient."""
    model.enable_input_require_grads()
    batch = {"input_ids": torch.randint(0, 500, (2, seq_len), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    total, _ = counted_training_flops(model, batch)
    return total / batch["input_ids"].numel()


def test_full_fine_tuning_is_six_times_every_weight(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.set_attn_implementation("eager")
    assert matmul_parameters(model.config) == TINY_MATMUL == 229_696
    assert frozen_matmul_parameters(model) == 0 and adapter_parameters(model) == 0
    expected = 6 * TINY_MATMUL + TINY_ATTENTION * 256
    assert training_flops_per_token(model.config, 256) == expected  # the defaults: unchanged
    assert training_flops_per_token(model.config, 256, frozen=0, adapters=0) == expected
    assert counted_per_token(model) == pytest.approx(expected, rel=1e-9)  # torch's count, exactly


def test_lora_leaves_out_the_weight_gradients_of_the_frozen_base(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    # the whole base is frozen, LM head included (a product although tied to the embedding, a lookup)
    assert frozen_matmul_parameters(model) == TINY_MATMUL
    assert adapter_parameters(model) == LORA_ON_Q_AND_V == 6_144
    per_token = training_flops_per_token(model.config, 256, frozen=TINY_MATMUL, adapters=LORA_ON_Q_AND_V)
    # forward 2N, input gradients 2N, no weight gradients of the base; adapters 6 x theirs
    assert per_token == 4 * TINY_MATMUL + 6 * LORA_ON_Q_AND_V + TINY_ATTENTION * 256
    assert counted_per_token(model) == pytest.approx(per_token, rel=1e-9)
    full = training_flops_per_token(model.config, 256)
    assert full - per_token == 2 * TINY_MATMUL - 6 * LORA_ON_Q_AND_V  # a quarter lower here


def test_qlora_counts_the_frozen_4bit_base_as_lora_counts_its_16bit_one(tiny_model_dir):
    """A 4-bit weight packs two values a byte: the base is counted from the layers' shapes, frozen, as for LoRA (the
    dequantization is hardware work, not model FLOPs, as gradient checkpointing's recomputation is not)."""
    from hf_scale.modeling import ModelArguments, load_model, load_tokenizer

    lora = dict(lora_r=8, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"], quantization="nf4")
    model = load_model(ModelArguments(**lora), str(tiny_model_dir), load_tokenizer(str(tiny_model_dir)))
    assert frozen_matmul_parameters(model) == TINY_MATMUL
    assert adapter_parameters(model) == LORA_ON_Q_AND_V


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # the trained copy is untied: wanted here
def test_lora_with_a_trained_lm_head_counts_its_weight_gradient_once(tiny_model_dir):
    # modules_to_save: a trainable copy of the LM head runs; PEFT keeps the frozen original, which does not run
    model = lora_model(tiny_model_dir, modules_to_save=["lm_head"])
    lm_head = 64 * 517
    assert frozen_matmul_parameters(model) == TINY_MATMUL - lm_head
    assert adapter_parameters(model) == LORA_ON_Q_AND_V
    per_token = training_flops_per_token(model.config, 256, frozen=TINY_MATMUL - lm_head, adapters=LORA_ON_Q_AND_V)
    assert counted_per_token(model) == pytest.approx(per_token, rel=1e-9)


def test_adapters_that_do_not_run_are_not_counted(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    # a second adapter, loaded but not active: frozen, and its A and B do not run
    model.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not any(p.requires_grad for name, p in model.named_parameters() if ".other." in name)
    assert adapter_parameters(model) == LORA_ON_Q_AND_V
    assert frozen_matmul_parameters(model) == TINY_MATMUL
    with model.disable_adapter():
        assert adapter_parameters(model) == 0


def test_a_preference_reference_forward_adds_what_torch_counts_for_one_forward(tiny):
    """The reference's no-grad forward at every step (adapters off, or a second model): counted by FlopCounterMode."""
    tokenizer, model = tiny
    seq_len = 256
    batch = {"input_ids": torch.randint(0, len(tokenizer), (2, seq_len))}
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**batch)
    forward = counter.get_total_flops() / batch["input_ids"].numel()
    added = training_flops_per_token(model.config, seq_len, reference_forward=True) - training_flops_per_token(
        model.config, seq_len
    )
    assert added == pytest.approx(forward, rel=0.10)
