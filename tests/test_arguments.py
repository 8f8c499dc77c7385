import json

import pytest

import hf_scale.arguments
from hf_scale.arguments import ScaleTrainingArguments, accumulation_for_global_batch, prepare_run
from hf_scale.errors import ConfigError
from tests.helpers import assert_succeeded, run_command, torchrun


def launched(monkeypatch, processes: int) -> None:
    """Pretend a launcher started `processes` processes (a real WORLD_SIZE would make accelerate rendezvous)."""
    monkeypatch.setattr(hf_scale.arguments, "launched_world_size", lambda: processes)


def test_global_batch_sets_accumulation(monkeypatch, tmp_path):
    launched(monkeypatch, 4)
    args = ScaleTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, global_batch_size=64)
    assert args.gradient_accumulation_steps == 8


def test_global_batch_that_cannot_fit_the_process_count(monkeypatch, tmp_path):
    launched(monkeypatch, 3)
    with pytest.raises(ConfigError, match=r"global_batch_size=64 .* per_device_train_batch_size=2 on 3 process"):
        ScaleTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, global_batch_size=64)


@pytest.mark.parametrize("global_batch, per_device, world, expected", [(32, 32, 1, 1), (64, 2, 4, 8), (128, 1, 16, 8)])
def test_accumulation_arithmetic(global_batch, per_device, world, expected):
    assert accumulation_for_global_batch(global_batch, per_device, world) == expected
    assert per_device * world * expected == global_batch


def test_cpu_multi_process_runs_get_use_cpu(monkeypatch, tmp_path):
    launched(monkeypatch, 2)
    assert ScaleTrainingArguments(output_dir=str(tmp_path)).use_cpu is True
    assert ScaleTrainingArguments(output_dir=str(tmp_path), auto_cpu_ddp=False).use_cpu is False
    launched(monkeypatch, 1)
    assert ScaleTrainingArguments(output_dir=str(tmp_path)).use_cpu is False


def test_zero_preset_and_deepspeed_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="zero_preset and deepspeed are both set"):
        ScaleTrainingArguments(output_dir=str(tmp_path), zero_preset="zero2", deepspeed={"train_batch_size": 8})


def test_unknown_zero_preset_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown preset 'zero9'; known presets: .*zero2.*zero3"):
        ScaleTrainingArguments(output_dir=str(tmp_path), zero_preset="zero9")


def test_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="resume: output_dir .* does not exist"):
        prepare_run(ScaleTrainingArguments(output_dir=str(tmp_path / "missing"), resume=True))
    with pytest.raises(ConfigError, match="resume: no complete checkpoint-"):
        prepare_run(ScaleTrainingArguments(output_dir=str(tmp_path), resume=True))


def test_tensor_parallel_needs_a_multiple_of_its_size_in_processes(tmp_path):
    with pytest.raises(ConfigError, match="autotp_size=2 needs a multiple of 2 processes, got 1"):
        ScaleTrainingArguments(output_dir=str(tmp_path), zero_preset="autotp")


def test_report_to_an_integration_that_is_not_installed_is_named_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setattr(hf_scale.arguments, "get_available_reporting_integrations", lambda: ["tensorboard"])
    assert ScaleTrainingArguments(output_dir=str(tmp_path), report_to="tensorboard").report_to == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"report_to: 'wandb' is not installed \(pip install wandb\)"):
        ScaleTrainingArguments(output_dir=str(tmp_path), report_to=["tensorboard", "wandb"])


@pytest.mark.slow
def test_building_the_arguments_writes_nothing_and_starts_no_deepspeed_group(tmp_path):
    # Two launched processes, ZeRO-3 on CPU: building the arguments describes the run; joining DeepSpeed's
    # communication and probing output_dir wait for prepare_run (ScaleTrainer calls it).
    result = run_command(torchrun("tests/distributed/arguments_worker.py", str(tmp_path / "run")), timeout=300)
    assert_succeeded(result)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(report["rank"] for report in reports) == [0, 1]
    for report in reports:
        built = report["built"]
        assert built["writes"] == [] and built["deepspeed_comm"] is False, built
        # The torch group is transformers' own: TrainingArguments.__post_init__ evaluates `self.device` ("Device
        # Init"), which joins the launched processes, for a plain TrainingArguments just the same.
        assert built["torch_process_group"] is True
        assert built["accumulation"] == 4  # 16 = 2 per device x 2 processes x 4
        assert report["prepared_deepspeed_comm"] is True
    assert not (tmp_path / "run").exists()
