"""A real pretrained model: ScaleTrainer against the plain Trainer, and batched held-out generation against one prompt
at a time, on SmolLM2-135M-Instruct (the packaged GGUF, converted once) and the shared Chinese Alpaca set.

    python bench/real_model.py                                   # about 20 minutes on 2 CPU cores
    python bench/real_model.py --steps 3 --rounds 1 --records 16 --generate 4 --output real.json   # a quick look

Training. For LoRA (r 16 on q/k/v/o) and for full fine-tuning, each round trains the same model from the same weights
on the same batches (the model's own ChatML template, max_length 256, batch 4) with `transformers.Trainer` and with
`ScaleTrainer`, alternating which goes first. Both count the real tokens (attention mask) of every batch they train
on; the figure is real tokens/s over the steps after the first (the first step pays for warm-up). Printed: the median
tokens/s of each and the median of the paired ratios; with --output, every step's tokens/s and memory (resident
memory at the step's end on a CPU, the step's peak allocated memory on a GPU) for each side, in a JSON file.

Generation. `hf_scale.evaluation.generate_responses` (greedy, left-padded batches, the KV cache on) on held-out
records, batch 16 against batch 1 (one prompt at a time, what an evaluation loop over records does), paired rounds:
examples/s of each, their ratio, and how many answers are the same both ways.

The machines here are noisy: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.batching import make_collator
from hf_scale.data.loading import load_records
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import tokenize_records
from hf_scale.evaluation import generate_responses
from hf_scale.gguf_source import ensure_converted, packaged_gguf
from hf_scale.modeling import ModelArguments, load_model, load_tokenizer
from hf_scale.trainer import ScaleTrainer

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO.parent / "shared" / "data" / "alpaca_zh_demo.json"
METHODS = {
    "LoRA": ModelArguments(lora_r=16, lora_alpha=32, lora_dropout=0.0),
    "full": ModelArguments(lora_r=0),
}
LEARNING_RATES = {"LoRA": 1e-3, "full": 2e-5}


def step_memory_bytes() -> int:
    """On a GPU the step's peak allocated memory (the peak is reset at each step's start); on a CPU the resident
    memory at the step's end (the process's own peak, ru_maxrss, only grows over the runs that share it)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return psutil.Process().memory_info().rss


