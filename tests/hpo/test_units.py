"""The search's parts on their own: space, applying values, objective and direction, pruners, storage, report."""

import csv
import gc
import json
import os
import time
import weakref
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState
from transformers import AutoModelForCausalLM

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.cli import main as cli_main
from hf_scale.errors import ConfigError
from hf_scale.hpo import parallel
from hf_scale.hpo.objective import BestValue, check_against_direction, metric_objective, resolve_direction
from hf_scale.hpo.policy import best_of, runs_of, same_error_every_time
from hf_scale.hpo.report import load_study, trials_table, write_report
from hf_scale.hpo.search import Search, TrialNotRun, train_on_one_device
from hf_scale.hpo.settings import SpaceArguments, make_pruner, split_kwargs
from hf_scale.hpo.space import accumulation_steps, default_hp_space, effective_batch_choices, split_hyperparameters
from hf_scale.hpo.storage import JournalHeartbeat, open_storage
from hf_scale.hpo.sync import setup_missed_message
from hf_scale.safety import mask_secrets
from hf_scale.trainer import ScaleTrainer

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sample(space, trials=40, seed=0):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    return [space(study.ask()) for _ in range(trials)]


@pytest.mark.parametrize("world_size", [1, 4, 8])
def test_default_space_keeps_the_effective_batch_in_range(world_size):
    for params in sample(default_hp_space(world_size=world_size)):
        assert 1e-5 <= params["learning_rate"] <= 1e-4
        assert 0.01 <= params["weight_decay"] <= 0.3
        assert params["per_device_train_batch_size"] in (2, 4, 8)
        assert params["lr_scheduler_type"] in ("linear", "cosine")
        assert 0 <= params["warmup_ratio"] <= 0.1
        effective = params["per_device_train_batch_size"] * world_size * params["gradient_accumulation_steps"]
        assert 32 <= effective <= 128
        assert not {"lora_r", "lora_alpha", "lora_dropout"} & params.keys()


def test_default_space_adds_lora_values_for_a_peft_model():
    for params in sample(default_hp_space(peft=True), trials=10):
        assert params["lora_r"] in (8, 16, 32, 64) and params["lora_alpha"] in (16, 32, 64)
        assert 0 <= params["lora_dropout"] <= 0.1


def test_space_arguments_set_the_ranges_and_refuse_bad_ones_when_built():
    space = SpaceArguments(search_space="pre_training", lr_min=1e-4, per_device_batches="1,16", effective_batch_max=64)
    for params in sample(default_hp_space(world_size=2, space=space), trials=20):
        assert 1e-4 <= params["learning_rate"] <= 5e-4  # pre_training's ceiling, the given floor
        assert params["per_device_train_batch_size"] in (1, 16)
        assert 32 <= params["per_device_train_batch_size"] * 2 * params["gradient_accumulation_steps"] <= 64
    for bad, message in [
        (dict(search_space="pretraining"), "search_space: unknown space 'pretraining'"),
        (dict(lr_min=1e-3), "lr_min / lr_max: need 0 < lr_min < lr_max"),
        (dict(per_device_batches="2;4"), "per_device_batches: not a list of integers"),
    ]:
        with pytest.raises(ConfigError, match=message):
            SpaceArguments(**bad)


def test_batch_helpers():
    assert effective_batch_choices(32, 128) == (32, 64, 128)
    assert accumulation_steps(64, 4, 2) == 8
    assert accumulation_steps(32, 8, 16) == 1  # more processes than the range allows: at least 1
    with pytest.raises(ConfigError, match="no power of two"):
        effective_batch_choices(33, 63)


def test_values_are_split_into_arguments_and_lora():
    args = SimpleNamespace(learning_rate=5e-5, warmup_steps=0, per_device_train_batch_size=8, lr_scheduler_type="x")
    updates, lora = split_hyperparameters(
        {"learning_rate": 1e-4, "warmup_ratio": 0.05, "per_device_train_batch_size": 4.0, "lora_r": 16}, args
    )
    assert updates == {"learning_rate": 1e-4, "warmup_steps": 0.05, "per_device_train_batch_size": 4}
    assert type(updates["per_device_train_batch_size"]) is int and lora == {"lora_r": 16}
    with pytest.raises(ConfigError, match="'learnig_rate' is neither a ScaleTrainingArguments field"):
        split_hyperparameters({"learnig_rate": 1e-4}, args)
    with pytest.raises(ConfigError, match="warmup_ratio must lie in"):
        split_hyperparameters({"warmup_ratio": 1.5}, args)


