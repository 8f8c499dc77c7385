"""Checkpoints are whole or ignored: 20 SIGKILLs during saves never leave one that resume picks and fails on."""

import json
import sys

import pytest

from hf_scale.checkpoints import (
    COMPLETE_MARKER,
    checkpoints,
    last_complete_checkpoint,
    mark_complete,
    remove_incomplete_checkpoints,
)
from tests.checkpoint_fault_driver import MAX_STEPS
from tests.helpers import assert_same_weights, assert_succeeded, run_command

KILLS = 20


def test_only_marked_checkpoints_count(tmp_path):
    for step in (3, 6, 9, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
    mark_complete(tmp_path / "checkpoint-3")
    mark_complete(tmp_path / "checkpoint-9")
    (tmp_path / "checkpoint-10-extra").mkdir()  # not a checkpoint name
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-9"
    removed = remove_incomplete_checkpoints(tmp_path)
    assert removed == [tmp_path / "checkpoint-12"]  # newer than the last complete one: an interrupted save
    assert (tmp_path / "checkpoint-6").is_dir()  # older ones are left to the rotation
    assert (tmp_path / "checkpoint-9" / COMPLETE_MARKER).read_text() == "complete\n"
    assert last_complete_checkpoint(tmp_path / "missing") is None


@pytest.mark.slow
def test_kills_during_checkpoint_saves_never_break_resume(tmp_path, tiny_model_dir):
    result = run_command([sys.executable, "tests/checkpoint_fault_driver.py", str(tmp_path), str(KILLS), "1"], 900)
    assert_succeeded(result, result.stderr[-3000:])
    report = json.loads((tmp_path / "report.json").read_text())
    events = report["events"]
    assert len(events) == KILLS and all(event["checkpoint"] for event in events), events  # each kill hit a save
    torn = sum(not event["complete_when_killed"] for event in events)
    assert torn >= 5, f"only {torn} of {KILLS} kills landed inside a save: the test would prove little"
    assert "child failed" not in result.stderr  # no run failed to resume from what the kills left
    assert report["resumed_exit"] == 0 and report["unbroken_exit"] == 0
    assert_same_weights(tmp_path / "unbroken.safetensors", tmp_path / "resumed.safetensors")


@pytest.mark.slow
def test_a_requeue_loop_of_random_kills_ends_at_the_unbroken_step_and_weights(tmp_path, tiny_model_dir):
    """The same command with resume=auto, SIGKILLed at random moments and relaunched until it exits by itself, ends
    where the unbroken run ends; launched once more, the finished run trains nothing (the stock resume trained one
    step past max_steps on every relaunch and saved it)."""
    result = run_command(
        [sys.executable, "tests/checkpoint_fault_driver.py", str(tmp_path), "30", "2", "anytime"], timeout=900
    )
    assert_succeeded(result, result.stderr[-3000:])
    report = json.loads((tmp_path / "report.json").read_text())
    events = report["events"]
    assert "exit" in events[-1] and events[-1]["exit"] == 0, events  # relaunched until done
    killed = [event for event in events if "killed_at" in event]
    assert len(killed) >= 3, events
    assert killed[0]["killed_at"] is None, events  # the first one before any checkpoint
    assert "child failed" not in result.stderr
    assert report["relaunch_exit"] == 0 and report["unbroken_exit"] == 0
    for end in ("resumed", "relaunched"):
        assert json.loads((tmp_path / f"{end}.json").read_text())["global_step"] == MAX_STEPS
        assert_same_weights(tmp_path / "unbroken.safetensors", tmp_path / f"{end}.safetensors")
    assert [path.name for path in checkpoints(tmp_path / "killed")][-1] == f"checkpoint-{MAX_STEPS}"
