"""Soak: 3000 tiny steps with an evaluation and a checkpoint every 100 and save_total_limit=2 keep resident memory
flat (the last 1000 steps within 5 % of the 1000 before) and disk use bounded by the limit."""

import pytest
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.checkpoints import checkpoints, is_complete
from hf_scale.data.tokenize import IGNORE_INDEX
from hf_scale.modeling import load_tokenizer
from hf_scale.trainer import ScaleTrainer
from tests.distributed.ddp_worker import tiny_dataset

STEPS, EVERY, LIMIT = 3000, 100, 2


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def folder_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Watch(TrainerCallback):
    """Resident memory and disk use after every checkpoint."""

    def __init__(self, output_dir) -> None:
        self.output_dir, self.resident, self.disk, self.checkpoints = output_dir, {}, {}, {}

    def on_save(self, args, state, control, **kwargs):
        self.resident[state.global_step] = resident_bytes()
        self.disk[state.global_step] = folder_bytes(self.output_dir)
        self.checkpoints[state.global_step] = len(checkpoints(self.output_dir))


@pytest.mark.slow
def test_long_run_keeps_memory_flat_and_disk_bounded(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    dataset = tiny_dataset(tokenizer)
    args = ScaleTrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
        eval_strategy="steps", eval_steps=EVERY, save_strategy="steps", save_steps=EVERY, save_total_limit=LIMIT,
        logging_steps=EVERY, report_to="none", disable_tqdm=True,
    )  # fmt: skip
    watch = Watch(tmp_path)
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(32)),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        callbacks=[watch],
    )
    trainer.train()
    assert len(watch.resident) == STEPS // EVERY
    middle = max(watch.resident[s] for s in range(1100, 2001, EVERY))
    last = max(watch.resident[s] for s in range(2100, STEPS + 1, EVERY))
    assert last <= 1.05 * middle, (middle, last)
    assert max(watch.checkpoints.values()) <= LIMIT
    kept = checkpoints(tmp_path)
    assert len(kept) == LIMIT and all(is_complete(path) for path in kept)
    one_checkpoint = folder_bytes(kept[-1])
    assert max(watch.disk.values()) <= (LIMIT + 0.5) * one_checkpoint  # the limit, and the runs folder etc.
