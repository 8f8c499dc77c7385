"""Launch lines as users type them, run here on 2 CPU processes with only what a CPU cannot hold shrunk.

Shrunk: the model (the embedded tiny LLaMA), the data (200 records of a shared Alpaca set: alpaca_sample in
tests/conftest.py), the step counts, the batch and process counts and the number of held-out records answered
greedily. Everything else stays as the config says:
precision, preset, LoRA, gradient checkpointing, schedule, learning rate, report_to, max_new_tokens.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hf_scale.config import config_file, load_yaml_config
from tests.helpers import free_port, python_bin, start

STEPS = ["--max_steps", "4", "--eval_steps", "2", "--save_steps", "2", "--logging_steps", "1"]


def header_launch_line(config: Path) -> str:
    """The launch command a config's header comment shows (continuation lines joined)."""
    header = [line[1:].strip() for line in config.read_text().splitlines() if line.startswith("#")]
    text = " ".join(header).replace("\\ ", " ")
    found = re.search(r"((?:accelerate launch|torchrun|deepspeed) .*?--config \S+)", text)
    assert found, f"{config.name}: no launch line in its header"
    return " ".join(found.group(1).split())


def config_of(command: str) -> Path:
    """The config file a launch line names, by path or by shipped name."""
    return config_file(command.split("--config ")[1].split()[0])


def cpu_version(command: str, port: int) -> list[list[str]]:
    """The launch line on 2 CPU processes (one per node for the two-node line): one command per node."""
    words = command.split()
    if words[0] == "torchrun":
        words[words.index("--nproc_per_node") + 1] = "2"
        words[1:1] = ["--master_port", str(port)]
    elif words[0] == "deepspeed":
        words[words.index("--num_gpus") + 1] = "2"
        words[1:1] = ["--master_port", str(port)]
    else:
        words[2:2] = ["--num_processes", "2", "--main_process_port", str(port)]
        if "--machine_rank" in words:
            words[2:2] = ["--main_process_ip", "127.0.0.1"]
            second = list(words)
            second[second.index("--machine_rank") + 1] = "1"
            return [[python_bin(words[0]), *words[1:]], [python_bin(second[0]), *second[1:]]]
    return [[python_bin(words[0]), *words[1:]]]


def shrinking_flags(command: str, tiny_model_dir: Path, data_file: Path, output_dir: Path) -> list[str]:
    """The flags that replace what a CPU cannot hold; nothing else of the config is touched."""
    flags = ["--model_name_or_path", str(tiny_model_dir), "--dataset", str(data_file), "--output_dir", str(output_dir)]
    if "search_llama2.py" in command:
        flags += ["--n_trials", "2", "--max_steps", "4", "--eval_steps", "2", "--logging_steps", "2"]
        return flags + ["--per_device_batches", "2", "--effective_batch_min", "8", "--effective_batch_max", "16"]
    # the config's micro batch, on 2 processes with 2 accumulation steps (the file's global batch is for 4-16 GPUs)
    global_batch = load_yaml_config(config_of(command))["per_device_train_batch_size"] * 2 * 2
    return [*flags, *STEPS, "--global_batch_size", str(global_batch), "--exact_match_samples", "4"]


@dataclass
class Launched:
    returncodes: list[int]
    stdout: str  # the first node's
    stderr: str  # every node's, joined


def launch_on_cpu(command: str, flags: list[str], timeout: float = 600) -> Launched:
    """Run the launch line's 2-CPU-process version with `flags` appended; a hard timeout (a hang fails)."""
    nodes = [
        start([*node, *flags], extra_env={"LOCAL_SIZE": "2"}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for node in cpu_version(command, free_port())
    ]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return Launched([node.returncode for node in nodes], outputs[0][0], "\n".join(err[-4000:] for _, err in outputs))


def check_fine_tuning_run(command: str, launched: Launched, output_dir: Path, tiny_model_dir: Path) -> None:
    """A fine-tuning launch as shipped: it ran on 2 processes with the config's batch and preset, its held-out loss
    fell, its checkpoints are whole, and its output folder loads (adapters only for LoRA)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_scale.checkpoints import checkpoints, is_complete

    assert launched.returncodes == [0] * len(launched.returncodes), launched.stderr
    config = load_yaml_config(config_of(command))
    metrics = json.loads((output_dir / "metrics.json").read_text())
    batch = config["per_device_train_batch_size"]
    assert metrics["world_size"] == 2 and metrics["effective_batch_size"] == batch * 4
    assert f"effective batch {batch * 4} = {batch} per device x 2 data-parallel process(es) x 2 accumulation" in (
        launched.stdout
    )
    assert metrics["eval_after_loss"] < metrics["eval_before_loss"], metrics
    saved = checkpoints(output_dir)
    assert [folder.name for folder in saved] == ["checkpoint-2", "checkpoint-4"] and all(map(is_complete, saved))
    if config.get("zero_preset"):
        assert (saved[-1] / "global_step4").is_dir()  # DeepSpeed's own checkpoint: the config's preset ran
    base = load_file(tiny_model_dir / "model.safetensors")
    if config.get("lora_r"):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(output_dir)
        assert model.peft_config["default"].r == config["lora_r"]
        assert not (output_dir / "model.safetensors").exists()  # the adapters only
        assert any("lora_B" in key and tensor.abs().sum() > 0 for key, tensor in model.state_dict().items())
    else:
        weights = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()  # a whole model, also from ZeRO-3
        assert base.keys() <= weights.keys()
        assert any(not torch.equal(tensor.to(weights[key].dtype), weights[key]) for key, tensor in base.items())
    if config.get("report_to") == "tensorboard":
        (run,) = (output_dir / "runs").iterdir()  # the training curve, beside the model
        assert list(run.glob("events.out.tfevents.*"))
