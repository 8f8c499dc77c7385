"""`hyperparameter_search` with each option of the README's callbacks table: every trial completes.

Trial arguments are built from the user's arguments through the same checks (`dataclasses.replace`), so an option
that changes other arguments (min_learning_rate sets the schedule, early stopping turns on load_best_model_at_end, a
preset fills DeepSpeed's "auto" values) holds in every trial as it does in a plain run. `--space default` is
hf_scale's own space, which also samples the schedule, the batch and the warm-up. The options are combined three
ways so that each runs in a search: min_learning_rate failed every trial before (a schedule from the space and the
floor's kwargs of another), and with a ZeRO preset also every plain run (the floor was divided by
`optimizer.defaults`, which DeepSpeed's ZeRO optimizers do not have).
"""

import pytest

from tests.hpo.conftest import run_search

pytestmark = pytest.mark.slow
SHORT = ["--n_trials", "2", "--max_steps", "8", "--eval_steps", "4", "--train_records", "256", "--startup_trials", "5"]
MIN_LR = ["--space", "default", "--min_learning_rate", "1e-6"]
EARLY_STOPPING = ["--early_stopping_patience", "1", "--max_steps", "16"]
COMBINATIONS = {
    "min_learning_rate+early_stopping+packing": [*MIN_LR, *EARLY_STOPPING, "--packing"],
    "divergence_skip+lora": ["--divergence_action", "skip", "--divergence_spike_factor", "5", "--lora"],
}


@pytest.mark.parametrize("options", COMBINATIONS)
def test_search_with_the_options_completes_its_trials(tmp_path, tiny_model_dir, options):
    (report,) = run_search(tmp_path, *SHORT, *COMBINATIONS[options], timeout=300)
    assert [t["state"] for t in report["study"]] == ["COMPLETE", "COMPLETE"], report["study"]
    if "min_learning_rate" in options:
        assert {t["params"]["lr_scheduler_type"] for t in report["study"]} == {"cosine"}  # the only one with a floor


def test_search_with_a_zero_preset_a_floor_and_early_stopping_on_two_processes(tmp_path, tiny_model_dir):
    flags = [*SHORT, *MIN_LR, *EARLY_STOPPING, "--zero_preset", "zero2"]
    rank0, rank1 = run_search(tmp_path, *flags, processes=2, timeout=400)
    assert [t["state"] for t in rank0["study"]] == ["COMPLETE", "COMPLETE"], rank0["study"]
    assert [o["state"] for o in rank1["outcomes"]] == ["complete", "complete"]
