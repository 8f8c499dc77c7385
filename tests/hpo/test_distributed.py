"""Two processes on CPU (torchrun, gloo): pruning, trials that raise and a timeout leave both ranks in step.

The trials follow a fixed list of learning rates (not the sampler), so that what each trial does is the same on
every run: trial 0 learns; trial 1's model_init raises on rank 1 only (rank 0 must not wait for it in DDP's first
collective); trial 2 (1e-5) is pruned at its first evaluation; trial 3 raises at its third step on both ranks; then
trials go on until the timeout stops the search. n_trials is far out of reach.
"""

import pytest

from tests.hpo.conftest import run_search, trials_seen

pytestmark = pytest.mark.slow
LEARNING_RATES = "5e-3,5e-3,1e-5,5e-3,2e-2,1e-5,1e-2"
FLAGS = [
    "--lrs", LEARNING_RATES,
    "--n_trials", "1000",
    "--timeout", "60",
    "--fail_init_trial", "1",
    "--fail_init_rank", "1",
    "--fail_trial", "3",
    "--startup_trials", "1",
    "--warmup_evaluations", "0",
]  # fmt: skip


@pytest.mark.parametrize("preset", [None, "zero2"], ids=["ddp", "zero2"])
def test_two_ranks_run_the_same_trials_and_stop_together(tmp_path, tiny_model_dir, preset):
    flags = [*FLAGS, *(["--zero_preset", preset] if preset else [])]
    rank0, rank1 = run_search(tmp_path, *flags, processes=2, timeout=400)
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert trials_seen(rank0) == trials_seen(rank1)  # same trials, same values, same ends, on both ranks
    states = {o["number"]: o["state"] for o in rank0["outcomes"]}
    assert [states[n] for n in range(4)] == ["complete", "failed", "pruned", "failed"]
    assert len(states) < 1000  # the timeout ended the search, not n_trials
    study = {t["number"]: t["state"] for t in rank0["study"]}
    assert [study[n] for n in range(4)] == ["COMPLETE", "FAIL", "PRUNED", "FAIL"]
    errors = {t["number"]: t["error"] for t in rank0["study"]}
    assert errors[1].startswith("rank 1: RuntimeError: model_init breaks on rank 1 only")
    assert errors[3].startswith("rank 0: RuntimeError: trial 3 breaks on purpose")
    assert all(state != "RUNNING" for state in study.values())
    # The best trial's model is in the trainer on both ranks: its evaluation gives the trial's best value again.
    for report in (rank0, rank1):
        assert report["eval_after_search"]["eval_loss"] == pytest.approx(report["best"]["objective"], rel=1e-6)
    assert rank0["best"] == rank1["best"]
