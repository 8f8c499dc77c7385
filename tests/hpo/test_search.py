"""Single-process searches on the tiny task: pruning, the best model reloaded, memory, LoRA, refused directions, resume.

Each search runs in its own process (tests/hpo/search_worker.py) with a hard timeout. The learning rate is searched
from 1e-5 to 1e-1 (log): below about 3e-4 the tiny model barely moves in 24 steps, so those trials are clearly bad.
"""

import csv
import json
import math
import runpy
import signal
import subprocess
import sys
import time

import optuna
import pytest

from tests.helpers import REPO_ROOT, python_bin, run_once, start
from tests.hpo.conftest import WORKER, run_search, trials_seen


@pytest.fixture(scope="session")
def twelve_trials(shared_dir, tiny_model_dir):
    """One 12-trial search, read by four tests (on whichever pytest-xdist worker each runs)."""
    search = lambda folder: run_search(folder, "--n_trials", "12", "--startup_trials", "3", timeout=500)  # noqa: E731
    output_dir = run_once(shared_dir, "search-twelve-trials", search)
    return output_dir, json.loads((output_dir / "rank0.json").read_text())


@pytest.mark.slow
def test_search_prunes_bad_learning_rates_and_returns_the_best_trial(twelve_trials):
    output_dir, report = twelve_trials
    study = report["study"]
    assert len(study) == 12 and all(t["state"] in ("COMPLETE", "PRUNED") for t in study)
    complete = [t for t in study if t["state"] == "COMPLETE"]
    pruned = [t for t in study if t["state"] == "PRUNED"]
    assert len(pruned) >= 3
    # Every trial with a clearly bad rate that ran after the startup trials was stopped early.
    bad_after_startup = [t for t in study[3:] if t["params"]["learning_rate"] < 3e-4]
    assert bad_after_startup and all(t["state"] == "PRUNED" for t in bad_after_startup)
    # The best run is the complete trial with the lowest eval loss, and it has a good rate.
    best = min(complete, key=lambda t: t["value"])
    assert report["best"]["run_id"] == str(best["number"])
    assert report["best"]["objective"] == best["value"]
    assert 1e-3 < report["best"]["hyperparameters"]["learning_rate"] < 1e-1
    assert report["trainer_lr"] == report["best"]["hyperparameters"]["learning_rate"]


@pytest.mark.slow
def test_reloaded_best_model_scores_the_trials_best_value(twelve_trials):
    output_dir, report = twelve_trials
    assert report["eval_after_search"]["eval_loss"] == pytest.approx(report["best"]["objective"], rel=1e-6)
    # The objective is the trial's best evaluation, not its last one.
    best = next(o for o in report["outcomes"] if str(o["number"]) == report["best"]["run_id"])
    assert best["value"] == report["best"]["objective"] and best["best_evaluation"] >= 1
    assert (output_dir / "best-model" / "model.safetensors").is_file()
    saved = json.loads((output_dir / "best-model" / "hpo_best_trial.json").read_text())
    assert saved["number"] == int(report["best"]["run_id"]) and saved["retrained"] is False
    # Checkpoints are pruned to the best trial's best one.
    checkpoints = sorted(path.relative_to(output_dir).as_posix() for path in output_dir.glob("trial-*/checkpoint-*"))
    assert checkpoints == [f"trial-{best['number']:04d}/checkpoint-{best['best_step']}"]


@pytest.mark.slow
def test_report_has_the_trials_table_and_plots(twelve_trials):
    output_dir, _ = twelve_trials
    folder = output_dir / "hpo-report"
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    assert len(rows) == 12 and {row["state"] for row in rows} == {"COMPLETE", "PRUNED"}
    assert len(json.loads((folder / "trials.json").read_text())) == 12
    for plot in ("optimization_history", "intermediate_values", "param_importances"):
        assert (folder / f"{plot}.png").stat().st_size > 5000


@pytest.mark.slow
def test_memory_after_trial_10_is_within_10_percent_of_after_trial_2(twelve_trials):
    _, report = twelve_trials
    rss = [o["rss_bytes"] for o in report["outcomes"]]
    assert abs(rss[9] - rss[1]) <= 0.10 * rss[1], [f"{r / 2**20:.0f} MiB" for r in rss]


@pytest.mark.slow
def test_lora_search_loads_the_base_once_and_recreates_adapters(tmp_path, tiny_model_dir):
    (report,) = run_search(tmp_path, "--lora", "--n_trials", "3", "--startup_trials", "5", timeout=300)
    # The base was built once (by Trainer.__init__); each trial and the reload of the best got new adapters on it.
    assert report["model_init_calls"] == 1
    assert len(set(report["base_digests"])) == 1 and len(report["base_digests"]) == 3  # base weights untouched
    assert report["lora_ranks"] == [o["params"]["lora_r"] for o in report["outcomes"]]
    assert report["eval_after_search"]["eval_loss"] == pytest.approx(report["best"]["objective"], rel=1e-6)


@pytest.mark.slow
def test_qlora_search_keeps_one_quantized_base_for_every_trial(tmp_path, tiny_model_dir):
    """4 trials over an NF4 base: it is loaded and quantized once; each trial gets new adapters on the same 4-bit
    weight objects, frozen (only lora_ parameters train)."""
    flags = ["--lora", "--quantization", "nf4", "--n_trials", "4", "--startup_trials", "5"]
    (report,) = run_search(tmp_path, *flags, timeout=400)
    assert report["model_init_calls"] == 1 and len(report["model_init_seconds"]) == 1
    bases = report["quantized_layers"]
    assert len(bases) == 4 and all(base["layers"] == 21 and base["frozen"] for base in bases)  # 3 layers x 7
    assert all(base["ids"] == bases[0]["ids"] for base in bases)  # the same Linear4bit weights in every trial
    assert report["lora_ranks"] == [o["params"]["lora_r"] for o in report["outcomes"]]