def arguments(metric=None, greater=None):
    return SimpleNamespace(metric_for_best_model=metric, greater_is_better=greater)


def test_direction_follows_the_objective_metric():
    assert resolve_direction(None, None, arguments()) == "minimize"
    assert resolve_direction(None, None, arguments("accuracy", True)) == "maximize"
    assert resolve_direction("minimize", None, arguments("loss", False)) == "minimize"
    with pytest.raises(ConfigError, match="direction='maximize' contradicts the objective eval_loss"):
        resolve_direction("maximize", None, arguments())
    with pytest.raises(ConfigError, match="contradicts the objective eval_exact_match, which is better when higher"):
        resolve_direction("minimize", None, arguments("exact_match", True))
    with pytest.raises(ConfigError, match="neither 'minimize' nor 'maximize'"):
        resolve_direction("max", None, arguments())
    # A custom objective: the caller's direction, minimize by default; one objective only.
    assert resolve_direction(None, lambda m: 0.0, arguments()) == "minimize"
    with pytest.raises(ConfigError, match=r"\['minimize', 'maximize'\] is neither .* optimizes one objective"):
        resolve_direction(["minimize", "maximize"], lambda m: [0, 1], arguments())


def test_compute_objective_contradicting_the_direction_is_refused():
    metrics = {"eval_loss": 1.25, "eval_accuracy": 0.5, "epoch": 1.0}
    with pytest.raises(ConfigError, match=r"returns eval_loss \(better when lower\) but direction='maximize'"):
        check_against_direction(1.25, metrics, "maximize")
    with pytest.raises(ConfigError, match=r"returns eval_accuracy \(better when higher\)"):
        check_against_direction(0.5, metrics, "minimize")
    check_against_direction(1.25, metrics, "minimize")
    check_against_direction(3.0, metrics, "maximize")  # not a known metric: the caller knows best
    with pytest.raises(ConfigError, match="the evaluation has no 'eval_bleu'; it has epoch, eval_accuracy"):
        metric_objective("eval_bleu")(metrics)


def test_best_value_keeps_the_best_evaluation():
    best = BestValue("minimize")
    for step, value in enumerate([3.0, 2.0, float("nan"), 2.5], start=1):
        best.update(value, step * 10)
    assert (best.value, best.evaluation, best.step, best.evaluations) == (2.0, 2, 20, 4)
    best = BestValue("maximize")
    best.update(0.1, 1), best.update(0.3, 2), best.update(0.2, 3)
    assert best.value == 0.3 and best.evaluation == 2


def test_pruners():
    median = make_pruner()
    assert isinstance(median, optuna.pruners.MedianPruner)
    assert median._n_startup_trials == 4 and median._n_warmup_steps == 2  # evaluation 1 is never pruned
    assert isinstance(make_pruner("hyperband"), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner("none"), optuna.pruners.NopPruner)
    assert isinstance(make_pruner("asha"), optuna.pruners.SuccessiveHalvingPruner)
    with pytest.raises(ConfigError, match="unknown pruner 'sha'"):
        make_pruner("sha")


def test_kwargs_are_split_and_checked():
    settings, study, optimize = split_kwargs(
        {"n_trials": 3, "timeout": 10, "pruner": "hyperband", "sampler": "S", "catch": (ValueError,)}
    )
    assert settings.n_trials == 3 and settings.timeout == 10 and settings.pruner == "hyperband"
    assert study == {"sampler": "S"} and optimize == {"catch": (ValueError,)}
    pruner = optuna.pruners.NopPruner()
    settings, study, _ = split_kwargs({"pruner": pruner})
    assert study == {"pruner": pruner} and settings.pruner == "median"
    settings, _, _ = split_kwargs({"storage": "sqlite:///x.db", "study_name": "s"})
    assert settings.storage == "sqlite:///x.db" and settings.study_name == "s"
    with pytest.raises(ConfigError, match="unknown argument 'n_trial'"):
        split_kwargs({"n_trial": 3})
    with pytest.raises(ConfigError, match="n_jobs"):
        split_kwargs({"n_jobs": 2})


