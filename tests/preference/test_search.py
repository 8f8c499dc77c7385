"""`PreferenceTrainer.hyperparameter_search`: 4 trials of learning rate, beta and loss type on 2 processes with a
pruner, ranked by held-out reward accuracy; the reference computed once for all of them (and once for 2 parallel
workers); eval_loss refused as the objective when beta or the loss type vary."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_succeeded, python_bin, run_command, torchrun

WORKER = "tests/preference/preference_search_worker.py"
pytestmark = pytest.mark.slow


def search(run, output_dir, cache, *flags, processes=1):
    common = ["--model_path", str(run), "--output_dir", str(output_dir), "--report_to", "none", "--use_cpu", "true"]
    common += [
        "--max_steps",
        "6",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
    ]
    common += ["--per_device_eval_batch_size", "16", "--logging_steps", "2", "--n_trials", "4", "--seed", "0"]
    command = [python_bin("python"), WORKER] if processes == 1 else torchrun(WORKER, processes=processes)
    return run_command([*command, *common, *flags], timeout=600, HF_SCALE_CACHE=str(cache))


def reference_lines(output: str) -> list[str]:
    return [line.split(" in ")[0].split(" from ")[0] for line in output.splitlines() if "reference log-probs" in line]


def test_four_trials_on_two_processes_with_pruning_rank_by_reward_accuracy_and_compute_the_reference_once(
    trained_tiny_run, tmp_path
):
    # exact match, not reward accuracy: in runs this short every trial's rewards change sign on the same pairs (Adam's
    # first steps move the same way whatever the rate and beta), so reward accuracy ties and ranks nothing
    flags = ["--metric_for_best_model", "exact_match", "--pruner", "median", "--startup_trials", "1"]
    result = search(trained_tiny_run, tmp_path / "search", tmp_path / "cache", *flags, processes=2)
    assert_succeeded(result, result.stdout[-3000:] + result.stderr[-4000:])
    report = json.loads((tmp_path / "search" / "search.json").read_text())
    trials = report["trials"]
    assert len(trials) == 4 and {t["state"] for t in trials} <= {"COMPLETE", "PRUNED"}, trials
    assert all(t["values"] and set(t["params"]) == {"learning_rate", "beta", "loss_type"} for t in trials)
    assert "objective eval_exact_match (maximize)" in result.stdout
    assert "PRUNED" in {t["state"] for t in trials}, trials
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    assert report["best"]["objective"] == max(max(t["values"]) for t in complete)
    # once, before the first trial, on rank 0's say-so: then every trial trains on the same columns
    assert reference_lines(result.stdout) == [
        "hf_scale: reference log-probs of 64 train pairs computed and kept",
        "hf_scale: reference log-probs of 32 eval pairs computed and kept",
    ]


def test_parallel_workers_read_the_reference_the_launcher_computed(trained_tiny_run, tmp_path):
    flags = ["--metric_for_best_model", "rewards/accuracies", "--parallel_trials", "2"]
    result = search(trained_tiny_run, tmp_path / "search", tmp_path / "cache", *flags)
    assert_succeeded(result, result.stdout[-3000:] + result.stderr[-4000:])
    lines = reference_lines(result.stdout)
    assert lines.count("hf_scale: reference log-probs of 64 train pairs computed and kept") == 1, lines
    assert lines.count("hf_scale: reference log-probs of 64 train pairs read") == 2, lines  # each worker
    report = json.loads((tmp_path / "search" / "search.json").read_text())
    assert len(report["trials"]) == 4 and all(t["state"] == "COMPLETE" for t in report["trials"])


def test_eval_loss_is_refused_as_the_objective_when_beta_or_the_loss_vary(tiny_model_dir, tmp_path):
    """Before any work: no reference computed, no study opened."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_scale.errors import ConfigError
    from hf_scale.preference import PreferenceTrainer, ScalePreferenceArguments

    args = ScalePreferenceArguments(output_dir=str(tmp_path), report_to="none")
    trainer = PreferenceTrainer(
        model_init=lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    with pytest.raises(ConfigError, match="eval_loss cannot rank trials whose beta, loss_type differ"):
        trainer.hyperparameter_search(n_trials=2)
    assert not trainer.reference_origin and not list(tmp_path.iterdir())
