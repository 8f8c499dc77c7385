"""Every shipped config is valid and agrees with the planner; bad configs are tests/test_bad_input.py."""

import re

import pytest
from transformers import HfArgumentParser

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import SHIPPED_CONFIGS, check_config, load_yaml_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.templates import TEMPLATES
from hf_scale.modeling import ModelArguments
from hf_scale.presets import list_presets
from tests.helpers import REPO_ROOT

# the fine-tuning recipe's configs; search_*.yaml belong to the search recipe (tests/hpo/test_recipe.py), *_dpo.yaml
# to the preference recipe (below)
CONFIGS = sorted(
    p for p in SHIPPED_CONFIGS.glob("*.yaml") if not p.name.startswith("search_") and not p.stem.endswith("_dpo")
)
DPO_CONFIGS = sorted(SHIPPED_CONFIGS.glob("*_dpo.yaml"))
ACCELERATE_CONFIGS = sorted((REPO_ROOT / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(config):
    parser = HfArgumentParser((ModelArguments, DataArguments, ScaleTrainingArguments))
    values = check_config(parser, ["--config", str(config)])
    assert values["template"] in (*TEMPLATES, "chat_template")  # chat_template: the model's own
    assert values["zero_preset"] is None or values["zero_preset"] in list_presets()
    if config.name.startswith("smollm2_"):  # the real model on a CPU: the packaged GGUF, the shared set
        assert values["model_name_or_path"] == "packaged:SmolLM2-135M-Instruct"
        assert values["dataset"] == "../shared/data/alpaca_zh_demo.json" and values["template"] == "chat_template"
    elif not config.name.startswith("tiny_"):  # the embedded CPU defaults name no model or dataset
        assert values["model_name_or_path"].startswith("meta-llama/Llama-2-")
        assert values["dataset"] == "silk-road/alpaca-data-gpt4-chinese"
        assert values["bf16"] is True and values["lr_scheduler_type"] == "cosine" and values["warmup_steps"] > 0
        assert "# Planner: hf-scale plan" in config.read_text()


@pytest.mark.parametrize("config", sorted(SHIPPED_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_what_each_config_reports_to_is_installed(config):
    """`pip install hf-scale` brings every integration a shipped config names (tensorboard was missing)."""
    from transformers.integrations import get_available_reporting_integrations

    report_to = load_yaml_config(config).get("report_to", "none")
    named = {report_to} if isinstance(report_to, str) else set(report_to)
    assert named - {"none"} <= set(get_available_reporting_integrations())


@pytest.mark.parametrize("config", DPO_CONFIGS, ids=lambda p: p.name)
def test_shipped_preference_configs_are_valid(config):
    from hf_scale.preference import ScalePreferenceArguments
    from hf_scale.preference.arguments import PreferenceDataArguments

    parser = HfArgumentParser((ModelArguments, PreferenceDataArguments, ScalePreferenceArguments))
    values = check_config(parser, ["--config", str(config)])
    assert values["loss_type"] == "sigmoid" and values["reference"] == "auto" and values["template"] == "alpaca"
    if config.name.startswith("llama2_"):
        assert values["bf16"] is True and values["learning_rate"] <= 5e-6 and values["dataset"].endswith(".jsonl")


LLAMA2_CONFIGS = [path for path in CONFIGS + DPO_CONFIGS if path.name.startswith("llama2_")]


@pytest.mark.parametrize("config", LLAMA2_CONFIGS, ids=lambda p: p.name)
def test_planner_agrees_with_each_config(config):
    """The header's `hf-scale plan` line sizes this config's workload, picks its strategy, and says its figures (a
    preference config's micro batch is 2 rows a pair)."""
    from hf_scale.cli import build_parser, render_plan
    from hf_scale.hardware import get_gpu
    from hf_scale.memory import Workload, plan
    from hf_scale.model_shapes import model_shape

    text = config.read_text()
    values = load_yaml_config(config)
    command = re.search(r"^# Planner: hf-scale (plan .*)$", text, re.MULTILINE).group(1)
    options = build_parser().parse_args(command.split())
    assert options.model == values["model_name_or_path"]
    assert options.seq_len == values["max_length"]
    rows_per_example = 2 if config.stem.endswith("_dpo") else 1
    assert options.micro_batch == values["per_device_train_batch_size"] * rows_per_example
    assert options.grad_ckpt == bool(values.get("gradient_checkpointing"))
    workload = Workload(
        gpu=get_gpu(options.gpu),
        gpus_per_node=options.gpus,
        nodes=options.nodes,
        seq_len=options.seq_len,
        micro_batch=options.micro_batch,
        gradient_checkpointing=options.grad_ckpt,
        lora_r=options.lora_r,
        quantization=options.quantization,
    )
    result = plan(model_shape(options.model), workload)
    if values.get("lora_r"):
        chosen = "qlora" if values.get("quantization") else "lora"
        assert options.lora_r == values["lora_r"] and result.estimates[chosen].fits
        assert options.quantization == values.get("quantization", "nf4")
    else:
        chosen = values["zero_preset"]
        if not config.stem.endswith("_dpo"):  # the DPO ZeRO-3 layout is the issue's, not the fastest fit
            assert result.recommendation == chosen, render_plan(result)
        assert result.estimates[chosen].fits
    total = result.estimates[chosen].total / 2**30
    stated = re.search(rf"^#   (?:recommends|with) {chosen}: ([0-9.]+) GiB per GPU", text, re.MULTILINE).group(1)
    assert stated == f"{total:.1f}"


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    assert loaded.distributed_type == "MULTI_GPU"
    # the file name says GPUs per node: 1node_4gpu, 2nodes_8gpu
    assert f"{loaded.num_machines}node" in config.name
    assert f"_{loaded.num_processes // loaded.num_machines}gpu" in config.name
    assert loaded.num_processes % loaded.num_machines == 0


def test_tiny_config_is_the_default():
    assert load_yaml_config("tiny_cpu").get("model_name_or_path") is None


def test_tiny_chat_config_is_the_default_in_conversations():
    """tiny_chat_cpu differs from tiny_cpu only in its data: the generated conversations in the LLaMA-2 chat format."""
    chat, single = load_yaml_config("tiny_chat_cpu"), load_yaml_config("tiny_cpu")
    assert {key for key in chat.keys() | single.keys() if chat.get(key) != single.get(key)} == {
        "data_format",
        "template",
        "output_dir",
    }
    assert (chat["data_format"], chat["template"]) == ("messages", "llama2_chat")
