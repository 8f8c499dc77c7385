"""The benchmarks the README quotes run, in a quick setting, and print their tables (the figures are theirs)."""

import json
import re
import sys

import pytest

from tests.helpers import SHARED_DATA, assert_succeeded, run_command

pytestmark = pytest.mark.slow


def test_trainer_overhead_prints_the_ratio(tiny_model_dir):
    result = run_command([sys.executable, "bench/trainer_overhead.py", "--steps", "5", "--rounds", "1"], timeout=300)
    assert_succeeded(result, result.stderr[-3000:])
    ratio = re.search(r"ScaleTrainer / Trainer throughput ratio .*: ([0-9.]+)", result.stdout)
    assert ratio and float(ratio.group(1)) > 0


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_data_pipeline_prints_both_sets():
    quick = ["--vocab-size", "2000", "--repeats", "1", "--steps", "3", "--rounds", "1"]
    result = run_command([sys.executable, "bench/data_pipeline.py", *quick], timeout=300)
    assert_succeeded(result, result.stderr[-3000:])
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith(("| en |", "| zh |"))]
    assert [row[1] for row in rows] == ["999", "1000"]  # records of each set
    assert [row[9] for row in rows] == ["0.0%", "0.0%"]  # packing leaves no padding


def test_hpo_prints_both_backends_and_the_speed_ups(tiny_model_dir):
    quick = ["--only", "single", "--seeds", "7", "--trials", "2", "--steps", "8", "--eval_steps", "4"]
    result = run_command([sys.executable, "bench/hpo.py", *quick], timeout=300)
    assert_succeeded(result, result.stderr[-3000:])
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("1     7")]
    assert [row[2] for row in rows] == ["stock", "hf_scale"]
    assert rows[0][5] == rows[1][5]  # the same training and trials on both sides: the same best eval loss
    assert re.search(r"median speed-up to the target [0-9.]+x, over the whole trial budget [0-9.]+x", result.stdout)


def test_hpo_budget_part_prints_the_three_ways_and_the_ratio(tiny_model_dir):
    """One seed under a short budget, short trials: every way is started, killed at the budget, and has its row."""
    quick = ["--only", "budget", "--budget", "20", "--budget_seeds", "1", "--steps", "8", "--eval_steps", "4"]
    result = run_command([sys.executable, "bench/hpo.py", *quick], timeout=600)
    assert_succeeded(result, result.stdout[-3000:] + result.stderr[-3000:])
    finished = re.findall(
        r"budget 20 s, seed 1, \((\w)\) (\w+) x(\d) trials x(\d): best .*, (\d+) trials", result.stdout
    )
    ways = [("a", "stock", "2", "1"), ("b", "hf_scale", "2", "1"), ("c", "hf_scale", "1", "2")]
    assert [row[:4] for row in finished] == ways, result.stdout[-3000:]
    assert all(int(row[4]) >= 1 for row in finished[:2]), finished  # 20 s hold several trials of 8 steps
    table_rows = re.findall(r"^ +1 .* (yes|no)$", result.stdout, re.MULTILINE)  # the table's one seed
    assert len(table_rows) == 1, result.stdout[-3000:]
    rates = re.search(r"trials per hour: \(a\) (\d+), \(b\) (\d+), \(c\) (\d+); \(c\)/\(a\) ([0-9.]+)x", result.stdout)
    assert rates, result.stdout[-3000:]
    assert float(rates.group(4)) == pytest.approx(int(rates.group(3)) / int(rates.group(1)), rel=0.01)


def test_qlora_learning_prints_both_means(trained_tiny_run, tmp_path):
    """A quick setting on the session's trained tiny run: one seed, a few steps; the figures are the bench's."""
    quick = ["--seeds", "3", "--steps", "2", "--samples", "4", "--base", str(trained_tiny_run)]
    output = tmp_path / "qlora.json"
    result = run_command([sys.executable, "bench/qlora_learning.py", *quick, "--output", str(output)], timeout=600)
    assert_succeeded(result, result.stderr[-3000:])
    report = json.loads(output.read_text())
    runs, summary = report["runs"], report["summary"]
    assert all(run["adapter_only"] for method in ("lora", "qlora") for run in runs[method])
    assert summary["qlora_minus_lora"] == pytest.approx(runs["qlora"][0]["after"] - runs["lora"][0]["after"])
    line = f"{3:>6}{runs['lora'][0]['after']:>11.3f}{runs['qlora'][0]['after']:>11.3f}"
    assert line in result.stdout.splitlines()
    before = f"before, mean over seeds: LoRA {runs['lora'][0]['before']:.3f}, QLoRA {runs['qlora'][0]['before']:.3f}"
    assert before in result.stdout  # the base's own score (the quick setting's base already knows the task)
    assert re.search(r"QLoRA - LoRA \(means\): [+-][0-9.]+; within 0.1 either way: (yes|no); QLoRA not", result.stdout)


def test_real_model_prints_both_ratios_and_records_every_step(smollm2, tmp_path):
    """SmolLM2 in the quickest setting: one round of 2 steps per trainer, 2 records answered both ways."""
    quick = ["--methods", "LoRA", "--steps", "2", "--rounds", "1", "--records", "8", "--generate", "2"]
    quick += ["--generation_batch", "2", "--max_new_tokens", "2", "--output", str(tmp_path / "real.json")]
    result = run_command([sys.executable, "bench/real_model.py", *quick], timeout=600)
    assert_succeeded(result, result.stderr[-3000:])
    report = json.loads((tmp_path / "real.json").read_text())
    runs = report["LoRA"]
    for side in ("Trainer", "ScaleTrainer"):
        (run,) = runs[side]
        assert len(run["steps"]) == 2 and all(s["tokens"] > 0 and s["memory_bytes"] > 2**28 for s in run["steps"])
    ratio = runs["ScaleTrainer"][0]["tokens_per_second"] / runs["Trainer"][0]["tokens_per_second"]
    assert re.search(rf"^LoRA +[0-9.]+ +[0-9.]+ +{ratio:.3f} +[0-9.]+$", result.stdout, re.MULTILINE), result.stdout
    generation = report["generation"]
    assert f"batched / one at a time: {generation['ratio']:.2f}x" in result.stdout
    assert 0 <= generation["same"] <= 2


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_data_at_scale_prints_every_size_and_the_relaunch(tiny_model_dir):
    result = run_command([sys.executable, "bench/data_at_scale.py", "--quick"], timeout=300)
    assert_succeeded(result, result.stderr[-3000:])
    rows = re.findall(r"^\| (records|conversations) of (\d+) records \| (\d+) \| after \|", result.stdout, re.MULTILINE)
    assert rows == [("records", "2000", "2000"), ("conversations", "600", "201"), ("conversations", "3000", "1008")]
    assert re.search(r"record pairs/s at 3000 / at 600: [0-9.]+", result.stdout)
    launches = re.findall(r"^\| after, (fresh cache|relaunch) \| ([0-9.]+) \| (\d+) \|$", result.stdout, re.MULTILINE)
    assert [name for name, *_ in launches] == ["fresh cache", "relaunch"]