def test_passwords_are_masked():
    url = "postgresql+psycopg2://hpo:s3cr3t-pw@127.0.0.1:5432/studies"
    assert mask_secrets(url) == "postgresql+psycopg2://hpo:***@127.0.0.1:5432/studies"
    assert "s3cr3t" not in mask_secrets(f"could not connect to {url} (timeout)")
    assert mask_secrets("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"
    with pytest.raises(ConfigError) as error:
        open_storage("not-a-url-s3cr3t@host")
    assert "neither a database URL" in str(error.value)


def finished_study(storage=None, name="s"):
    study = optuna.create_study(storage=storage, study_name=name, sampler=optuna.samplers.RandomSampler(seed=1))
    for number in range(5):
        trial = study.ask()
        lr = trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        trial.suggest_categorical("per_device_train_batch_size", [8, 16])
        trial.set_user_attr("hyperparameters", dict(trial.params))
        for step in (1, 2):
            trial.report(1.0 / (lr * step * 100) + number, step)
        if number == 3:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, 1.0 / (lr * 200) + number)
    return study


def test_report_writes_table_and_plots(tmp_path):
    study = finished_study()
    table = trials_table(study)
    assert list(table["state"]) == ["COMPLETE"] * 3 + ["PRUNED", "COMPLETE"]
    assert table["evaluations"][0] == 2 and "param_learning_rate" in table
    folder = write_report(study, tmp_path / "report")
    table = list(csv.DictReader((folder / "trials.csv").open()))
    assert [int(row["number"]) for row in table] == [0, 1, 2, 3, 4]
    assert json.loads((folder / "trials.json").read_text())[3]["state"] == "PRUNED"
    assert f"best: trial {study.best_trial.number}" in (folder / "summary.txt").read_text()
    for plot in ("optimization_history", "intermediate_values", "param_importances"):
        assert (folder / f"{plot}.png").stat().st_size > 5000


