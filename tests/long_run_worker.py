"""A long bf16 run with an evaluation after every step; writes what accumulates to rank<N>.json.

Launched by tests/test_long_runs.py with torchrun (1 or 2 processes); not a test itself. Each evaluation records
how many wrappers `forward` has (the model's and the wrapper the loop trains) and the resident memory; each step the
process's CPU time at its end (CPU, not wall time: what another job on the machine does between the first and the last
hundred steps moves wall time, not the work a step takes); each checkpoint the disk used by output_dir.
Usage: long_run_worker.py OUTPUT_DIR STEPS.
"""

import json
import sys
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.checkpoints import checkpoints
from hf_scale.data.tokenize import IGNORE_INDEX
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model
from hf_scale.trainer import ScaleTrainer
from tests.distributed.ddp_worker import tiny_dataset

CHECKPOINT_EVERY, LIMIT = 100, 2


def forward_wrappers(module) -> int:
    """How many decorators wrap `module.forward` (each `functools.wraps` layer adds a `__wrapped__`)."""
    depth, forward = 0, module.forward
    while hasattr(forward, "__wrapped__"):
        depth, forward = depth + 1, forward.__wrapped__
    return depth


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Watch(TrainerCallback):
    def __init__(self, trainer_holder: dict) -> None:
        self.holder = trainer_holder
        self.depths: list[list[int]] = []
        self.resident: list[int] = []
        self.step_ends: list[float] = []  # process CPU seconds
        self.disk: dict[int, int] = {}
        self.kept: dict[int, int] = {}

    def on_evaluate(self, args, state, control, **kwargs):
        trainer = self.holder["trainer"]
        self.depths.append([forward_wrappers(trainer.model), forward_wrappers(trainer.model_wrapped)])
        self.resident.append(resident_bytes())

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.process_time())

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            self.disk[state.global_step] = folder_bytes(Path(args.output_dir))
            self.kept[state.global_step] = len(checkpoints(args.output_dir))


def main(output_dir: str, steps: int) -> None:
    args = ScaleTrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        learning_rate=1e-3, bf16=True, use_cpu=True, eval_strategy="steps", eval_steps=1, save_strategy="steps",
        save_steps=CHECKPOINT_EVERY, save_total_limit=LIMIT, logging_steps=CHECKPOINT_EVERY, report_to="none",
        disable_tqdm=True, ddp_find_unused_parameters=False,
    )  # fmt: skip
    path = ensure_tiny_model()
    tokenizer = load_tokenizer(str(path))
    dataset = tiny_dataset(tokenizer)
    holder: dict = {}
    watch = Watch(holder)
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(2 * args.world_size)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        callbacks=[watch],
    )
    holder["trainer"] = trainer
    trainer.train()
    report = {
        "world_size": args.world_size,
        "depths": watch.depths,
        "resident": watch.resident,
        "step_cpu_seconds": [b - a for a, b in zip(watch.step_ends, watch.step_ends[1:], strict=False)],
        "disk": watch.disk,
        "kept": watch.kept,
        "checkpoint_bytes": folder_bytes(checkpoints(output_dir)[-1]) if args.should_save else None,
        "final_checkpoints": [p.name for p in checkpoints(output_dir)],
    }
    Path(output_dir, f"rank{args.process_index}.json").write_text(json.dumps(report))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
