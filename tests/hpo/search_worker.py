"""Runs a hyperparameter search on the tiny task and writes what each rank saw to rank<N>.json.

Launched by the hpo tests (python, or torchrun for 2 processes); not a test itself. The learning rate range is wide
(1e-5 to 1e-1, log) so that bad rates are clearly bad on the tiny task, which learns best near 5e-3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.data.batching import make_collator
from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import ensure_tiny_model, generate_tasks
from hf_scale.trainer import ScaleTrainer


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--n_trials", type=int, default=6)
    parser.add_argument("--max_steps", type=int, default=24)
    parser.add_argument("--eval_steps", type=int, default=6)
    parser.add_argument("--train_records", type=int, default=1024)
    parser.add_argument("--eval_records", type=int, default=64)
    parser.add_argument("--fail_trial", type=int, default=-1, help="this trial raises at its 3rd step ...")
    parser.add_argument("--fail_rank", type=int, default=-1, help="... on this rank only (default: every rank)")
    parser.add_argument("--trial_end_timeout", type=float, default=300)
    parser.add_argument("--fail_init_trial", type=int, default=-1, help="model_init raises for this trial ...")
    parser.add_argument("--fail_init_rank", type=int, default=-1, help="... on this rank only (default: every rank)")
    parser.add_argument("--slow_init_rank", type=int, default=-1, help="model_init sleeps on this rank ...")
    parser.add_argument("--slow_init_seconds", type=float, default=0, help="... this long, in trial 0")
    parser.add_argument("--sleep_trial", type=int, default=-1, help="this trial sleeps 600 s at its 2nd step")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--zero_preset", default=None)
    parser.add_argument("--storage", default=None)
    parser.add_argument("--study_name", default="hf_scale")
    parser.add_argument("--pruner", default="median")
    parser.add_argument("--parallel_trials", type=int, default=1)
    parser.add_argument("--startup_trials", type=int, default=3)
    parser.add_argument("--heartbeat_interval", type=int, default=60)
    parser.add_argument("--grace_period", type=int, default=None)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--lora_fast_path", default="true")
    parser.add_argument("--quantization", default=None, help="with --lora: the base quantized (QLoRA), e.g. nf4")
    parser.add_argument(
        "--space", default="lr", help="lr: learning rate only; lr_batch: and the batch size; default: hf_scale's own"
    )
    parser.add_argument("--min_learning_rate", type=float, default=None)
    parser.add_argument("--early_stopping_patience", type=int, default=None)
    parser.add_argument("--divergence_action", default="stop")
    parser.add_argument("--divergence_spike_factor", type=float, default=None)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--lrs", default=None, help="comma-separated learning rates, one per trial in turn")
    parser.add_argument("--warmup_evaluations", type=int, default=1)
    parser.add_argument("--retrain_best", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--direction", default=None)
    parser.add_argument("--objective", default=None, help="an eval metric for compute_objective to return")
    return parser.parse_args()


def digest(model: torch.nn.Module, prefix: str = "") -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name.startswith(prefix) and "lora_" not in name:
            sha.update(name.encode())
            sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


class Misbehave(TrainerCallback):
    """Makes one trial raise or hang, identified by its output folder (trial-NNNN)."""

    def __init__(self, fail_trial: int, fail_rank: int, sleep_trial: int) -> None:
        self.fail_trial, self.fail_rank, self.sleep_trial = fail_trial, fail_rank, sleep_trial

    def on_step_end(self, args, state, control, **kwargs):
        folder = Path(args.output_dir).name
        this_rank = self.fail_rank in (-1, args.process_index)
        if folder == f"trial-{self.fail_trial:04d}" and state.global_step == 3 and this_rank:
            raise RuntimeError(f"trial {self.fail_trial} breaks on purpose")
        if folder == f"trial-{self.sleep_trial:04d}" and state.global_step == 2:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            Path(args.output_dir, "sleeping").write_text(str(os.getpid()))
            time.sleep(600)
        return control


def main() -> None:
    opts = options()
    args = ScaleTrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        learning_rate=5e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        eval_strategy="steps",
        eval_steps=opts.eval_steps,
        save_strategy="steps",
        save_steps=opts.eval_steps,
        logging_steps=opts.eval_steps,
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        seed=opts.seed,
        data_seed=opts.seed,
        zero_preset=opts.zero_preset,
        min_learning_rate=opts.min_learning_rate,
        early_stopping_patience=opts.early_stopping_patience,
        divergence_action=opts.divergence_action,
        divergence_spike_factor=opts.divergence_spike_factor,
    )
    with args.main_process_first():
        path = ensure_tiny_model()
    tokenizer = load_tokenizer(str(path))
    train_records, eval_records = generate_tasks()
    train, _ = tokenize_records(train_records[: opts.train_records], tokenizer, ALPACA, max_length=64)
    evaluation, _ = tokenize_records(eval_records[: opts.eval_records], tokenizer, ALPACA, max_length=64)
    base_digests, lora_ranks, model_inits, model_init_seconds, quantized_bases = [], [], [], [], []

    def model_init(trial=None):
        model_inits.append(time.time())
        if opts.quantization:  # QLoRA: hf_scale's own loading, which quantizes the base as it loads
            from hf_scale.modeling import ModelArguments, load_model

            model_args = ModelArguments(
                lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], quantization=opts.quantization
            )
            model = load_model(model_args, str(path), tokenizer)
            model_init_seconds.append(time.time() - model_inits[-1])
            return model
        breaks_here = opts.fail_init_rank in (-1, args.process_index)
        if trial is not None and trial.number == opts.fail_init_trial and breaks_here:
            raise RuntimeError(f"model_init breaks on rank {args.process_index}{' only' * (opts.fail_init_rank >= 0)}")
        if trial is not None and trial.number == 0 and opts.slow_init_rank == args.process_index:
            time.sleep(opts.slow_init_seconds)  # a slow disk on one node
        model = AutoModelForCausalLM.from_pretrained(path)
        if opts.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        return model

    def hp_space(trial):
        if opts.lrs:  # a fixed sequence: what each trial does no longer depends on the sampler
            rates = [float(rate) for rate in opts.lrs.split(",")]
            return {"learning_rate": rates[trial.number % len(rates)]}
        params = {"learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True)}
        if opts.space == "lr_batch":
            params["per_device_train_batch_size"] = trial.suggest_categorical("per_device_train_batch_size", [8, 16])
        if opts.lora:
            params["lora_r"] = trial.suggest_categorical("lora_r", [2, 4, 8])
        return params

    class BaseDigest(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if opts.lora:
                base_digests.append(digest(model))
                lora_ranks.append(model.peft_config["default"].r)
                # A 4-bit base is followed by identity, not bytes: bitsandbytes on CPU re-packs its weights for its
                # kernels at the first forward (the same weights, other bytes).
                import bitsandbytes as bnb

                quantized = [m.weight for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
                frozen = all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
                quantized_bases.append({"layers": len(quantized), "ids": [id(w) for w in quantized], "frozen": frozen})
            return control

    trainer = ScaleTrainer(
        model=None,
        model_init=model_init,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=make_collator(tokenizer, packing=opts.packing),
        processing_class=tokenizer,
        callbacks=[Misbehave(opts.fail_trial, opts.fail_rank, opts.sleep_trial), BaseDigest()],
    )
    extra = {}
    if opts.timeout:
        extra["timeout"] = opts.timeout
    if opts.storage:
        extra["storage"] = opts.storage
    started = time.time()
    if opts.objective:
        extra["compute_objective"] = lambda metrics: metrics[opts.objective]
    best = trainer.hyperparameter_search(
        hp_space=None if opts.space == "default" else hp_space,
        direction=opts.direction,
        n_trials=opts.n_trials,
        study_name=opts.study_name,
        pruner=opts.pruner,
        startup_trials=opts.startup_trials,
        warmup_evaluations=opts.warmup_evaluations,
        heartbeat_interval=opts.heartbeat_interval,
        grace_period=opts.grace_period,
        lora_fast_path=opts.lora_fast_path == "true",
        retrain_best=opts.retrain_best,
        trial_end_timeout=opts.trial_end_timeout,
        parallel_trials=opts.parallel_trials,
        **extra,
    )
    seconds = time.time() - started
    metrics = trainer.evaluate()
    report = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "best": {"run_id": best.run_id, "objective": best.objective, "hyperparameters": best.hyperparameters},
        "eval_after_search": metrics,
        "outcomes": trainer.hp_search_outcomes,
        "seconds": seconds,
        "base_digests": base_digests,
        "lora_ranks": lora_ranks,
        "model_init_calls": len(model_inits),
        "model_init_seconds": model_init_seconds,
        "quantized_layers": quantized_bases,
        "trainer_lr": trainer.args.learning_rate,
    }
    study = trainer.hp_search_study
    if study is not None:
        report["study"] = [
            {
                "number": t.number,
                "state": t.state.name,
                "params": t.params,
                "value": t.value,
                "error": t.user_attrs.get("error"),
            }
            for t in study.trials
        ]
    Path(opts.output_dir, f"rank{args.process_index}.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    try:
        main()
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