def counting(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` that adds each micro-batch's real tokens to `self.tokens` (the same count on both sides)."""

    class Counting(trainer_class):
        tokens = 0

        def training_step(self, model, inputs, *args, **kwargs):
            self.tokens += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    return Counting


class StepRecorder(TrainerCallback):
    """Each step's wall time, real tokens and memory (`step_memory_bytes`)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.trainer: Trainer | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.started, self.tokens_before = time.perf_counter(), self.trainer.tokens

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.started
        tokens = self.trainer.tokens - self.tokens_before
        self.steps.append({"tokens": tokens, "seconds": seconds, "memory_bytes": step_memory_bytes()})


def train(trainer_class, args_class, method: str, path: Path, tokenizer, dataset, options) -> dict:
    """One run of `options.steps` steps; its tokens/s after the first step and its per-step records."""
    with tempfile.TemporaryDirectory() as output_dir:
        args = args_class(
            output_dir=output_dir,
            max_steps=options.steps,
            per_device_train_batch_size=options.batch_size,
            learning_rate=LEARNING_RATES[method],
            lr_scheduler_type="cosine",
            warmup_steps=0.1,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=options.steps,
            seed=0,
            bf16=torch.cuda.is_available(),
        )
        recorder = StepRecorder()
        trainer = counting(trainer_class)(
            model=load_model(METHODS[method], str(path), tokenizer),
            args=args,
            train_dataset=dataset,
            data_collator=make_collator(tokenizer, packing=False),
            callbacks=[recorder],
        )
        recorder.trainer = trainer
        trainer.train()
    timed = recorder.steps[1:] or recorder.steps
    tokens_per_second = sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed)
    return {"tokens_per_second": tokens_per_second, "steps": recorder.steps}


def compare_trainers(method: str, path: Path, tokenizer, dataset, options) -> dict:
    sides = {"Trainer": (Trainer, TrainingArguments, []), "ScaleTrainer": (ScaleTrainer, ScaleTrainingArguments, [])}
    for round_index in range(options.rounds):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for name in order:
            trainer_class, args_class, runs = sides[name]
            runs.append(train(trainer_class, args_class, method, path, tokenizer, dataset, options))
    plain, scale = sides["Trainer"][2], sides["ScaleTrainer"][2]
    ratios = [s["tokens_per_second"] / p["tokens_per_second"] for s, p in zip(scale, plain, strict=True)]
    return {"ratio": statistics.median(ratios), "Trainer": plain, "ScaleTrainer": scale}


def compare_generation(path: Path, tokenizer, records: list[dict], template, options) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path).to("cuda" if torch.cuda.is_available() else "cpu")
    rates: dict[int, list[float]] = {1: [], options.generation_batch: []}
    answers: dict[int, list[str]] = {}
    for round_index in range(options.rounds):
        order = list(rates) if round_index % 2 == 0 else list(rates)[::-1]
        for batch_size in order:
            started = time.perf_counter()
            answers[batch_size] = generate_responses(
                model, tokenizer, records, template, options.max_new_tokens, batch_size
            )
            rates[batch_size].append(len(records) / (time.perf_counter() - started))
    one, batched = rates[1], rates[options.generation_batch]
    same = sum(a == b for a, b in zip(answers[1], answers[options.generation_batch], strict=True))
    ratio = statistics.median(b / o for b, o in zip(batched, one, strict=True))
    return {"examples_per_second": {"1": one, str(options.generation_batch): batched}, "ratio": ratio, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (each side once per round)")
    parser.add_argument("--records", type=int, default=400, help="training records from the start of the set")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--methods", default="LoRA,full", help="comma-separated: LoRA, full")
    parser.add_argument("--generate", type=int, default=32, help="held-out records answered (from the set's end)")
    parser.add_argument("--generation_batch", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--output", type=Path, help="a JSON file for every run's per-step records")
    options = parser.parse_args()

    path = ensure_converted(packaged_gguf("SmolLM2-135M-Instruct"))
    tokenizer = load_tokenizer(str(path))
    template = get_template("chat_template", tokenizer=tokenizer)
    records = load_records(str(options.dataset))[0].to_list()  # a thousand records: sliced as a list below
    dataset, summary = tokenize_records(records[: options.records], tokenizer, template, options.max_length)
    print(f"{path.name}: {summary}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    report: dict = {"device": device, "options": {k: str(v) for k, v in vars(options).items()}}

    print(
        f"\ntraining, {options.steps} steps x {options.rounds} rounds per side, real tokens/s after step 1 ({device})"
    )
    print(f"{'method':<8}{'Trainer':>12}{'ScaleTrainer':>14}{'ratio':>8}{'memory GiB':>12}")
    for method in options.methods.split(","):
        result = report[method] = compare_trainers(method, path, tokenizer, dataset, options)
        plain, scale = (
            statistics.median(r["tokens_per_second"] for r in result[s]) for s in ("Trainer", "ScaleTrainer")
        )
        peaks = [max(s["memory_bytes"] for s in r["steps"]) / 2**30 for r in result["ScaleTrainer"]]
        print(f"{method:<8}{plain:>12.1f}{scale:>14.1f}{result['ratio']:>8.3f}{max(peaks):>12.2f}")
    print(
        "ratio: ScaleTrainer / Trainer tokens/s, the median of the paired ratios; memory: ScaleTrainer's largest step"
    )

    held_out = records[-options.generate :]
    generation = report["generation"] = compare_generation(path, tokenizer, held_out, template, options)
    one, batched = (statistics.median(v) for v in generation["examples_per_second"].values())
    print(f"\nheld-out greedy generation, {len(held_out)} records, up to {options.max_new_tokens} new tokens")
    print(f"batch 1: {one:.2f} examples/s; batch {options.generation_batch}: {batched:.2f} examples/s")
    print(
        f"batched / one at a time: {generation['ratio']:.2f}x (median of {options.rounds} paired rounds); "
        f"the same answer both ways: {generation['same']} of {len(held_out)}"
    )
    if options.output:
        options.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
