"""`hf-scale dpo` and its shipped configs, as shipped, on 2 CPU processes (only the model, the data, the steps and the
process count shrunk): the tiny default learns to prefer the right answer; the 7B ZeRO-3 config, SIGKILLed after a
checkpoint and resumed, ends with the unbroken run's weights and reads its reference log-probs back instead of
computing them again; the 1x4090 QLoRA config trains its adapters against the adapters-off reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_scale.config import SHIPPED_CONFIGS, load_yaml_config
from hf_scale.tiny import generate_tasks
from hf_scale.tiny.tasks import generate_preference_tasks
from tests.helpers import SHARED_DATA, assert_succeeded, python_bin, run_command, torchrun
from tests.recipes.launch import STEPS, header_launch_line, launch_on_cpu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent"),
]
RECIPE = "recipes/dpo_llama2.py"
KILL_DRIVER = "tests/recipes/dpo_kill_driver.py"
DPO_CONFIGS = ("tiny_cpu_dpo.yaml", "llama2_7b_4xa100_zero3_dpo.yaml", "llama2_7b_1x4090_qlora_dpo.yaml")


def test_every_shipped_dpo_config_is_launched_here():
    assert {path.name for path in SHIPPED_CONFIGS.glob("*_dpo.yaml")} == set(DPO_CONFIGS)


def alpaca_pairs(alpaca_file: Path, folder: Path) -> Path:
    """The Alpaca records as LLaMA-Factory ranking pairs: chosen the record's own output, rejected the next one's."""
    records = json.loads(alpaca_file.read_text(encoding="utf-8"))
    path = folder / "pairs.jsonl"
    lines = [
        json.dumps({**record, "chosen": record["output"], "rejected": records[(n + 1) % len(records)]["output"]})
        for n, record in enumerate(records)
    ]
    path.write_text("\n".join(line for line in lines), encoding="utf-8")
    return path


def test_tiny_default_on_two_processes_learns_to_prefer_the_right_answer(trained_tiny_run, tmp_path):
    """tiny_cpu_dpo as shipped (LoRA, adapters-off reference, sft_weight 0.5) on 2 processes, from the SFT default."""
    output_dir = tmp_path / "dpo"
    flags = ["--model_name_or_path", str(trained_tiny_run), "--output_dir", str(output_dir)]
    result = run_command(torchrun(RECIPE, *flags), timeout=600)
    assert_succeeded(result, result.stdout[-2000:] + result.stderr[-3000:])
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["reference"] == "adapters_off"
    # the policy is its reference before the first step (the loss is ln 2 plus the SFT term here)
    assert abs(metrics["eval_before_rewards/margins"]) < 1e-6 and metrics["eval_before_rewards/accuracies"] == 0
    assert metrics["eval_after_rewards/accuracies"] >= 0.9, metrics
    # the SFT term keeps the answers: held-out exact match may not fall by more than 0.05
    assert metrics["eval_after_exact_match"] >= metrics["eval_before_exact_match"] - 0.05, metrics
    assert (output_dir / "adapter_model.safetensors").is_file()
    logged = [entry for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]]
    assert all("rewards/margins" in entry and "tflops_per_device" in entry for entry in logged if "loss" in entry)


def shrunk(config: str, model: Path, pairs: Path, output_dir: Path) -> list[str]:
    batch = load_yaml_config(config)["per_device_train_batch_size"]
    flags = ["--model_name_or_path", str(model), "--dataset", str(pairs), "--output_dir", str(output_dir), *STEPS]
    return [*flags, "--global_batch_size", str(batch * 2 * 2), "--exact_match_samples", "0"]


def test_qlora_config_as_shipped_trains_adapters_against_the_adapters_off_reference(
    trained_tiny_run, tmp_path, alpaca_sample
):
    name = "llama2_7b_1x4090_qlora_dpo.yaml"
    command = header_launch_line(SHIPPED_CONFIGS / name)
    output_dir = tmp_path / "run"
    pairs = alpaca_pairs(alpaca_sample("alpaca_en_demo.json"), tmp_path)
    launched = launch_on_cpu(command, shrunk(name, trained_tiny_run, pairs, output_dir))
    assert launched.returncodes == [0], launched.stderr
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["reference"] == "adapters_off"
    assert abs(metrics["eval_before_loss"] - math.log(2)) < 1e-5
    # 4 steps at the config's 5e-6 move the adapters (B starts at 0) but not a bf16 loss measurably: the weights
    config = json.loads((output_dir / "adapter_config.json").read_text())
    adapters = load_file(output_dir / "adapter_model.safetensors")
    assert config["r"] == 16 and any("lora_B" in key and tensor.abs().sum() > 0 for key, tensor in adapters.items())
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "rewards/accuracies" in entry] == [1, 2, 3, 4]


def test_zero3_config_killed_and_resumed_ends_with_the_unbroken_weights_and_its_reference_read_back(
    trained_tiny_run, tmp_path, alpaca_sample, monkeypatch
):
    """llama2_7b_4xa100_zero3_dpo as shipped (full weights, bf16, reference precomputed through the ZeRO-3 engine) on 2
    processes: killed by SIGKILL at step 3 (checkpoint-2 complete), relaunched with resume auto (torchrun), against a
    run launched as the header shows (accelerate) that was never interrupted; each in its own cache, so that "read
    back" means this run's own reference."""
    name = "llama2_7b_4xa100_zero3_dpo.yaml"
    pairs = alpaca_pairs(alpaca_sample("alpaca_zh_demo.json"), tmp_path)
    config = str(SHIPPED_CONFIGS / name)

    def launch(script, output_dir, cache, *extra):
        flags = ["--config", config, *shrunk(name, trained_tiny_run, pairs, output_dir), "--resume", "auto"]
        return run_command(torchrun(script, *extra, *flags), timeout=600, HF_SCALE_CACHE=str(cache))

    # the unbroken run as the header (and the README) launch it: accelerate launch -m hf_scale.cli dpo
    monkeypatch.setenv("HF_SCALE_CACHE", str(tmp_path / "cache-unbroken"))
    command = header_launch_line(SHIPPED_CONFIGS / name)
    unbroken = launch_on_cpu(command, shrunk(name, trained_tiny_run, pairs, tmp_path / "unbroken"))
    assert unbroken.returncodes == [0], unbroken.stderr
    killed = launch(KILL_DRIVER, tmp_path / "run", tmp_path / "cache", "3")
    assert killed.returncode != 0 and "(SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and not (tmp_path / "run" / "checkpoint-4").exists()
    assert "reference log-probs of 190 train pairs computed" in killed.stdout
    resumed = launch(RECIPE, tmp_path / "run", tmp_path / "cache")
    assert_succeeded(resumed, resumed.stderr[-3000:])
    assert "resuming from" in resumed.stdout and "checkpoint-2" in resumed.stdout
    assert "reference log-probs of 190 train pairs read from the cache" in resumed.stdout
    assert "computed" not in "".join(line for line in resumed.stdout.splitlines() if "reference log-probs" in line)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["reference"] == "precomputed" and metrics["world_size"] == 2
    assert abs(metrics["eval_before_loss"] - math.log(2)) < 1e-5
    expected, actual = (
        load_file(tmp_path / "unbroken" / "model.safetensors"),
        load_file(tmp_path / "run" / "model.safetensors"),
    )
    assert expected.keys() == actual.keys()
    gaps = {key: (expected[key].float() - actual[key].float()).abs().max().item() for key in expected}
    assert max(gaps.values()) == 0.0, sorted(gaps.items(), key=lambda item: -item[1])[:3]


