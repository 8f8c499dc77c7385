"""ThroughputCallback: token counts equal those of the batches, TFLOP/s follow from them, figures reach the logs."""

import json

import pytest
import torch
from transformers import TrainerCallback

from hf_scale.callbacks.throughput import batch_counts
from hf_scale.data.batching import make_collator
from hf_scale.flops import training_flops_per_token
from tests.callbacks.throughput_worker import EXAMPLES, tiny_setup, train
from tests.helpers import run_command, torchrun

FIGURES = ("real_tokens_per_second", "samples_per_second", "flops_per_token", "tflops_per_device", "peak_memory_gib")


@pytest.fixture(scope="module")
def tiny():
    return tiny_setup()


def dataset_totals(dataset) -> tuple[int, int]:
    """(real tokens, sum of squared lengths) of one epoch, counted from the examples themselves."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    return sum(lengths), sum(n * n for n in lengths)


def training_logs(log_history: list[dict]) -> list[dict]:
    return [entry for entry in log_history if "loss" in entry]


def test_batch_counts_are_the_same_for_a_padded_and_a_packed_batch(tiny):
    tokenizer, dataset = tiny
    features = [dataset[i] for i in range(5)]
    lengths = [len(f["input_ids"]) for f in features]
    padded = make_collator(tokenizer, packing=False)(features)
    packed = make_collator(tokenizer, packing=True)(features)
    assert padded["input_ids"].numel() > sum(lengths)  # there is padding to leave out
    expected = [sum(lengths), 5, sum(n * n for n in lengths)]
    assert batch_counts(padded).tolist() == expected
    assert batch_counts(packed).tolist() == expected
    # positions that start at 1 (a collator's position_ids_start) count the same
    shifted = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"] + 1}
    assert batch_counts(shifted).tolist() == expected
    # neither mask nor positions: every token is real
    assert batch_counts({"input_ids": torch.zeros(3, 7, dtype=torch.long)}).tolist() == [21, 3, 147]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_one_epoch_logs_the_real_tokens_of_the_dataset(tiny, tmp_path, packing):
    tokenizer, dataset = tiny
    # one log for the whole epoch: its window holds every example once, whatever the sampler's order
    trainer = train(tokenizer, dataset, str(tmp_path), packing, logging_steps=EXAMPLES // 8)
    (log,) = training_logs(trainer.state.log_history)  # on_log completed the stored copy of the logs
    tokens, squared = dataset_totals(dataset)
    assert log["real_tokens_seen"] == tokens  # padding (padded run) and nothing else left out
    assert log["samples_per_second"] / log["real_tokens_per_second"] == pytest.approx(EXAMPLES / tokens)
    config = trainer.model.config
    assert log["flops_per_token"] == pytest.approx(training_flops_per_token(config, squared / tokens))
    assert log["tflops_per_device"] == pytest.approx(log["real_tokens_per_second"] * log["flops_per_token"] / 1e12)
    assert log["real_tokens_per_second"] > 0
    assert log["peak_memory_gib"] > 0.1  # the peak RSS of a process that holds torch
    assert "mfu" not in log  # no catalogue GPU on CPU


class Recorder(TrainerCallback):
    """Stands for a report_to integration: registered before the ThroughputCallback, as those are."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_report_to_callbacks_get_the_figures(tiny, tmp_path):
    tokenizer, dataset = tiny
    recorder = Recorder()
    trainer = train(
        tokenizer,
        dataset,
        str(tmp_path),
        packing=True,
        callbacks=[recorder],
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=2,
    )
    logs = training_logs(recorder.logs)
    assert len(logs) == EXAMPLES // 8 // 2 == 4
    assert all(set(FIGURES) <= set(log) for log in logs)
    assert training_logs(trainer.state.log_history) == [{**log, "step": 2 * (i + 1)} for i, log in enumerate(logs)]
    seen = [log["real_tokens_seen"] for log in logs]
    assert seen == sorted(seen) and seen[-1] == dataset_totals(dataset)[0]
    six_n = training_flops_per_token(trainer.model.config, 0)
    assert all(six_n < log["flops_per_token"] < six_n * 1.2 for log in logs)


def test_log_throughput_off_adds_nothing(tiny, tmp_path):
    tokenizer, dataset = tiny
    trainer = train(tokenizer, dataset, str(tmp_path), False, max_steps=2, logging_steps=1, log_throughput=False)
    assert trainer.throughput is None
    assert not any("real_tokens_per_second" in log for log in trainer.state.log_history)


@pytest.mark.slow
def test_two_processes_sum_tokens_and_divide_tflops_by_the_world_size(tiny, tmp_path):
    _, dataset = tiny
    output = tmp_path / "logs.json"
    result = run_command(
        torchrun("tests/callbacks/throughput_worker.py", str(output), "padded"),
        timeout=300,
        HF_SCALE_CACHE=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads(output.read_text())
    assert recorded["world_size"] == 2
    logs = training_logs(recorded["log_history"])
    assert len(logs) == 2  # 64 examples / (8 per device x 2 processes) = 4 steps, a log every 2
    assert logs[-1]["real_tokens_seen"] == dataset_totals(dataset)[0]  # both shards, summed
    for log in logs:
        assert log["tflops_per_device"] == pytest.approx(
            log["real_tokens_per_second"] * log["flops_per_token"] / 1e12 / 2
        )
