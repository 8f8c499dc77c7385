"""Train the tiny model with a ThroughputCallback; shared by the tests and run by torchrun for the 2-process test.

torchrun --nproc_per_node 2 tests/callbacks/throughput_worker.py OUTPUT_JSON [padded|packed] [ZERO_PRESET]
"""

import json
import sys
import tempfile

from datasets import Dataset

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.batching import make_collator
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import tokenize_records
from hf_scale.tiny import generate_tasks
from hf_scale.tiny.build import build_tiny_model, build_tiny_tokenizer
from hf_scale.trainer import ScaleTrainer

EXAMPLES = 64


def tiny_setup():
    """(tokenizer, tokenized dataset of EXAMPLES generated records)."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = tokenizer.unk_token
    dataset, _ = tokenize_records(generate_tasks()[0][:EXAMPLES], tokenizer, ALPACA, max_length=128)
    return tokenizer, dataset


def train(
    tokenizer,
    dataset: Dataset,
    output_dir: str,
    packing: bool,
    callbacks: list | None = None,
    model=None,
    **arguments,
):
    """Train `model` (by default a new tiny model) one epoch (by default) and return the trainer; its
    ThroughputCallback comes after `callbacks`."""
    arguments = {"num_train_epochs": 1, "per_device_train_batch_size": 8, **arguments}
    args = ScaleTrainingArguments(
        output_dir=output_dir,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        ddp_find_unused_parameters=False,
        **arguments,
    )
    trainer = ScaleTrainer(
        model=model if model is not None else build_tiny_model(tokenizer),
        args=args,
        train_dataset=dataset,
        data_collator=make_collator(tokenizer, packing=packing),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def main(output: str, batching: str, zero_preset: str | None = None) -> None:
    tokenizer, dataset = tiny_setup()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = train(
            tokenizer, dataset, output_dir, packing=batching == "packed", logging_steps=2, zero_preset=zero_preset
        )
    if trainer.is_world_process_zero():
        with open(output, "w") as file:
            json.dump({"world_size": trainer.args.world_size, "log_history": trainer.state.log_history}, file)
    trainer.accelerator.end_training()  # a gloo thread still running at exit can abort a run that went well


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "padded", sys.argv[3] if len(sys.argv) > 3 else None)
