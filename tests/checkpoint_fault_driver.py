"""Kills training with SIGKILL again and again, then resumes it to the end, as a cluster's requeue does.

Run by tests/test_checkpoints.py as `python tests/checkpoint_fault_driver.py OUTPUT_DIR KILLS SEED [MODE]`. This
process only imports and forks: each training run is a forked child (no torch work happens in the parent
before a fork, so no thread pool is copied mid-use), and every child is the same command, with resume="auto".
MODE "saves" (the default): for each kill the parent waits for a new checkpoint-N folder to appear, waits a
random 0-40 ms (a save of the tiny model takes about that long) and SIGKILLs the child; a child that resumes from
a torn checkpoint fails, and the parent records its exit status; then one child resumes to the end. MODE
"anytime": each child is SIGKILLed at a random moment of its run (before its first checkpoint, between saves,
inside one...) and relaunched until one exits by itself, KILLS times at most; then the finished run is
launched once more, which must train nothing. Finally one child trains without interruption. The weights and
the global step of each end go to a safetensors file and a JSON file.
"""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.checkpoints import checkpoints, is_complete, last_complete_checkpoint
from hf_scale.data.tokenize import IGNORE_INDEX
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model
from hf_scale.trainer import ScaleTrainer
from tests.distributed.ddp_worker import tiny_dataset

MAX_STEPS = 90


def train(output_dir: Path, weights_file: Path | None) -> None:
    """Train (resuming when a complete checkpoint exists) to MAX_STEPS; runs in a forked child."""
    path = ensure_tiny_model()
    tokenizer = load_tokenizer(str(path))
    args = ScaleTrainingArguments(
        output_dir=str(output_dir), max_steps=MAX_STEPS, per_device_train_batch_size=8, learning_rate=3e-3,
        save_strategy="steps", save_steps=3, save_total_limit=2, logging_steps=5, report_to="none",
        disable_tqdm=True, seed=7, resume="auto",
    )  # fmt: skip
    trainer = ScaleTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        args=args,
        train_dataset=tiny_dataset(tokenizer),
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
    )
    trainer.train()
    if weights_file is not None:
        save_file({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, str(weights_file))
        weights_file.with_suffix(".json").write_text(json.dumps({"global_step": trainer.state.global_step}))


def in_child(function, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            function(*args)
        except BaseException as error:  # the parent reads the status; the message goes to stderr
            print(f"child failed: {error!r}", file=sys.stderr, flush=True)
            code = 3
        os._exit(code)
    return pid


def exit_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def kill_during_a_save(output_dir: Path, rng: random.Random) -> dict:
    """Start a child, SIGKILL it shortly after a new checkpoint folder appears; say what was on disk then."""
    before = {p.name for p in checkpoints(output_dir)}
    pid = in_child(train, output_dir, None)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [p for p in checkpoints(output_dir) if p.name not in before]
        if new:
            time.sleep(rng.uniform(0, 0.04))
            complete = is_complete(new[-1])
            os.kill(pid, signal.SIGKILL)
            exit_status(pid)
            return {"checkpoint": new[-1].name, "complete_when_killed": complete}
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            return {"checkpoint": None, "exit": os.waitstatus_to_exitcode(status)}
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    return {"checkpoint": None, "exit": "timeout"}


def kill_at_a_random_moment(output_dir: Path, rng: random.Random, weights_file: Path, first: bool) -> dict:
    """Start a child and SIGKILL it at a random moment of its run; or let it end, if it ends first.

    The first child dies while it starts (before any checkpoint). The others die 0-1.5 s after their first new
    checkpoint (before, inside or after a later save: saves come every 3 steps), so that each relaunch gets on
    whatever the machine's load."""
    before = last_complete_checkpoint(output_dir)
    pid = in_child(train, output_dir, weights_file)
    progressed = first or (lambda: last_complete_checkpoint(output_dir) != before)
    deadline = time.monotonic() + (rng.uniform(0.01, 0.2) if first else 120)
    delay = rng.uniform(0, 1.5)
    while time.monotonic() < deadline:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            return {"resumed_from": before and before.name, "exit": os.waitstatus_to_exitcode(status)}
        if progressed is not True and progressed():
            progressed, deadline = True, time.monotonic() + delay
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    exit_status(pid)
    after = last_complete_checkpoint(output_dir)
    return {"resumed_from": before and before.name, "killed_at": after and after.name}


def main(output_dir: Path, kills: int, seed: int, mode: str) -> None:
    rng = random.Random(seed)
    killed_run = output_dir / "killed"
    report = {}
    if mode == "saves":
        report["events"] = [kill_during_a_save(killed_run, rng) for _ in range(kills)]
        report["resumed_exit"] = exit_status(in_child(train, killed_run, output_dir / "resumed.safetensors"))
    else:
        events = []
        while len(events) < kills and (not events or "exit" not in events[-1]):
            events.append(kill_at_a_random_moment(killed_run, rng, output_dir / "resumed.safetensors", not events))
        report["events"] = events
        report["relaunch_exit"] = exit_status(in_child(train, killed_run, output_dir / "relaunched.safetensors"))
    report["unbroken_exit"] = exit_status(in_child(train, output_dir / "unbroken", output_dir / "unbroken.safetensors"))
    (output_dir / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "saves")
