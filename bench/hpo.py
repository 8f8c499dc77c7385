"""hf_scale's hyperparameter search against the stock transformers Optuna backend, on the tiny task.

    python bench/hpo.py                      # single process and 2 processes, then the LoRA fast path
    python bench/hpo.py --trials 10 --steps 48 --only single --seeds 7
    python bench/hpo.py --only ddp --trials 30   # past TPE's 10 random trials
    python bench/hpo.py --only budget --budget 300 --budget_seeds 1,2,3,4,5   # quality per hour, 2 at once

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

The budget part (`--only budget`) asks what a user with a fixed wall-clock budget gets: for each seed, a search of up
to 2000 trials (more than any of them finishes) runs three ways on the same 2 cores, each stopped (killed, with its
processes) `--budget` seconds after its search is called: (a) the stock backend on 2 processes (DDP, so without
pruning; its own `timeout` would leave rank 1 waiting for trials rank 0 never starts), (b) hf_scale on 2 processes
(DDP, median pruning), (c) hf_scale with `parallel_trials=2` (two single-process trials at once, median pruning, one
journal study). Every evaluation and every trial's end is stamped with the wall clock, counted from the call (so (c)
pays for starting its workers).
Printed: the best eval loss each reached within the budget and within half of it, and trials finished per hour (over
the time the search ran, should it finish its trials first); the criteria: (c)'s best at half the budget against (a)'s
at the whole, and (c)'s trials per hour against (a)'s.
"""

from __future__ import annotations

import argparse
import contextlib
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


def run_one(
    backend: str,
    trials: int,
    steps: int,
    eval_steps: int,
    seed: int,
    out: Path,
    lora: str,
    parallel: int,
) -> None:
    import optuna
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from hf_scale.arguments import ScaleTrainingArguments
    from hf_scale.data.templates import ALPACA
    from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
    from hf_scale.hpo.parallel import worker_id
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

    stamps = out / f"stamps-{os.getpid()}.jsonl"  # wall-clock stamps of this process, for the budget part

    class Clock(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            events.append((time.perf_counter() - started[0], metrics["eval_loss"]))
            if state.is_world_process_zero:
                with stamps.open("a") as file:
                    file.write(json.dumps({"time": time.time(), "eval_loss": metrics["eval_loss"]}) + "\n")

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                with stamps.open("a") as file:
                    file.write(json.dumps({"time": time.time(), "trial_end": True}) + "\n")

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
        started[0], search_started = time.perf_counter(), time.time()
        (out / "started.json").write_text(json.dumps({"time": search_started}))
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

        started[0], search_started = time.perf_counter(), time.time()
        if worker_id() is None:  # not one of the workers of parallel_trials, which run this again
            (out / "started.json").write_text(json.dumps({"time": search_started}))
        trainer.hyperparameter_search(
            hp_space=space,
            n_trials=trials,
            # Parallel workers each seed their sampler apart (hf_scale does, from host and process).
            sampler=None if parallel > 1 else optuna.samplers.TPESampler(seed=seed),
            startup_trials=3,
            warmup_evaluations=1,
            report=False,
            lora_fast_path=lora == "fast",
            storage=f"{'journal:' + str(out / 'study.log') if parallel > 1 else 'sqlite:///' + str(out / 'study.db')}",
            parallel_trials=parallel,
        )
        outcomes = trainer.hp_search_outcomes
    total = time.perf_counter() - started[0]
    if not (dist.is_initialized() and dist.get_rank() != 0):
        result = {
            "events": events,
            "total": total,
            "outcomes": outcomes,
            "world_size": world_size,
            "search_started": search_started,
        }
        (out / "result.json").write_text(json.dumps(result, default=str))


# ---- the benchmark: each run in its own process ----


def launch(
    backend: str, processes: int, options: argparse.Namespace, lora: str = "none", budget: float = 0, parallel: int = 1
) -> dict:
    """One search in its own processes; with a budget, all of them are killed `budget` seconds after it started."""
    out = Path(tempfile.mkdtemp(prefix=f"hpo-bench-{backend}-{processes}-"))
    flags = ["--worker", backend, "--out", str(out), "--trials", str(options.trials), "--steps", str(options.steps)]
    flags += ["--eval_steps", str(options.eval_steps), "--seed", str(options.seed), "--lora", lora]
    flags += ["--parallel", str(parallel)]
    script = str(Path(__file__).resolve())
    if processes == 1:
        command = [sys.executable, script, *flags]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, "--nproc_per_node", str(processes), "--master_port", str(29500 + os.getpid() % 1000)]
        command += [script, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    env.setdefault("DS_ACCELERATOR", "cpu")
    if budget:
        return run_for(command, env, out, budget, options.run_timeout)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=options.run_timeout)
    if result.returncode != 0:
        raise SystemExit(f"{backend} x{processes} failed:\n{result.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    result["stamps"] = [
        json.loads(line) for path in out.glob("stamps-*.jsonl") for line in path.read_text().splitlines()
    ]
    return result


