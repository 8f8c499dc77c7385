"""hf_scale's hyperparameter search against the stock transformers Optuna backend, on the tiny task.

    python bench/hpo.py                      # single process and 2 processes, then the LoRA fast path
    python bench/hpo.py --trials 10 --steps 48 --only single --seeds 7
    python bench/hpo.py --only ddp --trials 30   # past TPE's 10 random trials

Both backends get the same search space (learning rate 1e-5 to 1e-1, log), the same sampler (Optuna's TPE, seeded;
its first 10 trials are random, so both run the same values), the same pruner (median, 3 startup trials, 1 warm-up
evaluation), the same trial budget and the same training arguments: the difference is the backend's. Every evaluation
of every trial is timed. The figure of merit is the time from the start of the search until some evaluation comes
within 2 % of the best eval loss either backend found with that seed; the speed-up is the median over the seeds.
Also printed: the time each backend took for the whole trial budget (pruning shows there more than in the first trials,
where the target usually falls with 10 trials: TPE's first 10 are random, and no trial is pruned before one completes).
The stock backend prunes only on rank 0, so with 2 processes a pruned trial leaves rank 1 training alone (a hang): it
runs there without a pruner, as it must. The LoRA part times building each trial's model with and without the fast path,
on a larger base (about 30M parameters) so that loading it costs something. Timings on these shared machines are
noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LR_RANGE = (1e-5, 1e-1)
TARGET = 1.02  # within 2 % of the best eval loss found


# ---- one search, in this process (launched by main, under torchrun for 2 processes) ----


def run_one(backend: str, trials: int, steps: int, eval_steps: int, seed: int, out: Path, lora: str) -> None:
    import optuna
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from hf_scale.arguments import ScaleTrainingArguments
    from hf_scale.data.templates import ALPACA
    from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
    from hf_scale.modeling import load_tokenizer
    from hf_scale.tiny import ensure_tiny_model, generate_tasks
    from hf_scale.trainer import ScaleTrainer

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    path = Path(os.environ["BENCH_MODEL"]) if lora != "none" else ensure_tiny_model()
    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    train_records, eval_records = generate_tasks()
    train, _ = tokenize_records(train_records[:2048], tokenizer, ALPACA, max_length=64)
    evaluation, _ = tokenize_records(eval_records[:128], tokenizer, ALPACA, max_length=64)
    events: list[tuple[float, float]] = []
    started = [0.0]

    class Clock(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            events.append((time.perf_counter() - started[0], metrics["eval_loss"]))

    def model_init(trial=None):
        model = AutoModelForCausalLM.from_pretrained(path)
        if lora != "none":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        return model

    def hp_space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", *LR_RANGE, log=True)}

    common = dict(
        output_dir=str(out / "run"),
        max_steps=steps,
        per_device_train_batch_size=16 // world_size,
        per_device_eval_batch_size=64,
        lr_scheduler_type="cosine",
        warmup_steps=0,  # ScaleTrainingArguments' default is 3 %; TrainingArguments' 0
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="no",
        logging_steps=eval_steps,
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        ddp_find_unused_parameters=False,
    )
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)
    if backend == "stock":
        args = TrainingArguments(**common, use_cpu=world_size > 1)  # without use_cpu, 2 CPU processes never sync
        trainer = Trainer(
            model_init=model_init,
            args=args,
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=collator,
            callbacks=[Clock()],
        )
        # The stock backend reports at the global step: warm-up of one evaluation is eval_steps + 1 steps.
        pruner = (
            optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=eval_steps + 1)
            if world_size == 1
            else optuna.pruners.NopPruner()  # with 2 processes its pruning leaves rank 1 training alone: a hang
        )
        started[0] = time.perf_counter()
        trainer.hyperparameter_search(
            hp_space=hp_space,
            n_trials=trials,
            direction="minimize",
            backend="optuna",
            sampler=optuna.samplers.TPESampler(seed=seed),
            pruner=pruner,
        )
        outcomes = []
    else:
        args = ScaleTrainingArguments(**common)
        trainer = ScaleTrainer(
            model_init=model_init,
            args=args,
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=collator,
            callbacks=[Clock()],
        )
        space = None if lora != "none" else hp_space  # LoRA runs: the default LoRA values on top of a fixed lr
        if lora != "none":

            def space(trial):
                return {
                    "learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True),
                    "lora_r": trial.suggest_categorical("lora_r", [4, 8, 16]),
                }

        started[0] = time.perf_counter()
        trainer.hyperparameter_search(
            hp_space=space,
            n_trials=trials,
            sampler=optuna.samplers.TPESampler(seed=seed),
            startup_trials=3,
            warmup_evaluations=1,
            report=False,
            lora_fast_path=lora == "fast",
            storage=f"sqlite:///{out / 'study.db'}",
        )
        outcomes = trainer.hp_search_outcomes
    total = time.perf_counter() - started[0]
    if not (dist.is_initialized() and dist.get_rank() != 0):
        result = {"events": events, "total": total, "outcomes": outcomes, "world_size": world_size}
        (out / "result.json").write_text(json.dumps(result, default=str))


# ---- the benchmark: each run in its own process ----


def launch(backend: str, processes: int, options: argparse.Namespace, lora: str = "none") -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"hpo-bench-{backend}-{processes}-"))
    flags = ["--worker", backend, "--out", str(out), "--trials", str(options.trials), "--steps", str(options.steps)]
    flags += ["--eval_steps", str(options.eval_steps), "--seed", str(options.seed), "--lora", lora]
    script = str(Path(__file__).resolve())
    if processes == 1:
        command = [sys.executable, script, *flags]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, "--nproc_per_node", str(processes), "--master_port", str(29500 + os.getpid() % 1000)]
        command += [script, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    env.setdefault("DS_ACCELERATOR", "cpu")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=options.run_timeout)
    if result.returncode != 0:
        raise SystemExit(f"{backend} x{processes} failed:\n{result.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def time_to_target(events: list, target: float) -> float | None:
    return next((seconds for seconds, loss in events if loss <= target), None)


def big_base_model() -> Path:
    """A ~30M-parameter LLaMA on disk, with the tiny tokenizer: loading it per trial costs something."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_scale.modeling import load_tokenizer
    from hf_scale.paths import cache_dir
    from hf_scale.tiny import ensure_tiny_model

    folder = cache_dir() / "bench-llama-30m"
    if not (folder / "model.safetensors").exists():
        tokenizer = load_tokenizer(str(ensure_tiny_model()))
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            max_position_embeddings=256,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--eval_steps", type=int, default=8)
    parser.add_argument("--seeds", default="7,8,9", help="comma-separated sampler and training seeds")
    parser.add_argument("--seed", type=int, default=7, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["single", "ddp", "lora"], default=None)
    parser.add_argument("--run_timeout", type=float, default=1200)
    parser.add_argument("--worker", choices=["stock", "hf_scale"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--lora", default="none", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        run_one(
            options.worker, options.trials, options.steps, options.eval_steps, options.seed, Path(options.out),
            options.lora,
        )  # fmt: skip
        return

    rows = []
    seeds = [int(seed) for seed in options.seeds.split(",")]
    for processes, name in ((1, "single"), (2, "ddp")):
        if options.only not in (None, name):
            continue
        for seed in seeds:
            seeded = argparse.Namespace(**{**vars(options), "seed": seed})
            runs = {backend: launch(backend, processes, seeded) for backend in ("stock", "hf_scale")}
            best = min(loss for run in runs.values() for _, loss in run["events"])
            reached = {backend: time_to_target(run["events"], best * TARGET) for backend, run in runs.items()}
            for backend, run in runs.items():
                best_loss = min(loss for _, loss in run["events"])
                rows.append((processes, seed, backend, reached[backend], run["total"], best_loss))
            print(f"{processes} process(es), seed {seed}: target eval loss {best * TARGET:.4f}", flush=True)
    if rows:
        print(
            f"\n{'procs':>5} {'seed':>5} {'backend':>9} {'to target s':>12} {'budget s':>9} {'best loss':>10} "
            f"{'speed-up':>9}"
        )
        speedups: dict[int, list[float]] = {}
        budget_speedups: dict[int, list[float]] = {}
        for processes, seed, backend, reached, total, best_loss in rows:
            speedup = "-"
            _, _, _, stock_reached, stock_budget, _ = next(r for r in rows if r[:3] == (processes, seed, "stock"))
            if backend == "hf_scale":
                budget_speedups.setdefault(processes, []).append(stock_budget / total)
            if backend == "hf_scale" and reached is not None:
                # The stock backend never reaching the target: its whole budget is a lower bound.
                ratio = (stock_reached if stock_reached is not None else stock_budget) / reached
                speedups.setdefault(processes, []).append(ratio)
                speedup = f"{'>=' if stock_reached is None else ''}{ratio:.2f}x"
            shown = f"{reached:.1f}" if reached is not None else "never"
            print(f"{processes:>5} {seed:>5} {backend:>9} {shown:>12} {total:>9.1f} {best_loss:>10.4f} {speedup:>9}")
        for processes, ratios in budget_speedups.items():
            to_target = f"{statistics.median(speedups[processes]):.2f}x" if processes in speedups else "never"
            print(
                f"{processes} process(es), seeds {seeds}: median speed-up to the target {to_target}, "
                f"over the whole trial budget {statistics.median(ratios):.2f}x"
            )

    if options.only in (None, "lora"):
        os.environ["BENCH_MODEL"] = str(big_base_model())
        lora_options = argparse.Namespace(**{**vars(options), "trials": 4, "steps": 8, "eval_steps": 8})
        print(f"\nLoRA, {lora_options.trials} trials of {lora_options.steps} steps on a 30M-parameter base:")
        print(f"{'path':>10} {'model build s/trial':>20} {'trial s':>9}")
        for mode in ("slow", "fast"):
            run = launch("hf_scale", 1, lora_options, lora=mode)
            later = run["outcomes"][1:]  # the first trial loads the base in both modes
            build = sum(o["model_seconds"] for o in later) / len(later)
            trial = sum(o["seconds"] for o in later) / len(later)
            print(f"{mode:>10} {build:>20.3f} {trial:>9.2f}")


if __name__ == "__main__":
    main()
