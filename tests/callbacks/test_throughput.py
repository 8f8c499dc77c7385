"""ThroughputCallback: token counts equal those of the batches, TFLOP/s follow from them, figures reach the logs."""

import json
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback, TrainingArguments

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.callbacks import throughput
from hf_scale.callbacks.throughput import ThroughputCallback, batch_counts, tensor_parallel_size
from hf_scale.data.batching import make_collator
from hf_scale.flops import attention_flops_per_token, matmul_parameters, training_flops_per_token
from hf_scale.tiny.build import build_tiny_model
from tests.callbacks.throughput_worker import EXAMPLES, tiny_setup, train
from tests.helpers import assert_succeeded, run_command, torchrun

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
    assert_succeeded(result, result.stderr[-3000:])
    recorded = json.loads(output.read_text())
    assert recorded["world_size"] == 2
    logs = training_logs(recorded["log_history"])
    assert len(logs) == 2  # 64 examples / (8 per device x 2 processes) = 4 steps, a log every 2
    assert logs[-1]["real_tokens_seen"] == dataset_totals(dataset)[0]  # both shards, summed
    for log in logs:
        assert log["tflops_per_device"] == pytest.approx(
            log["real_tokens_per_second"] * log["flops_per_token"] / 1e12 / 2
        )


def test_tensor_parallel_size_comes_from_the_deepspeed_config(tmp_path):
    assert tensor_parallel_size(ScaleTrainingArguments(output_dir=str(tmp_path))) == 1
    assert tensor_parallel_size(TrainingArguments(output_dir=str(tmp_path))) == 1
    # a stock TrainingArguments with DeepSpeed keeps the parsed config in hf_deepspeed_config
    stock = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config={"tensor_parallel": {"autotp_size": 4}}))
    assert tensor_parallel_size(stock) == 4


def test_tensor_parallel_ranks_that_share_a_batch_count_it_once(tiny, monkeypatch):
    # Two processes of one AutoTP group, faked: each counted the same batch, so the all-reduce sums it twice.
    tokenizer, dataset = tiny
    batch = make_collator(tokenizer, packing=False)([dataset[i] for i in range(8)])
    tokens = int(batch["attention_mask"].sum())

    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM):
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(2)  # two ranks, the same counts

    monkeypatch.setattr(throughput, "_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    callback = ThroughputCallback(model_config=build_tiny_model(tokenizer).config)
    callback.on_train_begin(SimpleNamespace(tensor_parallel_size=2), None, None)
    callback.count_batch(batch)
    logs = {"loss": 1.0}
    callback.update_logs(logs, "cpu")
    assert logs["real_tokens_seen"] == tokens
    assert logs["samples_per_second"] / logs["real_tokens_per_second"] == pytest.approx(8 / tokens)
    assert logs["tflops_per_device"] == pytest.approx(
        logs["real_tokens_per_second"] * logs["flops_per_token"] / 1e12 / 2
    )


def test_lora_reports_the_flops_of_a_frozen_base(tiny, tmp_path):
    tokenizer, dataset = tiny
    model = get_peft_model(build_tiny_model(tokenizer), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainer = train(tokenizer, dataset, str(tmp_path), False, model=model, logging_steps=EXAMPLES // 8)
    (log,) = training_logs(trainer.state.log_history)
    tokens, squared = dataset_totals(dataset)
    config, seq_len = model.config, squared / tokens
    adapters = 3 * 2 * (8 * 64 + 64 * 8)  # rank 8 A and B on q and v of the 3 layers
    # forward and input gradients through every weight, weight gradients only for the adapters
    expected = 4 * matmul_parameters(config) + 6 * adapters + attention_flops_per_token(config, seq_len)
    assert log["flops_per_token"] == pytest.approx(expected)
    assert log["flops_per_token"] < 0.8 * training_flops_per_token(config, seq_len)  # the full fine-tuning figure
    assert log["tflops_per_device"] == pytest.approx(log["real_tokens_per_second"] * expected / 1e12)


@pytest.mark.slow
def test_autotp_counts_each_batch_once_not_once_per_tensor_parallel_rank(tiny, tmp_path):
    # AutoTP over both processes: one data-parallel group whose two ranks train on the SAME batches, each
    # computing half of every split layer. The tokens trained on are those of that one group's batches.
    _, dataset = tiny
    output = tmp_path / "logs.json"
    result = run_command(
        torchrun("tests/callbacks/throughput_worker.py", str(output), "padded", "autotp"),
        timeout=400,
        HF_SCALE_CACHE=str(tmp_path),
    )
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    recorded = json.loads(output.read_text())
    assert recorded["world_size"] == 2
    logs = training_logs(recorded["log_history"])
    # 64 examples / (8 per step x 1 data-parallel group) = 8 steps, a log every 2: each rank saw the whole epoch
    assert len(logs) == 4
    seen = [log["real_tokens_seen"] for log in logs]
    assert seen == sorted(seen) and seen[-1] == dataset_totals(dataset)[0]  # once, not x2 for the two TP ranks
    for log in logs:
        # every device does 1/world of the model FLOPs of the batches counted once
        assert log["tflops_per_device"] == pytest.approx(
            log["real_tokens_per_second"] * log["flops_per_token"] / 1e12 / 2
        )
