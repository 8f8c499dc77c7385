"""QLoRA against LoRA on the same budget, over several seeds: does a 4-bit base learn as well as the base as saved?

    python bench/qlora_learning.py                         # 5 seeds, 2 processes per run (about 45 minutes)
    python bench/qlora_learning.py --seeds 1,2 --base outputs/tiny-chat-cpu

The base is the tiny model trained on the two-turn conversations (the shipped `tiny_chat_cpu` config, trained here
first unless --base names a run folder): it answers in the LLaMA-2 chat format and has never seen the Alpaca one.
Each seed fine-tunes it on the embedded single-turn task in the Alpaca template (the shipped `tiny_cpu` config) with
LoRA r=16 on 2 processes (torchrun), once on the base as saved and once on its NF4 copy (`quantization: nf4`, double
quantization), both in bf16 mixed precision (`--bf16 true`, as the shipped QLoRA configs run; the 4-bit layers compute
in bf16 whatever the flag), every other flag the same. The figure is held-out exact match after training, on 400
records whose numbers no training record mentions; before training it is 0 for both.

`--methods lora_fp32,lora,qlora` adds LoRA in fp32 (the precision `tiny_cpu` ships with), to show what the precision
alone does: over 5 seeds at 400 steps, LoRA fp32 0.807, LoRA bf16 0.702, QLoRA 0.889 (means); bf16 did not explain
QLoRA's lead there.

Why several seeds, and why 800 steps: on this 3-layer, 64-wide model a LoRA run sits on a loss plateau for a time that
varies from seed to seed (and runs on 2 processes are not bit-reproducible). After 400 steps LoRA ended anywhere from
0.53 to 0.98 and QLoRA led by 0.14 and 0.19 in two runs of 5 seeds; after 800 steps 9 of the 10 runs end at 0.978 or
more, all but LoRA's seed 4 (0.880): LoRA 0.971, QLoRA 0.988 (means over 5 seeds). At 800 steps the comparison is
mostly about the bases, less about when a plateau ends; `--steps 400` repeats the earlier runs. The criterion is on
the means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_scale.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "finetune_llama2.py"
TOLERANCE = 0.1  # issue 20: QLoRA's held-out exact match within 0.1 of LoRA's on the same budget
METHODS = {
    "lora_fp32": ["--bf16", "false"],
    "lora": ["--bf16", "true"],
    "qlora": ["--bf16", "true", "--quantization", "nf4"],
}
COLUMNS = {"lora_fp32": "LoRA fp32", "lora": "LoRA", "qlora": "QLoRA"}


def train_base(output_dir: Path, timeout: float) -> Path:
    """The shipped multi-turn default, trained as `hf-scale train --config tiny_chat_cpu` trains it."""
    command = [sys.executable, str(RECIPE), "--config", "tiny_chat_cpu", "--output_dir", str(output_dir)]
    subprocess.run(command, cwd=REPO, check=True, timeout=timeout, capture_output=True)
    return output_dir


def fine_tune(base: Path, method: str, seed: int, options: argparse.Namespace, output_dir: Path) -> dict:
    """One 2-process run; returns its exact match before and after and its wall time."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(options.processes)]
    command += ["--master_port", str(free_port()), str(RECIPE), "--config", "tiny_cpu"]
    command += ["--model_name_or_path", str(base), "--lora_r", "16", "--lora_alpha", "32"]
    command += ["--learning_rate", str(options.learning_rate), "--max_steps", str(options.steps)]
    command += ["--per_device_train_batch_size", str(32 // options.processes), "--seed", str(seed)]
    command += ["--exact_match_samples", str(options.samples), "--eval_strategy", "no", "--save_strategy", "no"]
    command += ["--output_dir", str(output_dir), *METHODS[method]]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, timeout=options.run_timeout, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{method} seed {seed} failed:\n{result.stderr[-3000:]}")
    metrics = json.loads((output_dir / "metrics.json").read_text())
    return {
        "before": metrics["eval_before_exact_match"],
        "after": metrics["eval_after_exact_match"],
        "seconds": seconds,
        "adapter_only": (output_dir / "adapter_model.safetensors").is_file()
        and not (output_dir / "model.safetensors").exists(),
    }


def summarize(runs: dict[str, list[dict]]) -> dict:
    means = {method: statistics.fmean(run["after"] for run in method_runs) for method, method_runs in runs.items()}
    spreads = {
        method: statistics.stdev(run["after"] for run in method_runs) if len(method_runs) > 1 else 0.0
        for method, method_runs in runs.items()
    }
    difference = means["qlora"] - means["lora"]
    time_ratio = statistics.fmean(r["seconds"] for r in runs["qlora"]) / statistics.fmean(
        r["seconds"] for r in runs["lora"]
    )
    return {
        "mean": means,
        "stdev": spreads,
        "qlora_minus_lora": difference,
        "within_tolerance": abs(difference) <= TOLERANCE,
        "not_worse": difference >= -TOLERANCE,
        "qlora_over_lora_time": time_ratio,
    }


def print_table(seeds: list[int], runs: dict[str, list[dict]], summary: dict) -> None:
    methods = list(runs)
    before = ", ".join(f"{COLUMNS[m]} {statistics.fmean(run['before'] for run in runs[m]):.3f}" for m in methods)
    header = "".join(f"{COLUMNS[m]:>11}" for m in methods)
    print(f"{'seed':>6}{header}   held-out exact match after training (before, mean over seeds: {before})")
    for index, seed in enumerate(seeds):
        print(f"{seed:>6}" + "".join(f"{runs[m][index]['after']:>11.3f}" for m in methods))
    for row in ("mean", "stdev"):
        print(f"{row:>6}" + "".join(f"{summary[row][m]:>11.3f}" for m in methods))
    within, not_worse = ("yes" if summary[key] else "no" for key in ("within_tolerance", "not_worse"))
    print(
        f"QLoRA - LoRA (means): {summary['qlora_minus_lora']:+.3f}; within {TOLERANCE} either way: {within}; "
        f"QLoRA not more than {TOLERANCE} below LoRA: {not_worse}"
    )
    print(f"QLoRA / LoRA wall time per run: {summary['qlora_over_lora_time']:.2f}x (bitsandbytes' CPU path)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated training seeds")
    parser.add_argument("--methods", default="lora,qlora", help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps of every run")
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--samples", type=int, default=400, help="held-out records scored")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--base", type=Path, help="a trained tiny_chat_cpu run folder (default: train one)")
    parser.add_argument("--run_timeout", type=float, default=1200)
    parser.add_argument("--output", type=Path, help="also write the runs and the summary as JSON here")
    options = parser.parse_args()
    seeds = [int(seed) for seed in options.seeds.split(",")]
    methods = options.methods.split(",")
    if not {"lora", "qlora"} <= set(methods) <= set(METHODS):
        parser.error(f"--methods must name lora and qlora, and only {', '.join(METHODS)}: got {options.methods!r}")

    with tempfile.TemporaryDirectory(prefix="qlora-bench-") as scratch:
        base = options.base or train_base(Path(scratch) / "base", options.run_timeout)
        runs: dict[str, list[dict]] = {method: [] for method in methods}
        for seed in seeds:
            for method in methods:
                run = fine_tune(base, method, seed, options, Path(scratch) / f"{method}-{seed}")
                runs[method].append(run)
                print(f"seed {seed} {method}: {run['before']:.3f} -> {run['after']:.3f} ({run['seconds']:.0f} s)")
    summary = summarize(runs)
    if options.output:
        options.output.write_text(json.dumps({"seeds": seeds, "runs": runs, "summary": summary}, indent=2) + "\n")
    print_table(seeds, runs, summary)


if __name__ == "__main__":
    main()
