"""Early stopping: a run whose eval loss turns up stops `patience` evaluations after its best one, and ends with
(and saves) the best weights, on 1 process, DDP and ZeRO-2, whatever load_best_model_at_end was set to.

From step 24 on the learning rate is negated (gradient ascent), so the eval loss falls and then rises.
"""

import json

import pytest

from hf_scale.modeling import load_tokenizer
from tests.distributed.ddp_worker import eval_loss_of_folder
from tests.helpers import assert_succeeded, run_command, torchrun

PATIENCE = 2
FLAGS = [
    "--max_steps", "80", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
    "--eval_strategy", "steps", "--eval_steps", "4", "--save_strategy", "steps", "--save_steps", "4",
    "--save_total_limit", "2", "--early_stopping_patience", str(PATIENCE), "--load_best_model_at_end", "false",
    "--ascent_after", "24", "--save_final",
]  # fmt: skip
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("processes, preset", [(1, None), (2, None), (2, "zero2")], ids=["1-process", "ddp", "zero2"])
def test_stops_after_patience_and_ends_with_the_best_weights(tmp_path, tiny_model_dir, processes, preset):
    flags = [*FLAGS, *(["--zero_preset", preset] if preset else [])]
    command = torchrun("tests/distributed/ddp_worker.py", "--output_dir", str(tmp_path), *flags, processes=processes)
    result = run_command(command, timeout=400)
    assert_succeeded(result, result.stderr[-3000:])
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(processes)]
    report = reports[0]
    assert len({r["global_step"] for r in reports}) == 1  # every rank stopped at the same step
    steps, losses = zip(*report["eval_losses"][:-1], strict=True)  # the last one is the worker's final evaluate()
    best = losses.index(min(losses))
    assert steps[best] in (24, 28)  # the loss turns up where the ascent starts
    assert len(losses) - 1 - best == PATIENCE  # stopped exactly `patience` evaluations after the best
    assert report["global_step"] == steps[-1] < 80
    assert report["best_metric"] == pytest.approx(min(losses))
    # The run ends with the best weights: its final evaluation and the saved folder both give the best loss.
    assert report["final_eval_loss"] == pytest.approx(min(losses), abs=1e-5)
    saved = eval_loss_of_folder(tmp_path / "final", load_tokenizer(str(tiny_model_dir)))
    assert saved == pytest.approx(min(losses), abs=1e-5) and losses[-1] > min(losses) + 1e-3
