"""`zero_preset="auto"`: the memory planner picks the fastest strategy that fits, before anything is loaded."""

from __future__ import annotations

import os
from typing import Any

from hf_scale.errors import ConfigError
from hf_scale.hardware import GPU, get_gpu, gpu_from_device_name
from hf_scale.memory import Workload, plan


def planned_preset(args: Any, world_size: int, lora_r: int = 0, quantization: str | None = None) -> str:
    """The preset for `args.plan_model` on this machine's GPUs, or a `ConfigError` with the planner's advice.

    The planner's strategies are named as the presets; "ddp" means no DeepSpeed at all. LoRA adapters (`lora_r`)
    train with plain DDP when the planner's lora row fits (a whole 16-bit base per GPU), else with the preset full
    fine-tuning would get (it shards the base too); QLoRA (`quantization`) trains with plain DDP only, so it is
    "ddp" when its qlora row fits and a `ConfigError` saying the planned figure when it does not."""
    from hf_scale.model_shapes import model_shape

    if not args.plan_model:
        raise ConfigError(
            "zero_preset=auto: set plan_model to the model to size (hub id, folder or LLaMA-2 name); "
            "the recipe sets it from model_name_or_path"
        )
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    result = plan(
        model_shape(args.plan_model),
        Workload(
            gpu=_gpu(args.plan_gpu),
            gpus_per_node=gpus_per_node,
            nodes=max(1, world_size // gpus_per_node),
            seq_len=args.plan_seq_len,
            micro_batch=args.per_device_train_batch_size,
            gradient_checkpointing=bool(args.gradient_checkpointing),
            lora_r=lora_r or 16,
            quantization=quantization or "nf4",
        ),
    )
    adapters = "qlora" if quantization else "lora" if lora_r else None
    if adapters and result.estimates[adapters].fits:
        return "ddp"
    if adapters == "qlora":
        planned = result.estimates["qlora"].total / 2**30
        raise ConfigError(
            f"zero_preset=auto: QLoRA ({quantization}, r={lora_r}) of {result.shape.name} needs {planned:.1f} GiB "
            f"per GPU, more than 90% of a {result.workload.gpu.name}, and a quantized base is not sharded: use larger "
            "GPUs, a shorter max_length or a smaller per_device_train_batch_size, or gradient_checkpointing"
        )
    if result.recommendation is None:
        raise ConfigError(
            f"zero_preset=auto: {result.shape.name} fits no strategy on {result.workload.gpus} "
            f"{result.workload.gpu.name}: " + "; ".join(result.advice)
        )
    return result.recommendation


def _gpu(name: str | None) -> GPU:
    if name:
        return get_gpu(name)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("zero_preset=auto: no CUDA device to plan for; set plan_gpu (e.g. a100-80g) or a preset")
    device_name = torch.cuda.get_device_name(0)
    gpu = gpu_from_device_name(device_name)
    if gpu is None:
        raise ConfigError(f"zero_preset=auto: {device_name!r} is not in the planner's catalogue; set plan_gpu")
    return gpu
