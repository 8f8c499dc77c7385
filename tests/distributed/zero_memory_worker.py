"""Trains the tiny model 3 steps in bf16 under a ZeRO preset and writes the bytes each rank's engine holds.

Launched by test_zero_memory.py with torchrun; not a test itself. The bytes are summed from the engine's own
tensors (each storage once) at the two moments where ZeRO's model states peak: when the gradients are reduced,
and when the inner optimizer steps (the fp32 gradient partition exists then). Usage: PRESET OUTPUT_DIR.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.data.tokenize import IGNORE_INDEX
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model
from hf_scale.trainer import ScaleTrainer
from tests.distributed.ddp_worker import tiny_dataset

# Where each kind of model state lives in DeepSpeed 0.19's ZeRO-1/2 (stage_1_and_2.py) and ZeRO-3 (stage3.py).
GRADIENT_BUFFERS = ("averaged_gradients", "grad_partitions_flat_buffer")
MASTER_WEIGHTS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def flat(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flat(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in flat(item)]
    return []


def held_bytes(engine) -> dict[str, int]:
    optimizer = engine.optimizer
    seen: set = set()
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    masters = [t for name in MASTER_WEIGHTS for t in flat(getattr(optimizer, name, []))]
    gradients = [p.grad for p in engine.module.parameters()]
    gradients += [t for name in GRADIENT_BUFFERS for t in flat(getattr(optimizer, name, []))]
    gradients += [master.grad for master in masters]
    return {
        "parameters": storage_bytes(params, seen),
        "gradients": storage_bytes(gradients, seen),
        "optimizer_states": storage_bytes(masters + flat(optimizer.optimizer.state), seen),
    }


class MeasureModelStates(TrainerCallback):
    """From step 2 on (buffers are built lazily in step 1), measure at each reduction and inner optimizer step."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = defaultdict(int)
        self.engine = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        self.engine = trainer.model_wrapped
        optimizer = self.engine.optimizer
        for owner, method in ((optimizer.optimizer, "step"), (self.engine, "allreduce_gradients")):
            setattr(owner, method, self._measuring(getattr(owner, method)))

    def _measuring(self, method):
        def measured(*args, **kwargs):
            for kind, value in held_bytes(self.engine).items():
                self.peak[kind] = max(self.peak[kind], value)
            return method(*args, **kwargs)

        return measured


preset, output_dir = sys.argv[1], Path(sys.argv[2])
args = prepare_run(
    ScaleTrainingArguments(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=8,
        report_to="none",
        save_strategy="no",
        zero_preset=preset,
        bf16=True,
        disable_tqdm=True,
    )
)  # before the model loads: ZeRO-3 partitions it as it loads
with args.main_process_first():
    path = ensure_tiny_model()
tokenizer = load_tokenizer(str(path))
measure = MeasureModelStates()
trainer = ScaleTrainer(
    model=AutoModelForCausalLM.from_pretrained(path),
    args=args,
    train_dataset=tiny_dataset(tokenizer).select(range(64)),
    data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
    processing_class=tokenizer,
    callbacks=[measure],
)
trainer.train()
output_dir.mkdir(parents=True, exist_ok=True)
(output_dir / f"rank{args.process_index}.json").write_text(json.dumps(dict(measure.peak)))
