"""Every shipped GPU config, as shipped, launched as its header shows, on 2 CPU processes.

Only what a CPU machine cannot hold is shrunk (tests/recipes/launch.py): the model, the data (200 records of the
shared English or Chinese Alpaca set), step counts, batch and process counts, and the held-out records answered
greedily. Precision, presets, LoRA, gradient checkpointing, schedules, learning rates and report_to stay as the file
says; the tensorboard of report_to is installed with the package. tiny_cpu.yaml, tiny_chat_cpu.yaml and
search_tiny_cpu.yaml are the recipes' CPU defaults, run as shipped by tests/recipes/test_finetune_llama2.py and
tests/hpo/test_recipe.py. The README's other launchers for the same configs (torchrun, DeepSpeed's) run in
tests/test_readme.py.
"""

import json

import pytest

from hf_scale.config import SHIPPED_CONFIGS
from tests.helpers import SHARED_DATA
from tests.recipes.launch import check_fine_tuning_run, header_launch_line, launch_on_cpu, shrinking_flags

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent"),
]
DEFAULTS = ("tiny_cpu.yaml", "tiny_chat_cpu.yaml", "search_tiny_cpu.yaml")
REAL_MODEL_ON_CPU = ("smollm2_135m_lora_cpu.yaml",)  # run as shipped by tests/test_gguf_source.py
# config -> the shared set it trains on: both languages are covered
DATA = {
    "llama2_7b_4xa100_zero1.yaml": "alpaca_en_demo.json",
    "llama2_13b_8xa100_zero2.yaml": "alpaca_zh_demo.json",
    "llama2_70b_2x8xa100_zero3_offload.yaml": "alpaca_en_demo.json",
    "llama2_7b_4x4090_lora.yaml": "alpaca_zh_demo.json",
    "llama2_7b_4x4090_zero2_offload.yaml": "alpaca_en_demo.json",
    "llama2_7b_1x4090_qlora.yaml": "alpaca_en_demo.json",
    "llama2_13b_1x4090_qlora.yaml": "alpaca_zh_demo.json",
    "llama2_13b_4x4090_qlora.yaml": "alpaca_en_demo.json",
    "search_llama2_7b_lora.yaml": "alpaca_zh_demo.json",
}


def test_every_shipped_config_is_launched_here():
    launched_here = {path.name for path in SHIPPED_CONFIGS.glob("*.yaml") if not path.stem.endswith("_dpo")}
    assert launched_here == {*DATA, *DEFAULTS, *REAL_MODEL_ON_CPU}  # *_dpo.yaml: tests/recipes/test_dpo_llama2.py


@pytest.mark.parametrize("name", DATA)
def test_config_launched_as_shipped_trains_and_saves_what_loads(name, tmp_path, tiny_model_dir, alpaca_sample):
    command = header_launch_line(SHIPPED_CONFIGS / name)
    output_dir = tmp_path / "run"
    launched = launch_on_cpu(command, shrinking_flags(command, tiny_model_dir, alpaca_sample(DATA[name]), output_dir))
    if name.startswith("search_"):
        assert launched.returncodes == [0], launched.stderr
        best = json.loads((output_dir / "best_run.json").read_text())
        assert {"learning_rate", "lora_r", "lora_alpha"} <= best["hyperparameters"].keys()  # a LoRA search
        assert len((output_dir / "hpo-report" / "trials.csv").read_text().splitlines()) == 1 + 2
        assert (output_dir / "best-model" / "adapter_model.safetensors").is_file()
        return
    check_fine_tuning_run(command, launched, output_dir, tiny_model_dir)