@pytest.mark.slow
def test_lora_search_without_fast_path_calls_model_init_per_trial(tmp_path, tiny_model_dir):
    (report,) = run_search(
        tmp_path, "--lora", "--lora_fast_path", "false", "--n_trials", "2", "--startup_trials", "5", timeout=300
    )
    assert report["model_init_calls"] == 4  # Trainer.__init__, two trials and the reload of the best
    assert len(set(report["base_digests"])) == 1


def run_failing(tmp_path, monkeypatch, capsys, *flags):
    """The worker in this process (the refusal comes before any trial or process group): its stderr; it exits 2."""
    monkeypatch.setattr(sys, "argv", [WORKER, "--output_dir", str(tmp_path), "--n_trials", "2", *flags])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO_ROOT / WORKER), run_name="__main__")
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2, stderr[-3000:]
    return stderr


def test_direction_against_the_default_objective_is_refused(tmp_path, tiny_model_dir, monkeypatch, capsys):
    stderr = run_failing(tmp_path, monkeypatch, capsys, "--direction", "maximize")
    assert "direction='maximize' contradicts the objective eval_loss, which is better when lower" in stderr
    assert not list(tmp_path.glob("trial-*"))  # refused before any trial


def test_compute_objective_against_direction_is_refused(tmp_path, tiny_model_dir, monkeypatch, capsys):
    stderr = run_failing(tmp_path, monkeypatch, capsys, "--objective", "eval_loss", "--direction", "maximize")
    assert "compute_objective returns eval_loss (better when lower) but direction='maximize'" in stderr


@pytest.mark.slow
def test_killed_search_resumes_without_losing_a_trial(tmp_path, tiny_model_dir):
    grace = 3
    flags = ["--n_trials", "5", "--startup_trials", "9", "--heartbeat_interval", "1", "--grace_period", str(grace)]
    flags += ["--max_steps", "12", "--eval_steps", "6"]
    first = start(
        [python_bin("python"), WORKER, "--output_dir", str(tmp_path), *flags, "--sleep_trial", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (tmp_path / "trial-0002" / "sleeping").exists():
            assert first.poll() is None and time.time() < deadline, "trial 2 never started"
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)  # killed in the middle of trial 2, no chance to clean up
        killed_at = time.time()
        first.wait(timeout=30)
    finally:
        first.kill()
    # Its trial counts as dead once its last heartbeat (at the latest the kill) is older than the grace period; a
    # relaunch sooner than that would rightly see it running (a preloaded relaunch starts within a second).
    time.sleep(max(0.0, killed_at + grace + 0.5 - time.time()))
    killed = optuna.load_study(study_name="hf_scale", storage=f"sqlite:///{tmp_path / 'optuna_study.db'}")
    assert [t.state.name for t in killed.trials] == ["COMPLETE", "COMPLETE", "RUNNING"]  # left as it died
    first_values = [t.value for t in killed.trials[:2]]
    (report,) = run_search(tmp_path, *flags, timeout=400)
    study = {t["number"]: t for t in report["study"]}
    states = [study[n]["state"] for n in range(len(study))]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]  # 5 results, as asked
    # The second run ran only the retry of the killed trial (with its values) and two new trials.
    assert [o["number"] for o in report["outcomes"]] == [3, 4, 5]
    assert study[3]["params"] == study[2]["params"]
    assert report["outcomes"][0]["params"] == {"learning_rate": study[2]["params"]["learning_rate"]}
    assert study[4]["params"] not in (study[0]["params"], study[1]["params"], study[2]["params"])
    assert study[0]["value"] == first_values[0] and study[1]["value"] == first_values[1]  # kept, not rerun
    assert not math.isnan(report["best"]["objective"])
    assert trials_seen(report)[0][2] == "complete"


def test_a_diverging_trial_fails_and_the_search_goes_on(tmp_path, tiny_model_dir, monkeypatch):
    """A learning rate far too high is the most ordinary thing a search meets: the trial whose loss becomes NaN is
    failed with the reason, its diagnosis checkpoint goes with it, and the search goes on (it ended the search)."""
    flags = ["--lrs", "1e30,5e-3,5e-3", "--n_trials", "2", "--max_steps", "8", "--eval_steps", "4"]
    monkeypatch.setattr(sys, "argv", [WORKER, "--output_dir", str(tmp_path), *flags])
    runpy.run_path(str(REPO_ROOT / WORKER), run_name="__main__")  # in this process: one process, no group
    study = {t["number"]: t for t in json.loads((tmp_path / "rank0.json").read_text())["study"]}
    assert [study[n]["state"] for n in sorted(study)] == ["FAIL", "COMPLETE", "COMPLETE"]  # n_trials counts no failure
    assert study[0]["error"].startswith("rank 0: TrainingDiverged: training diverged at step 4: the loss is nan, ")
    assert study[0]["error"].endswith("(its diagnosis checkpoint is not kept)")
    assert not list((tmp_path / "trial-0000").glob("diverged-step-*"))  # a failed trial keeps no checkpoint