def read_stamps(out: Path) -> list[dict]:
    return [json.loads(line) for path in out.glob("stamps-*.jsonl") for line in path.read_text().splitlines()]


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL `process` and every process under it: torchrun starts its ranks in sessions of their own, so killing
    the process group would leave them training on the cores the next run is timed on."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    process.kill()
    process.wait()


def run_for(command: list[str], env: dict, out: Path, budget: float, startup_timeout: float) -> dict:
    """Run `command` until `budget` seconds after its search started (run_one writes started.json), then kill it
    with every process it started; what it stamped until then."""
    log = out / "output.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + startup_timeout
        while not (out / "started.json").exists():
            if process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{command} never started its search:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        started = json.loads((out / "started.json").read_text())["time"]
        while time.time() < started + budget and process.poll() is None:
            time.sleep(0.2)
        if process.poll() not in (None, 0):
            raise SystemExit(f"{command} failed:\n{log.read_text()[-3000:]}")
        seconds = min(budget, time.time() - started)  # less when the search finished its trials first
    finally:
        kill_tree(process)
    return {"search_started": started, "stamps": read_stamps(out), "seconds": seconds}


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


BUDGET_MODES = {"a": ("stock", 2, 1), "b": ("hf_scale", 2, 1), "c": ("hf_scale", 1, 2)}  # backend, processes, trials


def within(run: dict, seconds: float) -> tuple[float | None, int]:
    """(best eval loss, trials finished) in the first `seconds` of the search."""
    start = run["search_started"]
    stamps = [stamp for stamp in run["stamps"] if stamp["time"] - start <= seconds]
    losses = [stamp["eval_loss"] for stamp in stamps if "eval_loss" in stamp]
    return (min(losses) if losses else None), sum("trial_end" in stamp for stamp in stamps)


def budget_part(options: argparse.Namespace) -> dict:
    """(a), (b) and (c) under one wall-clock budget for each seed; prints the table and returns it."""
    seeds = [int(seed) for seed in options.budget_seeds.split(",")]
    budget = options.budget
    rows = {}
    for seed in seeds:
        # More trials than any mode finishes in the budget: the budget ends every search.
        seeded = argparse.Namespace(**{**vars(options), "seed": seed, "trials": 2000, "run_timeout": 300})
        for mode, (backend, processes, parallel) in BUDGET_MODES.items():
            run = launch(backend, processes, seeded, budget=budget, parallel=parallel)
            best, finished = within(run, budget)
            half_best, _ = within(run, budget / 2)
            rows[seed, mode] = {"best": best, "half_best": half_best, "per_hour": finished * 3600 / run["seconds"]}
            print(f"budget {budget:.0f} s, seed {seed}, ({mode}) {backend} x{processes} trials x{parallel}: "
                  f"best {best}, at half {half_best}, {finished} trials", flush=True)  # fmt: skip
    print(f"\nbest eval loss within {budget:.0f} s (and within {budget / 2:.0f} s), trials finished per hour, 2 cores")
    print(f"{'seed':>5} {'(a) stock DDP':>22} {'(b) hf_scale DDP':>22} {'(c) 2 at once':>22}   (c) at half <= (a)")
    wins = 0
    for seed in seeds:
        cells = []
        for mode in BUDGET_MODES:
            row = rows[seed, mode]
            cells.append(
                f"{row['best'] or float('nan'):.4f} ({row['half_best'] or float('nan'):.4f}) {row['per_hour']:>5.0f}"
            )
        a_best, c_half = rows[seed, "a"]["best"], rows[seed, "c"]["half_best"]
        won = a_best is not None and c_half is not None and c_half <= a_best
        wins += won
        print(f"{seed:>5} " + " ".join(f"{cell:>22}" for cell in cells) + f"   {'yes' if won else 'no'}")
    per_hour = {mode: statistics.fmean(rows[seed, mode]["per_hour"] for seed in seeds) for mode in BUDGET_MODES}
    ratio = per_hour["c"] / per_hour["a"] if per_hour["a"] else float("inf")
    print(f"(c) at half the budget at least as good as (a) at all of it: {wins} of {len(seeds)} seeds")
    hourly = ", ".join(f"({mode}) {per_hour[mode]:.0f}" for mode in BUDGET_MODES)
    print(f"trials per hour: {hourly}; (c)/(a) {ratio:.2f}x")
    return {"rows": rows, "wins": wins, "per_hour": per_hour}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--eval_steps", type=int, default=8)
    parser.add_argument("--seeds", default="7,8,9", help="comma-separated sampler and training seeds")
    parser.add_argument("--seed", type=int, default=7, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["single", "ddp", "lora", "budget"], default=None)
    parser.add_argument("--budget", type=float, default=90, help="budget part: seconds of each search")
    parser.add_argument("--budget_seeds", default="1,2,3,4,5", help="budget part: its seeds")
    parser.add_argument("--parallel", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--run_timeout", type=float, default=1200)
    parser.add_argument("--worker", choices=["stock", "hf_scale"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--lora", default="none", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        run_one(
            options.worker, options.trials, options.steps, options.eval_steps, options.seed, Path(options.out),
            options.lora, options.parallel,
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

    if options.only in (None, "budget"):
        budget_part(options)

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
