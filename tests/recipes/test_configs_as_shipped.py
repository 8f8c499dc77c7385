"""Every shipped GPU config, as shipped, through its recipe on 2 CPU processes.

Only what a CPU machine cannot hold is shrunk: the model (the embedded tiny LLaMA instead of LLaMA-2), the data (the
shared English or Chinese Alpaca set instead of the hub's), the step counts, the batch and process counts and the
number of held-out records answered greedily. Precision, presets, LoRA, gradient checkpointing, schedules and
report_to stay as the file says. tiny_cpu.yaml and search_tiny_cpu.yaml are the recipes' defaults, run as shipped
by tests/recipes/test_finetune_llama2.py and tests/hpo/test_recipe.py.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_scale.config import load_yaml_config
from tests.helpers import REPO_ROOT, SHARED_DATA, run_command, torchrun

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent"),
]
CONFIGS = REPO_ROOT / "recipes" / "configs"
# config -> the shared set it trains on: both languages are covered
FINE_TUNING = {
    "llama2_7b_4xa100_zero1.yaml": "alpaca_en_demo.json",
    "llama2_13b_8xa100_zero2.yaml": "alpaca_zh_demo.json",
    "llama2_70b_2x8xa100_zero3_offload.yaml": "alpaca_en_demo.json",
    "llama2_7b_4x4090_lora.yaml": "alpaca_zh_demo.json",
    "llama2_7b_4x4090_zero2_offload.yaml": "alpaca_en_demo.json",
}
STEPS = ["--max_steps", "4", "--eval_steps", "2", "--save_steps", "2", "--logging_steps", "1"]


def test_every_shipped_config_is_run_here():
    shipped = {path.name for path in CONFIGS.glob("*.yaml")}
    assert shipped == {*FINE_TUNING, "search_llama2_7b_lora.yaml", "tiny_cpu.yaml", "search_tiny_cpu.yaml"}


def shrunk_batch(config: Path) -> list[str]:
    """The config's micro batch, on 2 processes with 2 accumulation steps (the file's global batch is for 4-16 GPUs)."""
    return ["--global_batch_size", str(load_yaml_config(config)["per_device_train_batch_size"] * 2 * 2)]


@pytest.fixture(scope="module")
def fine_tuning_runs(tmp_path_factory, tiny_model_dir) -> dict:
    """Each fine-tuning config run once: name -> (output folder, process result)."""
    runs = {}
    for name, data in FINE_TUNING.items():
        output_dir = tmp_path_factory.mktemp(name.removesuffix(".yaml"))
        config = CONFIGS / name
        flags = ["--config", str(config), "--model_name_or_path", str(tiny_model_dir)]
        flags += ["--dataset", str(SHARED_DATA / data), *STEPS, *shrunk_batch(config)]
        flags += ["--exact_match_samples", "4", "--output_dir", str(output_dir)]
        runs[name] = (output_dir, run_command(torchrun("recipes/finetune_llama2.py", *flags), timeout=600))
    return runs


@pytest.mark.parametrize("name", FINE_TUNING)
def test_config_as_shipped_trains_lowers_the_loss_and_saves_a_model_that_loads(fine_tuning_runs, name, tiny_model_dir):
    output_dir, result = fine_tuning_runs[name]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"], metrics
    config = load_yaml_config(CONFIGS / name)
    base = load_file(tiny_model_dir / "model.safetensors")
    if config.get("lora_r"):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(output_dir)
        assert model.peft_config["default"].r == config["lora_r"]
        assert not (output_dir / "model.safetensors").exists()  # adapters only
        weights = model.get_base_model().state_dict()
        assert any(("lora_B" in key) and tensor.abs().sum() > 0 for key, tensor in model.state_dict().items())
    else:
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()
        changed = [key for key, tensor in base.items() if not torch.equal(tensor.to(weights[key].dtype), weights[key])]
        assert changed, "the saved model holds the base weights: training saved nothing"
    assert set(base) <= set(weights)
    if "tensorboard" in str(config.get("report_to")):
        assert list(output_dir.glob("runs/*/events.out.tfevents.*")), "report_to: tensorboard wrote no event file"


def test_search_config_as_shipped_completes_its_trials(tmp_path, tiny_model_dir):
    config = CONFIGS / "search_llama2_7b_lora.yaml"
    flags = ["--config", str(config), "--model_name_or_path", str(tiny_model_dir)]
    flags += ["--dataset", str(SHARED_DATA / "alpaca_en_demo.json"), "--output_dir", str(tmp_path)]
    flags += ["--n_trials", "2", "--max_steps", "4", "--eval_steps", "2", "--logging_steps", "2"]
    flags += ["--per_device_batches", "2", "--effective_batch_min", "4", "--effective_batch_max", "8"]
    result = run_command(torchrun("recipes/search_llama2.py", *flags), timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    best = json.loads((tmp_path / "best_run.json").read_text())
    assert {"learning_rate", "lora_r", "lora_alpha"} <= best["hyperparameters"].keys()
    assert (tmp_path / "best-model" / "adapter_model.safetensors").is_file()
