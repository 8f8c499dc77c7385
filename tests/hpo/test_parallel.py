"""`parallel_trials`: two single-process workers on one CPU node share one journal study; the launcher replaces a worker
killed in a trial, reloads the best trial and writes one report."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest

from hf_scale.errors import ConfigError
from hf_scale.hpo import SearchArguments, parallel
from hf_scale.hpo.policy import runs_of
from tests.helpers import SHARED_DATA, assert_succeeded, python_bin, run_command, start
from tests.hpo.conftest import WORKER

pytestmark = pytest.mark.slow
N_TRIALS = 6
# 4 evaluations a trial: ASHA's and Hyperband's rungs (reduction factor 3) are at evaluations 1 and 3.
FLAGS = ["--n_trials", str(N_TRIALS), "--parallel_trials", "2", "--max_steps", "24", "--eval_steps", "6"]
# Not anchored at a line's start: another worker's progress bar (a carriage return, no newline) can precede the line.
TRIAL_STARTED = re.compile(r"hf_scale hpo \[worker (\d+\.\d+)\]: trial (\d+): \{")


def launch(output_dir, *flags):
    log = open(output_dir.parent / "search.log", "w")  # noqa: SIM115 -- closed by finish()
    process = start(
        [python_bin("python"), WORKER, "--output_dir", str(output_dir), *FLAGS, *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return process, log


def finish(process, log, timeout: float = 500) -> str:
    try:
        process.wait(timeout=timeout)
    finally:
        process.kill()
        log.close()
    output = open(log.name).read()
    assert process.returncode == 0, output[-5000:]
    return output


def journal_study(output_dir) -> optuna.Study:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(output_dir / parallel.JOURNAL_FILE)))
    return optuna.load_study(study_name="hf_scale", storage=storage)


def trials_run(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's trials without those created beyond n_trials by a worker that asked at the same moment as another
    (recorded FAIL, not run, not counted): n_trials is the number of trials run."""
    not_run = [t for t in study.trials if t not in runs_of(study.trials)]
    assert all(t.state.name == "FAIL" and not t.intermediate_values for t in not_run)
    return runs_of(study.trials)


def assert_every_trial_started_once(output: str, study: optuna.Study) -> dict[int, str]:
    """Each trial of the study was started by exactly one worker, once; returns who ran which."""
    started = [(int(number), worker) for worker, number in TRIAL_STARTED.findall(output)]
    numbers = [number for number, _ in started]
    assert len(numbers) == len(set(numbers)), f"a trial ran twice: {started}"
    assert set(numbers) == {t.number for t in trials_run(study)}
    return dict(started)


def assert_pruned_only_at_rungs(study: optuna.Study) -> None:
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert pruned, [t.state.name for t in study.trials]  # 7 trials, lr 1e-5 to 1e-1: some are not in the best third
    assert {t.user_attrs["evaluations"] for t in pruned} <= {1, 3}


def test_two_workers_run_every_trial_once_and_a_killed_workers_trial_is_failed_and_run_again(tmp_path, tiny_model_dir):
    output_dir = tmp_path / "search"
    process, log = launch(output_dir, "--pruner", "asha", "--sleep_trial", "2")
    sleeping = output_dir / "trial-0002" / "sleeping"
    deadline = time.time() + 300
    while not sleeping.exists():
        assert process.poll() is None and time.time() < deadline, "trial 2 never started"
        time.sleep(0.2)
    time.sleep(0.2)  # the pid is written
    os.kill(int(sleeping.read_text()), signal.SIGKILL)  # the worker running trial 2, in the middle of it
    output = finish(process, log)

    study = journal_study(output_dir)
    states = {t.number: t.state.name for t in trials_run(study)}
    assert states[2] == "FAIL"
    assert [number for number, state in states.items() if state not in ("COMPLETE", "PRUNED")] == [2]
    assert len(states) - 1 == N_TRIALS  # the budget, the killed trial not counted
    ran_by = assert_every_trial_started_once(output, study)
    killed_worker = ran_by[2]
    assert f"worker {killed_worker} died (exit code -9) in trial(s) [2]: marked failed" in output
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == 2]
    assert len(retried) == 1 and retried[0].params == study.trials[2].params
    assert ran_by[retried[0].number] not in (killed_worker, None)  # run by the worker that took its place, or the other
    assert len({worker.split(".")[0] for worker in ran_by.values()}) == 2  # both slots ran trials
    assert_pruned_only_at_rungs(study)
    # One report and one best model, from the launcher, of the study's best trial.
    assert output.count("trials table and plots in") == 1 and (output_dir / "hpo-report").is_dir()
    assert f"best trial {study.best_trial.number} ({study.best_value}): reloading" in output
    assert (output_dir / "best-model" / "model.safetensors").is_file()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c-in-a-terminal", "sigterm"])
