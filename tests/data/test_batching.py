import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.batching import is_packed_batch, make_collator, padding_fraction
from hf_scale.data.summary import render_masked_example
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import generate_tasks
from hf_scale.trainer import ScaleTrainer


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = generate_tasks()[0][:6]
    records[2] = {**records[2], "output": records[2]["output"] + " and a much longer answer than the others"}
    dataset, _ = tokenize_records(records, tokenizer, ALPACA, max_length=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    return tokenizer, [dataset[i] for i in range(len(dataset))], model


def loss_sum_and_count(model, example):
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor(example["labels"][1:])
    logits = model(input_ids=ids).logits[0, :-1]
    mask = labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum")
    return loss, mask.sum()


@pytest.mark.parametrize(
    "attention, packed_sdpa, runs_on",
    [("sdpa", True, "hf_scale_packed_sdpa"), ("sdpa", False, "sdpa"), ("eager", True, "eager")],
)
@torch.no_grad()
def test_packed_loss_is_the_token_weighted_mean_of_the_examples(setup, tmp_path, attention, packed_sdpa, runs_on):
    tokenizer, examples, model = setup
    model.set_attn_implementation(attention)
    sums, counts = zip(*(loss_sum_and_count(model, example) for example in examples), strict=True)
    expected = torch.stack(sums).sum() / torch.stack(counts).sum()

    batch = make_collator(tokenizer, packing=True)(examples)
    assert is_packed_batch(batch) and batch["input_ids"].shape[0] == 1
    # use_cache=True: the Trainer copies it into the model config, where it would disable the packed mask
    args = ScaleTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cache=True, packed_sdpa=packed_sdpa)
    trainer = ScaleTrainer(model=model, args=args)
    packed = trainer.compute_loss(model, dict(batch))
    assert abs(packed.item() - expected.item()) < 1e-5
    assert model.config._attn_implementation == runs_on  # sdpa runs each example alone unless told not to


@torch.no_grad()
def test_each_examples_logits_are_unchanged_by_its_neighbours(setup, tiny_model_dir):
    tokenizer, examples, _ = setup
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    assert model.config.use_cache  # as saved: what a model used outside the Trainer has
    batch = make_collator(tokenizer, packing=True)(examples)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    with_cache = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    start, leaked = 0, 0.0
    for example in examples:
        alone = model(input_ids=torch.tensor([example["input_ids"]])).logits[0]
        end = start + len(example["input_ids"])
        assert (packed[start:end] - alone).abs().max() < 1e-4
        leaked = max(leaked, (with_cache[start:end] - alone).abs().max().item())
        start = end
    # the trap: with the config's use_cache=True transformers builds a KV cache and no packed mask
    assert leaked > 1e-2


def test_padded_batches_pad_labels_with_ignore_index(setup):
    tokenizer, examples, _ = setup
    batch = make_collator(tokenizer, packing=False, pad_to_multiple_of=8)(examples)
    assert batch["input_ids"].shape[1] % 8 == 0
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        assert batch["labels"][row, :n].tolist() == example["labels"]
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all() and (batch["attention_mask"][row, n:] == 0).all()


@torch.no_grad()
def test_a_tokenizer_saved_with_left_padding_still_pads_training_batches_on_the_right(setup, tiny_model_dir, tmp_path):
    # Many chat models save padding_side="left" (for generation). Left-padded training shifts every shorter
    # example: LLaMA takes positions from the cache positions, not the attention mask, so its loss changes.
    # (transformers 5 saves the padding side given when loading; one set on the attribute afterwards is not saved)
    AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.padding_side == "left"  # as saved: what the tokenizer says for generation is kept
    _, examples, _ = setup
    pair = [examples[0], examples[2]]
    assert len(pair[0]["input_ids"]) < len(pair[1]["input_ids"])  # the first one is padded

    batch = make_collator(tokenizer, packing=False)(pair)

    for row, example in enumerate(pair):
        n = len(example["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == example["input_ids"]
        assert batch["labels"][row, :n].tolist() == example["labels"]
        assert (batch["attention_mask"][row, :n] == 1).all() and (batch["attention_mask"][row, n:] == 0).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
    # The batch's loss is the token-weighted mean of each example's loss alone, unpadded. LLaMA's rotary positions
    # are relative, so its loss would come out the same padded left; a model with learned absolute positions
    # (GPT-2's) shows what left padding does to training: measured here, 6.2746 left against 6.2288 alone.
    torch.manual_seed(0)
    absolute = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=256)
    absolute.bos_token_id = absolute.eos_token_id = tokenizer.eos_token_id
    for model in (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval(),
        GPT2LMHeadModel(absolute).eval(),
    ):
        sums, counts = zip(*(loss_sum_and_count(model, example) for example in pair), strict=True)
        expected = (torch.stack(sums).sum() / torch.stack(counts).sum()).item()
        assert model(**batch).loss.item() == pytest.approx(expected, abs=1e-5), type(model).__name__
    assert tokenizer.padding_side == "left"  # the collator pads right without changing the shared tokenizer


def test_padding_fractions():
    lengths = [10, 20, 30, 40]
    assert padding_fraction(lengths, 2, "pad_to_max_length", max_length=40) == pytest.approx(1 - 100 / 160)
    assert padding_fraction(lengths, 4, "dynamic") == pytest.approx(1 - 100 / 160)
    assert padding_fraction(lengths, 1, "dynamic") == 0
    # transformers' LengthGroupedSampler sorts within megabatches (12 batches of 2 here): nearly every pair is equal
    mixed = [10, 40] * 50
    assert padding_fraction(mixed, 2, "group_by_length") < 0.1 < 0.2 < padding_fraction(mixed, 2, "dynamic")
    assert padding_fraction(lengths, 2, "packing") == 0
    assert padding_fraction([5], 1, "dynamic", pad_to_multiple_of=8) == pytest.approx(3 / 8)


def test_rendered_example_marks_the_trained_span(setup):
    tokenizer, examples, _ = setup
    text = render_masked_example(tokenizer, examples[0]["input_ids"], examples[0]["labels"])
    assert text.startswith("<s>Below is an instruction") and text.endswith("### Response:\n⟦" + text.split("⟦")[1])
    assert text.count("⟦") == 1 and text.endswith("</s>⟧")
