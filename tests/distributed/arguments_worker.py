"""Builds ScaleTrainingArguments in a launched process and says what that did; then what `prepare_run` does.

Launched by tests/test_arguments.py with torchrun; not a test itself. Usage: OUTPUT_DIR. Prints one JSON line per rank.
"""

import json
import os
import sys

import deepspeed.comm
import torch.distributed as dist

from hf_scale.arguments import ScaleTrainingArguments, prepare_run

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
writes: list[str] = []


def record_writes(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args
        if (mode and any(c in mode for c in "wax+")) or (flags and flags & WRITE_FLAGS):
            writes.append(f"open {path}")
    elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree"):
        writes.append(f"{event} {args[0]}")


output_dir = sys.argv[1]
sys.addaudithook(record_writes)
args = ScaleTrainingArguments(
    output_dir=output_dir,
    zero_preset="zero3",
    per_device_train_batch_size=2,
    global_batch_size=16,
    resume="auto",
    report_to="none",
)
built = {
    "writes": list(writes),
    "deepspeed_comm": deepspeed.comm.is_initialized(),
    "torch_process_group": dist.is_initialized(),
    "accumulation": args.gradient_accumulation_steps,
}
args = prepare_run(args)
print(
    json.dumps({"rank": args.process_index, "built": built, "prepared_deepspeed_comm": deepspeed.comm.is_initialized()})
)