def test_report_command_reads_a_study_file(tmp_path, capsys):
    database = tmp_path / "optuna_study.db"
    finished_study(storage=f"sqlite:///{database}", name="tiny")
    assert cli_main(["report", str(database), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "study 'tiny': 5 trial(s): complete 4, pruned 1" in printed
    assert (tmp_path / "out" / "optimization_history.png").is_file()
    assert cli_main(["report", str(tmp_path / "missing.db")]) == 2
    assert load_study(str(database)).study_name == "tiny"


def test_journal_heartbeat_fails_and_requeues_a_dead_workers_trial(tmp_path):
    storage = open_storage(f"journal:{tmp_path / 'study.journal'}")
    study = optuna.create_study(storage=storage)
    heartbeat = JournalHeartbeat(study, storage, interval=1, grace_period=1, max_retry=1)
    trial = study.ask()
    trial.suggest_float("x", 0, 1)
    heartbeat.start(trial.number)
    time.sleep(0.2)
    heartbeat.stop()  # the worker "dies": no more heartbeats
    assert heartbeat.fail_stale() == []  # still within the grace period
    time.sleep(1.3)
    assert heartbeat.fail_stale() == [0]
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [TrialState.FAIL, TrialState.WAITING]
    assert study.trials[1].params == study.trials[0].params


def test_setup_missed_message_says_whether_this_rank_was_set_up_and_why_the_others_are_late():
    missed = RuntimeError("Application timeout caused pair closure\nmore")
    ready_here = setup_missed_message(4, None, 10, missed, building_is_collective=True)
    assert ready_here.startswith("trial 4 on rank 0: it is set up here, but not every rank finished setting it up")
    assert (
        "waited at most 10 s: Application timeout caused pair closure); they wait inside it (under ZeRO-3" in ready_here
    )
    raised_here = setup_missed_message(
        4, "RuntimeError: no disk\ntraceback", 1800, missed, building_is_collective=False
    )
    assert raised_here.startswith("trial 4 on rank 0: setting it up raised here: RuntimeError: no disk, but not")
    assert "waited at most 1800 s: Application timeout caused pair closure); a rank is still building" in raised_here


def test_report_of_a_study_whose_only_trial_is_still_running(tmp_path):
    study = optuna.create_study(study_name="running")
    study.ask().suggest_float("x", 0, 1)  # `hf-scale report` while the first trial trains: no duration yet
    table = trials_table(study)
    assert list(table["state"]) == ["RUNNING"] and table["duration_s"].isna().all()
    assert "running 1" in (write_report(study, tmp_path / "report") / "summary.txt").read_text()


def test_journal_heartbeat_goes_on_after_a_failed_write(tmp_path, monkeypatch):
    """One failed write (a shared filesystem's hiccup) must not end the heartbeats: another worker would fail and
    queue again a trial that is still running."""
    storage = open_storage(f"journal:{tmp_path / 'study.journal'}")
    study = optuna.create_study(storage=storage)
    heartbeat = JournalHeartbeat(study, storage, interval=1, grace_period=2, max_retry=1)
    trial = study.ask()
    write = storage.set_trial_system_attr
    failures = iter([OSError("Stale file handle")])

    def flaky_write(*args):
        if (error := next(failures, None)) is not None:
            raise error
        write(*args)

    monkeypatch.setattr(storage, "set_trial_system_attr", flaky_write)
    with pytest.warns(UserWarning, match="trial 0: heartbeat not written \\(Stale file handle\\); trying again"):
        heartbeat.start(trial.number)
        time.sleep(1.5)  # the second beat, one interval after the failed first
        heartbeat.stop()
    assert time.time() - study.trials[0].system_attrs["hf_scale:heartbeat"] < 1.5
    time.sleep(1.0)  # 2.5 s after the start: past the grace period counted from the start, not from the last beat
    assert heartbeat.fail_stale() == []


def fake_search(study, output_dir, n_trials=2):
    """What Search.check_within_budget and Search.after_trial read of the search."""
    return SimpleNamespace(
        study=study, settings=SimpleNamespace(n_trials=n_trials), output_dir=output_dir, direction="minimize",
        stop_reason=lambda: None,
    )  # fmt: skip


def test_a_trial_created_beyond_n_trials_is_not_run_and_not_counted(tmp_path):
    """n_trials across workers: two that check the study at the same moment each create a trial; the one created
    when the study already held n_trials is recorded not run (`--n_trials 1 --parallel_trials 2` ran 2 trials)."""
    study = optuna.create_study(storage=open_storage(f"journal:{tmp_path / 'study.journal'}"))
    search = fake_search(study, tmp_path, n_trials=1)
    first, second = study.ask(), study.ask()  # both workers asked before either trial was recorded as run
    Search.check_within_budget(search, first)
    with pytest.raises(TrialNotRun, match="the study already held n_trials=1 trial\\(s\\) when it was created"):
        Search.check_within_budget(search, second)
    study.tell(second, state=TrialState.FAIL)
    study.tell(first, state=TrialState.FAIL)  # the trial that ran fails: a new one may run in its place
    Search.check_within_budget(search, study.ask())
    assert [t.number for t in runs_of(study.trials)] == [0, 2]


def test_the_best_trial_is_read_with_the_trial_list_so_its_checkpoint_is_kept(tmp_path, monkeypatch):
    """A trial of another worker that finishes, as the new best, between the two reads of the study had its
    checkpoint deleted when the best trial and the trial list were read apart."""
    study = optuna.create_study(storage=open_storage(f"journal:{tmp_path / 'study.journal'}"))
    done, running = study.ask(), study.ask()
    study.tell(done, 1.0)
    for number in (0, 1):
        (tmp_path / f"trial-000{number}" / "checkpoint-4").mkdir(parents=True)
    finished_here = study.trials[0]
    read_trials = study.get_trials
    other_worker_done = []

    def trials_as_the_other_worker_finishes(*args, **kwargs):
        if not other_worker_done:
            other_worker_done.append(study.tell(running, 0.5))  # the other worker's trial ends, better
        return read_trials(*args, **kwargs)

    monkeypatch.setattr(study, "get_trials", trials_as_the_other_worker_finishes)
    Search.after_trial(fake_search(study, tmp_path), study, finished_here)
    assert (tmp_path / "trial-0001" / "checkpoint-4").is_dir()  # the best trial's
    assert not (tmp_path / "trial-0000" / "checkpoint-4").exists()


def test_best_of_picks_what_optuna_picks():
    study = optuna.create_study(direction="maximize")
    for value in (0.3, 0.7, 0.7, 0.1):
        study.add_trial(optuna.trial.create_trial(value=value))
    assert best_of(study.trials, "maximize").number == study.best_trial.number == 1
    assert best_of(study.trials, "minimize").number == 3
    assert best_of([], "minimize") is None


def test_the_search_holds_no_model_of_its_own(tmp_path, tiny_model_dir):
    """Trainer.__init__ builds a model with model_init; the search drops it from the callback handler too, or the
    launcher of parallel trials keeps a full copy on the first GPU for the whole search."""
    trainer = ScaleTrainer(
        model_init=lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=ScaleTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
    )
    built = weakref.ref(trainer.model)
    Search(trainer, None, None, 1, None, None, {})
    gc.collect()
    assert built() is None


def test_the_launcher_retrains_the_best_trial_on_one_device():
    """A launcher that sees 4 GPUs would retrain in nn.DataParallel with a 4 times larger batch."""
    args = ScaleTrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    args._n_gpu = 4  # what a launcher on a node of 4 GPUs has
    train_on_one_device(args)
    assert args.n_gpu == 1


def failed(error: str) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"error": error})


