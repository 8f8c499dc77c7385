"""Trains the tiny model for a few steps under a launcher and writes what each rank saw to rank<N>.json.

Launched by the distributed tests (torchrun, single node or two nodes on loopback); not a test itself.
Extra flags are ScaleTrainingArguments flags, e.g. `--auto_cpu_ddp false`, plus the worker's own:
`--evaluate_first` (evaluate before training), `--kill_after_checkpoint N` (rank `--kill_rank`, 0 by default,
kills itself with SIGKILL once checkpoint N is saved), `--save_final` (evaluate after training and `save_model`
to <output_dir>/final), `--ascent_after N` (from step N on the learning rate is negated: the eval loss falls,
then rises), `--kill_during_saves N` (under `torchrun --max_restarts`: in each of the first N attempts a random
rank SIGKILLs itself at a random moment of its first checkpoint save; every attempt after the first resumes from the
newest complete checkpoint; what was on disk at each kill goes to kills.jsonl).
Each rank also writes the weights it holds to rank<N>.safetensors.
"""

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, HfArgumentParser, TrainerCallback, set_seed
from transformers.integrations import is_deepspeed_zero3_enabled

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.checkpoints import is_complete, last_complete_checkpoint
from hf_scale.data.batching import make_collator
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model, generate_tasks
from hf_scale.trainer import ScaleTrainer


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class KillAfterCheckpoint(TrainerCallback):
    """One rank dies without warning (SIGKILL) right after checkpoint `step` is saved, as a preempted job does."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    worker = argparse.ArgumentParser()
    worker.add_argument("--evaluate_first", action="store_true")  # the stock Trainer then trains without DDP
    worker.add_argument("--kill_after_checkpoint", type=int)
    worker.add_argument("--kill_rank", type=int, default=0)
    worker.add_argument("--save_final", action="store_true")
    worker.add_argument("--ascent_after", type=int)
    worker.add_argument("--kill_during_saves", type=int, default=0)
    worker.add_argument("--fail_save_step", type=int)  # the checkpoint save of this step fails (disk full) ...
    worker.add_argument("--fail_save_rank", type=int, default=1)  # ... on this rank only
    worker.add_argument("--packing", action="store_true")
    worker.add_argument("--lora", action="store_true")  # rank 8 on q/v, modules_to_save none
    worker.add_argument("--quantization")  # with --lora: the base quantized (QLoRA), loaded by hf_scale
    worker.add_argument("--output_dir", required=True)  # also passed on to the Trainer
    options, argv = worker.parse_known_args()
    argv += ["--output_dir", options.output_dir]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if options.kill_during_saves and last_complete_checkpoint(options.output_dir) is not None:
        argv += ["--resume", "true"]  # a restarted attempt goes on from the newest complete checkpoint
    (args,) = HfArgumentParser(ScaleTrainingArguments).parse_args_into_dataclasses(
        [
            "--max_steps",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--learning_rate",
            "3e-3",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--logging_steps",
            "4",
            "--ddp_find_unused_parameters",
            "false",
            "--disable_tqdm",
            "true",
            *argv,
        ],
        look_for_args_file=False,
    )
    args = prepare_run(args)  # before the model loads: ZeRO-3 partitions it as it loads
    with args.main_process_first():
        path = ensure_tiny_model()
    tokenizer = load_tokenizer(str(path))
    dataset = tiny_dataset(tokenizer)
    if options.quantization:
        from hf_scale.modeling import ModelArguments, load_model

        set_seed(args.seed)
        lora = dict(lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"])
        model = load_model(ModelArguments(**lora, quantization=options.quantization), str(path), tokenizer)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    if options.lora and not options.quantization:
        from peft import LoraConfig, get_peft_model

        set_seed(args.seed)  # the adapters' initial weights: the same in every run and on every rank
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    start_digest = weights_digest(model)
    trainer_class = ScaleTrainer if options.ascent_after is None else ascending_after(options.ascent_after)
    if attempt < options.kill_during_saves:
        trainer_class = killed_during_a_save(attempt, args.process_index, Path(args.output_dir))
    if options.fail_save_step is not None and args.process_index == options.fail_save_rank:
        trainer_class = failing_save(options.fail_save_step)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(32)),
        data_collator=make_collator(tokenizer, options.packing),
        processing_class=tokenizer,
        callbacks=[KillAfterCheckpoint(options.kill_after_checkpoint, options.kill_rank)]
        if options.kill_after_checkpoint
        else None,
    )
    if options.evaluate_first:
        trainer.evaluate()
    trainer.train()
    final_eval_loss = None
    if options.save_final:
        final_eval_loss = trainer.evaluate()["eval_loss"]
        trainer.save_model(str(Path(args.output_dir) / "final"))
    report = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "wrapper": type(trainer.model_wrapped).__name__,
        "start_digest": start_digest,
        "end_digest": weights_digest(trainer.model),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "deepspeed": bool(args.deepspeed),
        "q_proj_shape": list(trainer.model.get_decoder().layers[0].self_attn.q_proj.weight.shape),
        "o_proj_shape": list(trainer.model.get_decoder().layers[0].self_attn.o_proj.weight.shape),
        "final_eval_loss": final_eval_loss,
        "effective_batch_size": args.effective_batch_size,
        "eval_losses": [[e["step"], e["eval_loss"]] for e in trainer.state.log_history if "eval_loss" in e],
        "best_metric": trainer.state.best_metric,
        "global_step": trainer.state.global_step,
    }
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / f"rank{args.process_index}.json").write_text(json.dumps(report))
    held = held_weights(trainer.model)
    if options.quantization:  # the adapters: the 4-bit base is frozen, and bitsandbytes re-packs it on CPU
        held = {name: tensor for name, tensor in held.items() if "lora_" in name}
    save_file(held, str(Path(args.output_dir) / f"rank{args.process_index}.safetensors"))
    # The process group ends before the interpreter: a gloo thread still running at exit can abort the process
    # ("terminate called without an active exception") after a run that went well.
    trainer.accelerator.end_training()


def ascending_after(step: int) -> type[ScaleTrainer]:
    """A ScaleTrainer whose learning rate turns negative at `step`: gradient ascent, so the eval loss rises."""

    class AscendingTrainer(ScaleTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                factor = lambda current: 1.0 if current < step else -1.0  # noqa: E731
                self.lr_scheduler = LambdaLR(optimizer or self.optimizer, factor)
            return self.lr_scheduler

    return AscendingTrainer


def killed_during_a_save(attempt: int, rank: int, output_dir: Path) -> type[ScaleTrainer]:
    """A ScaleTrainer of which one rank, drawn per attempt, is SIGKILLed 0-50 ms into the attempt's first save.

    A ZeRO-2 save of the tiny model takes about 35-50 ms, so most kills land inside it.
    """
    draw = random.Random(attempt)
    victim, delay = draw.randrange(2), draw.uniform(0, 0.05)

    def kill(folder: Path) -> None:
        event = {"attempt": attempt, "rank": rank, "checkpoint": folder.name, "complete": is_complete(folder)}
        with open(output_dir / "kills.jsonl", "a") as log:
            log.write(json.dumps(event) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    class KilledDuringASave(ScaleTrainer):
        saves = 0

        def _save_checkpoint(self, model, trial):
            self.saves += 1
            if rank == victim and self.saves == 1:
                folder = output_dir / f"checkpoint-{self.state.global_step}"
                threading.Timer(delay, kill, (folder,)).start()
                started = time.monotonic()
            super()._save_checkpoint(model, trial)
            if rank == victim and self.saves == 1:
                print(f"save took {time.monotonic() - started:.3f} s, kill after {delay:.3f} s", flush=True)

    return KilledDuringASave


def failing_save(step: int) -> type[ScaleTrainer]:
    """A ScaleTrainer whose checkpoint save at `step` fails as a full disk does (torch.save raises ENOSPC)."""

    class FailingSave(ScaleTrainer):
        def _save_checkpoint(self, model, trial):
            if self.state.global_step != step:
                return super()._save_checkpoint(model, trial)
            original = torch.save

            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            torch.save = full_disk
            try:
                return super()._save_checkpoint(model, trial)
            finally:
                torch.save = original

    return FailingSave


def eval_loss_of_folder(folder, tokenizer) -> float:
    """The eval loss of a saved model folder, computed as the Trainer does: 4 batches of 8, averaged."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)
    examples = tiny_dataset(tokenizer).select(range(32))
    losses = []
    with torch.no_grad():
        for start in range(0, 32, 8):
            losses.append(model(**collator([examples[i] for i in range(start, start + 8)])).loss.item())
    return sum(losses) / len(losses)


def tiny_dataset(tokenizer) -> Dataset:
    """256 generated training records; the first 32 are also the eval set."""
    train_records, _ = generate_tasks()
    return tokenize_records(train_records[:256], tokenizer, ALPACA, max_length=128)[0]


def held_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights; under ZeRO-3 gathered from every rank's shard first (a collective: all ranks call)."""
    gather = contextlib.nullcontext()
    if is_deepspeed_zero3_enabled():
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gather:
        return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


if __name__ == "__main__":
    try:
        main()
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