def test_reference_free_orpo_under_lora_learns_a_preference_the_sft_model_lacks(tmp_path, hf_scale_cache):
    """The SFT default trained on the English wordings only, then ORPO (reference-free) with the shipped default's
    LoRA on pairs of the Chinese wordings: held-out reward accuracy starts near chance (<= 0.6) and ends >= 0.9.
    (The full SFT default already prefers every chosen answer, reward accuracy 1.0 before training: no room to learn.)
    Measured here: 0.514 -> 0.992."""
    train, _ = generate_tasks()
    english = tmp_path / "english.json"
    english.write_text(json.dumps([record for record in train if record["instruction"].isascii()]))
    sft = tmp_path / "sft-english"
    flags = ["--dataset", str(english), "--output_dir", str(sft), "--exact_match_samples", "0"]
    result = run_command([python_bin("python"), "recipes/finetune_llama2.py", *flags, "--save_strategy", "no"], 600)
    assert_succeeded(result, result.stderr[-3000:])

    pairs, held_out = generate_preference_tasks()
    files = {}
    for name, records in (("pairs", pairs), ("held-out", held_out)):
        files[name] = tmp_path / f"{name}.jsonl"
        chinese = [record for record in records if not record["instruction"].isascii()]
        files[name].write_text(
            "\n".join(json.dumps(record, ensure_ascii=False) for record in chinese), encoding="utf-8"
        )
    flags = [
        "--model_name_or_path",
        str(sft),
        "--dataset",
        str(files["pairs"]),
        "--eval_dataset",
        str(files["held-out"]),
    ]
    flags += ["--loss_type", "orpo", "--beta", "0.5", "--sft_weight", "0", "--per_device_train_batch_size", "32"]
    flags += ["--max_steps", "300", "--eval_strategy", "no", "--save_strategy", "no", "--exact_match_samples", "0"]
    result = run_command([python_bin("python"), RECIPE, *flags, "--output_dir", str(tmp_path / "orpo")], timeout=600)
    assert_succeeded(result, result.stderr[-3000:])
    metrics = json.loads((tmp_path / "orpo" / "metrics.json").read_text())
    assert metrics["reference"] == "none" and metrics["eval_pairs"] == 356
    assert metrics["eval_before_rewards/accuracies"] <= 0.6 and metrics["eval_after_rewards/accuracies"] >= 0.9, metrics
