"""Does ScaleTrainer cost anything over the plain Trainer? Both train the tiny model side by side.

    make bench        # or: python bench/trainer_overhead.py --steps 200 --rounds 5

Each round trains the same model from the same weights on the same batches with `transformers.Trainer` and
with `ScaleTrainer`, alternating which goes first, and prints steps/s for each and their ratio. The machines
here are noisy: read the ratio, not the seconds.
"""

import argparse
import statistics
import tempfile
import time

from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model, generate_tasks
from hf_scale.trainer import ScaleTrainer


def steps_per_second(trainer_class, args_class, path, dataset, tokenizer, steps: int) -> float:
    with tempfile.TemporaryDirectory() as output_dir:
        args = args_class(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=32,
            learning_rate=5e-3,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=steps,
            seed=0,
        )
        trainer = trainer_class(
            model=AutoModelForCausalLM.from_pretrained(path),
            args=args,
            train_dataset=dataset,
            data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        )
        start = time.perf_counter()
        trainer.train()
        return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()

    path = ensure_tiny_model()
    tokenizer = load_tokenizer(str(path))
    dataset, _ = tokenize_records(generate_tasks()[0], tokenizer, ALPACA, max_length=128)
    plain, scale = [], []
    for round_index in range(options.rounds):
        runs = [(plain, Trainer, TrainingArguments), (scale, ScaleTrainer, ScaleTrainingArguments)]
        for results, trainer_class, args_class in runs[:: 1 if round_index % 2 == 0 else -1]:
            results.append(steps_per_second(trainer_class, args_class, path, dataset, tokenizer, options.steps))
    ratio = statistics.median(s / p for s, p in zip(scale, plain, strict=True))
    print(f"{'trainer':<14}{'median steps/s':>16}")
    print(f"{'Trainer':<14}{statistics.median(plain):>16.1f}")
    print(f"{'ScaleTrainer':<14}{statistics.median(scale):>16.1f}")
    print(f"ScaleTrainer / Trainer throughput ratio (median of {options.rounds} paired rounds): {ratio:.3f}")


if __name__ == "__main__":
    main()
