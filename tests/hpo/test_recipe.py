"""The search recipe on the tiny default, and `hf-scale search` handing its flags to it."""

import json

import pytest

from hf_scale.cli import build_parser
from tests.helpers import assert_succeeded, python_bin, run_command


@pytest.mark.slow
def test_recipe_searches_the_tiny_default(tmp_path, tiny_model_dir):
    flags = ["--output_dir", str(tmp_path), "--n_trials", "2", "--max_steps", "20", "--eval_steps", "10"]
    result = run_command([python_bin("python"), "recipes/search_llama2.py", *flags], timeout=400)
    assert_succeeded(result, result.stderr[-3000:])
    best = json.loads((tmp_path / "best_run.json").read_text())
    params = best["hyperparameters"]
    assert {"learning_rate", "weight_decay", "per_device_train_batch_size", "lr_scheduler_type"} <= params.keys()
    assert 1e-4 <= params["learning_rate"] <= 3e-2  # the tiny config's range, not LLaMA-2's
    assert params["per_device_train_batch_size"] * params["gradient_accumulation_steps"] in (16, 32)
    assert (tmp_path / "best-model" / "model.safetensors").is_file()
    assert (tmp_path / "hpo-report" / "trials.csv").is_file()
    assert f"best trial {best['best_trial']}" in result.stdout


def test_search_command_passes_its_flags_to_the_recipe():
    options = build_parser().parse_args(["search", "--config", "search_tiny_cpu", "--n_trials", "3"])
    assert options.recipe_args == ["--config", "search_tiny_cpu", "--n_trials", "3"]