def test_a_stopped_launcher_stops_every_worker_and_fails_their_trials(tmp_path, tiny_model_dir, signum):
    """Ctrl-C in a terminal, or SIGTERM (a scheduler's preemption, `kill`: it left the workers running on their GPUs).
    Each worker is in a process group of its own, so that a terminal's Ctrl-C (sent to the whole foreground group)
    reaches the launcher alone, which stops each worker once (twice: the second interrupted the worker's cleanup).
    The Ctrl-C launch is fresh: the preloaded server (tests/preloaded) puts every forked launch in its own group."""
    terminal = signum == signal.SIGINT
    output_dir = tmp_path / "search"
    log = open(tmp_path / "search.log", "w")  # noqa: SIM115
    process = start(
        [python_bin("python"), WORKER, "--output_dir", str(output_dir), *FLAGS, "--sleep_trial", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        # What a terminal's Ctrl-C finds, also where the test runner was started with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        process_group=0,  # the foreground group a terminal signals, the launcher its leader
        fresh=terminal,
    )
    worker_pid = None
    try:
        deadline = time.time() + 300
        sleeping = output_dir / "trial-0001" / "sleeping"
        while not sleeping.exists():
            assert process.poll() is None and time.time() < deadline, "trial 1 never started"
            time.sleep(0.2)
        time.sleep(0.2)  # the pid is written
        worker_pid = int(sleeping.read_text())
        if terminal:
            assert os.getpgid(worker_pid) != process.pid  # out of the terminal's group: no second Ctrl-C
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        process.wait(timeout=parallel.STOP_GRACE_SECONDS + 30)
    finally:
        process.kill()
        log.close()
        if worker_pid is not None and process.returncode is None:  # a failed test leaves no worker behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)
    assert process.returncode == (-signal.SIGINT if signum == signal.SIGINT else 128 + signal.SIGTERM)
    study = journal_study(output_dir)
    assert study.trials[1].state.name == "FAIL"
    assert "RUNNING" not in {t.state.name for t in study.trials}
    for trial in study.trials:  # no worker left behind
        pid = int(trial.user_attrs["worker"].split(":")[1])
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_hf_scale_search_with_two_parallel_trials_and_hyperband_completes_the_budget(tmp_path, tiny_model_dir):
    """The README's launch line on the tiny default (`python -m hf_scale.cli`: the workers re-run the module)."""
    output_dir = tmp_path / "search"
    flags = ["--parallel_trials", "2", "--pruner", "hyperband", "--n_trials", "6", "--max_steps", "12"]
    flags += ["--eval_steps", "3", "--output_dir", str(output_dir)]
    result = run_command([python_bin("python"), "-m", "hf_scale.cli", "search", *flags], timeout=500)
    assert_succeeded(result, result.stdout[-3000:] + result.stderr[-3000:])
    study = journal_study(output_dir)
    assert [t.state.name for t in trials_run(study) if t.state.name not in ("COMPLETE", "PRUNED")] == []
    assert len(trials_run(study)) == 6
    ran_by = assert_every_trial_started_once(result.stdout, study)
    assert len({worker.split(".")[0] for worker in ran_by.values()}) == 2
    assert_pruned_only_at_rungs(study)
    assert result.stdout.count("trials table and plots in") == 1
    best = json.loads((output_dir / "best_run.json").read_text())
    assert (int(best["best_trial"]), best["objective"]) == (study.best_trial.number, study.best_value)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_shipped_lora_search_in_parallel_then_relaunched_goes_on_with_its_study(
    tmp_path, tiny_model_dir, alpaca_sample
):
    """The README's line for the shipped LoRA search (bf16, gradient checkpointing), shrunk as the config tests shrink
    it; launched again with a larger n_trials, it adds trials to the same journal study."""
    output_dir = tmp_path / "search"
    command = [python_bin("python"), "-m", "hf_scale.cli", "search", "--config", "search_llama2_7b_lora"]
    command += ["--parallel_trials", "2", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(output_dir)]
    command += ["--dataset", str(alpaca_sample("alpaca_zh_demo.json")), "--max_steps", "4", "--eval_steps", "2"]
    command += ["--per_device_batches", "2", "--effective_batch_min", "4", "--effective_batch_max", "8"]
    command += ["--use_cpu", "true"]  # bf16 on one CPU process: transformers asks for it (2 processes get it set)
    outputs = []
    for n_trials in (2, 3):
        result = run_command([*command, "--n_trials", str(n_trials)], timeout=500)
        assert_succeeded(result, result.stdout[-3000:] + result.stderr[-3000:])
        outputs.append(result.stdout)
    assert "with 2 trial(s) already" in outputs[1]
    study = journal_study(output_dir)
    states = [t.state.name for t in trials_run(study)]
    assert states == ["COMPLETE"] * 3  # 2 evaluations: the median pruner waits
    ran_by = assert_every_trial_started_once("\n".join(outputs), study)
    assert sorted(int(number) for _, number in TRIAL_STARTED.findall(outputs[1])) == [trials_run(study)[2].number]
    assert len({worker for number, worker in ran_by.items() if number < 2}) == 2  # the first two ran side by side
    assert all({"lora_r", "lora_alpha", "learning_rate"} <= t.params.keys() for t in trials_run(study))
    best = json.loads((output_dir / "best_run.json").read_text())
    assert (int(best["best_trial"]), best["objective"]) == (study.best_trial.number, study.best_value)
    assert (output_dir / "best-model" / "adapter_model.safetensors").is_file()
    assert not (output_dir / "best-model" / "model.safetensors").exists()  # adapters only
    assert all(output.count("trials table and plots in") == 1 for output in outputs)


@pytest.mark.parametrize(
    ("orig_argv", "argv", "expected"),
    [
        (["py", "-u", "recipes/search_llama2.py", "--x", "1"], ["recipes/search_llama2.py", "--x", "1"], "script"),
        (["py", "-m", "hf_scale.cli", "search", "--x", "1"], ["/site/hf_scale/cli.py", "search", "--x", "1"], "module"),
    ],
)
def test_worker_command_runs_this_program_again(monkeypatch, orig_argv, argv, expected):
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    monkeypatch.setattr(sys, "argv", argv)
    program = orig_argv[1:3]
    assert parallel.worker_command(None) == [sys.executable, *program, *argv[1:]]
    torchrun = parallel.worker_command(["2", "3"])
    assert torchrun[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    target = ["recipes/search_llama2.py"] if expected == "script" else ["-m", "hf_scale.cli"]
    assert torchrun[7:] == [*target, *argv[1:]]  # after --master_port PORT; no interpreter option for torchrun


def test_parallel_trials_under_a_launcher_is_refused_when_parsed(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="parallel_trials=2: the search starts its own workers; start it as one"):
        SearchArguments(parallel_trials=2)
    SearchArguments(parallel_trials=1)  # a plain search on 2 processes
    monkeypatch.setenv(parallel.WORKER_ENV, "0.0")
    SearchArguments(parallel_trials=2)  # a worker on 2 GPUs, under the torchrun its launcher started
