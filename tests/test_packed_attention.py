"""Per-example sdpa on packed rows: the same logits and gradients as one example at a time, and as the dense mask."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_scale.packed_attention import PACKED_SDPA, use_packed_sdpa

LENGTHS = [5, 9, 3, 7]


@pytest.fixture
def models(tiny_model_dir):
    """The tiny model on transformers' sdpa (dense block-diagonal mask) and a copy switched to per-example sdpa."""
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    dense.config.use_cache = False
    per_example = copy.deepcopy(dense)
    assert use_packed_sdpa(per_example) and per_example.config._attn_implementation == PACKED_SDPA
    return dense, per_example


def packed_row(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    examples = [torch.randint(5, 100, (n,), generator=generator) for n in lengths]
    return examples, torch.cat(examples)[None], torch.cat([torch.arange(n) for n in lengths])[None]


def test_logits_equal_one_example_at_a_time_and_the_dense_mask(models):
    dense, per_example = models
    examples, ids, positions = packed_row(LENGTHS)
    with torch.no_grad():
        alone = torch.cat([dense(input_ids=e[None]).logits[0] for e in examples])
        packed = per_example(input_ids=ids, position_ids=positions).logits[0]
        masked = dense(input_ids=ids, position_ids=positions).logits[0]
    assert (packed - alone).abs().max() < 1e-5
    assert (packed - masked).abs().max() < 1e-5


def test_gradients_equal_the_dense_mask(models):
    dense, per_example = models
    _, ids, positions = packed_row(LENGTHS)
    for model in models:
        model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
    for (name, a), b in zip(dense.named_parameters(), per_example.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_several_packed_rows_in_one_batch(models):
    dense, per_example = models
    _, first, first_positions = packed_row([6, 6, 12], seed=1)
    _, second, second_positions = packed_row([10, 14], seed=2)
    ids, positions = torch.cat([first, second]), torch.cat([first_positions, second_positions])
    with torch.no_grad():
        expected = dense(input_ids=ids, position_ids=positions).logits
        assert (per_example(input_ids=ids, position_ids=positions).logits - expected).abs().max() < 1e-5


def test_padded_batches_and_generation_are_unchanged(models):
    dense, per_example = models
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as in generation
    with torch.no_grad():
        expected = dense(input_ids=ids, attention_mask=mask).logits
        assert (per_example(input_ids=ids, attention_mask=mask).logits - expected).abs().max() < 1e-5
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(per_example.generate(ids, **settings), dense.generate(ids, **settings))


def test_only_sdpa_models_without_a_sliding_window_switch(tiny_model_dir):
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert not use_packed_sdpa(eager) and eager.config._attn_implementation == "eager"
    windowed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    windowed.config.sliding_window = 4
    assert not use_packed_sdpa(windowed) and windowed.config._attn_implementation == "sdpa"