def test_the_same_error_in_the_first_three_trials_ends_the_search():
    """Every trial of `--parallel_trials 2 --zero_preset zero2` failed with one ModuleNotFoundError, and the search
    said so only after the last: a broken setup ends it after 3 trials; a diverging training does not."""
    missing = "rank 0: ModuleNotFoundError: No module named 'mpi4py'\nTraceback ..."
    assert same_error_every_time([failed(missing)] * 3) == "ModuleNotFoundError: No module named 'mpi4py'"
    assert same_error_every_time([failed(missing)] * 2) is None
    assert same_error_every_time([failed(missing), failed("rank 1: OSError: disk full"), failed(missing)]) is None
    complete = optuna.trial.create_trial(value=1.0)
    assert same_error_every_time([complete, failed(missing), failed(missing), failed(missing)]) is None
    diverged = "rank 0: TrainingDiverged: training diverged at step 4: the loss is nan"
    assert same_error_every_time([failed(diverged)] * 3) is None


def test_a_parallel_worker_gets_its_own_launch_environment_and_its_share_of_the_cores(monkeypatch):
    """A one-process ZeRO launcher holds rank variables for itself (its port included): each worker inherited them and
    both failed with EADDRINUSE on that port. On CPU each worker used every core."""
    monkeypatch.setenv("MASTER_PORT", "29999")
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    cpu_worker = parallel.worker_environment(None, parallel_trials=2)
    assert cpu_worker["WORLD_SIZE"] == "1" and cpu_worker["RANK"] == "0"
    assert cpu_worker["MASTER_PORT"] != "29999"
    assert cpu_worker["OMP_NUM_THREADS"] == "4"
    gpus_worker = parallel.worker_environment(["2", "3"], parallel_trials=2)  # under torchrun, which sets its own
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & gpus_worker.keys()
    assert gpus_worker["CUDA_VISIBLE_DEVICES"] == "2,3" and "OMP_NUM_THREADS" not in gpus_worker
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stays
    assert parallel.worker_environment(None, parallel_trials=2)["OMP_NUM_THREADS"] == "3"
