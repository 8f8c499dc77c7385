"""The instruction-data pipeline on the real Alpaca sets, measured side by side in one run.

    python bench/data_pipeline.py            # needs ../shared/data (alpaca_en_demo.json, alpaca_zh_demo.json)
    python bench/data_pipeline.py --vocab-size 2000 --repeats 1 --steps 3 --rounds 1   # a quick look (the suite)

(a) tokenization examples/s: hf_scale's batched, exact pipeline against Stanford Alpaca's `preprocess` (one
    text at a time, the prompt tokenized a second time, mask = len(tokenize(prompt)));
(b) the share of batch tokens that are padding: pad-to-512, dynamic padding, length grouping, packing;
(c) real (non-pad) training tokens/s of the tiny model: packing against pad-to-512, timed after the first step
    (warm-up), in paired rounds that alternate which goes first; the ratio is the median of the rounds'.
A 32k byte-level BPE is trained on the two sets first, as a stand-in for LLaMA's tokenizer.
"""

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from transformers import DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.batching import make_collator, padding_fraction
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.tiny.build import build_tiny_model, build_tiny_tokenizer
from hf_scale.trainer import ScaleTrainer

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
SETS = {"en": ("alpaca_en_demo.json", "alpaca"), "zh": ("alpaca_zh_demo.json", "alpaca_zh")}
MAX_LENGTH = 512


def reference_loop(records, tokenizer, template):
    """Stanford Alpaca's `preprocess`: each text tokenized alone (full, then the prompt again), mask = prompt length."""
    sources = [template.format_prompt(r["instruction"], r["input"]) for r in records]
    examples = [source + r["output"] + tokenizer.eos_token for source, r in zip(sources, records, strict=True)]

    def tokenize_each(strings):
        tokenized = [
            tokenizer(text, return_tensors="pt", padding="longest", max_length=MAX_LENGTH, truncation=True)
            for text in strings
        ]
        return [t.input_ids[0] for t in tokenized], [
            t.input_ids.ne(tokenizer.pad_token_id).sum().item() for t in tokenized
        ]

    input_ids, _ = tokenize_each(examples)
    _, source_lengths = tokenize_each(sources)
    labels = []
    for ids, source_length in zip(input_ids, source_lengths, strict=True):
        label = ids.clone()
        label[:source_length] = IGNORE_INDEX
        labels.append(label)
    return input_ids, labels


def examples_per_second(function, records, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return len(records) / statistics.median(times)


class StepClock(TrainerCallback):
    """When the first step ended and when the last did: training time without the warm-up step."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.first = time.perf_counter()
        self.last = time.perf_counter()


def real_tokens_per_second(
    dataset, tokenizer, packing: bool, steps: int, batch_size: int, packed_sdpa: bool = True
) -> float:
    # packed rows hold a whole batch, so positions go up to batch x max_length
    model = build_tiny_model(tokenizer, max_position_embeddings=MAX_LENGTH * batch_size)
    if packing:
        collator = make_collator(tokenizer, packing=True)
    else:
        collator = DataCollatorForSeq2Seq(
            tokenizer, padding="max_length", max_length=MAX_LENGTH, label_pad_token_id=IGNORE_INDEX
        )
    # Steps 2..N are timed; without shuffling, their batches are the records after the first batch.
    subset = dataset.select(range(steps * batch_size))
    real_tokens = sum(len(ids) for ids in subset.select(range(batch_size, len(subset)))["input_ids"])
    clock = StepClock()
    with tempfile.TemporaryDirectory() as output_dir:
        args = ScaleTrainingArguments(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            learning_rate=1e-3,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=steps,
            seed=0,
            train_sampling_strategy="sequential",
            packed_sdpa=packed_sdpa,
        )
        trainer = ScaleTrainer(model=model, args=args, train_dataset=subset, data_collator=collator, callbacks=[clock])
        trainer.train()
        return real_tokens / (clock.last - clock.first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per batching in (c), >= 2")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds of (c), alternating which goes first")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of (a); the median counts")
    parser.add_argument("--vocab-size", type=int, default=32_000, help="of the BPE trained on the two sets")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--dense-packed-mask",
        action="store_true",
        help="packing through transformers' block-diagonal mask over the whole row (packed_sdpa=False)",
    )
    options = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} is absent: this benchmark needs the real Alpaca sets")

    loaded = {lang: json.loads((DATA / name).read_text()) for lang, (name, _) in SETS.items()}
    texts = [r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for rs in loaded.values() for r in rs]
    tokenizer = build_tiny_tokenizer(vocab_size=options.vocab_size, texts=texts)
    tokenizer.pad_token = tokenizer.unk_token

    rows = []
    for lang, (_, template_name) in SETS.items():
        records, template = loaded[lang], get_template(template_name)
        tokenize = partial(tokenize_records, records, tokenizer, template, MAX_LENGTH)
        ours = examples_per_second(tokenize, records, options.repeats)
        theirs = examples_per_second(partial(reference_loop, records, tokenizer, template), records, options.repeats)
        dataset, summary = tokenize_records(records, tokenizer, template, MAX_LENGTH)
        lengths = [len(ids) for ids in dataset["input_ids"]]
        waste = {
            kind: padding_fraction(lengths, options.batch_size, kind, max_length=MAX_LENGTH, pad_to_multiple_of=8)
            for kind in ("pad_to_max_length", "dynamic", "group_by_length", "packing")
        }
        dataset = dataset.shuffle(seed=0)
        packed, padded = [], []
        for round_index in range(options.rounds):
            modes = [(packed, True), (padded, False)][:: 1 if round_index % 2 == 0 else -1]
            for results, packing in modes:
                results.append(
                    real_tokens_per_second(
                        dataset, tokenizer, packing, options.steps, options.batch_size, not options.dense_packed_mask
                    )
                )
        ratio = statistics.median(p / q for p, q in zip(packed, padded, strict=True))
        packed, padded = statistics.median(packed), statistics.median(padded)
        rows.append((lang, len(records), statistics.median(lengths), ours, theirs, waste, packed, padded, ratio))

    print(
        f"\nbatch size {options.batch_size}, max_length {MAX_LENGTH}, BPE vocabulary {options.vocab_size}; (a) median "
        f"of {options.repeats} repeats; (c) {options.steps} steps per batching, first step untimed, median of "
        f"{options.rounds} paired rounds; packed attention: "
        f"{'dense block-diagonal mask' if options.dense_packed_mask else 'per example (hf_scale_packed_sdpa)'}"
    )
    print(
        "| set | records | median tokens | (a) pipeline ex/s | reference ex/s | ratio | (b) pad-512 | dynamic "
        "| grouped | packing | (c) packed real tok/s | pad-512 real tok/s | ratio |"
    )
    print("|" + "---|" * 13)
    for lang, n, median, ours, theirs, waste, packed, padded, ratio in rows:
        print(
            f"| {lang} | {n} | {median:.0f} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.1f}x "
            f"| {waste['pad_to_max_length']:.1%} | {waste['dynamic']:.1%} | {waste['group_by_length']:.1%} "
            f"| {waste['packing']:.1%} | {packed:,.0f} | {padded:,.0f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
