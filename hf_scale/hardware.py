"""The GPUs the planner knows: memory, dense bf16 throughput, memory bandwidth and the links between them."""

from __future__ import annotations

from dataclasses import dataclass

from hf_scale.errors import ConfigError

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator model, as its vendor's datasheet gives it."""

    name: str
    memory_bytes: int
    bf16_tflops: float  # dense, with the FP32 accumulation training uses
    memory_bandwidth_gbs: float
    intra_node_gbs: float  # one direction, per GPU, to the other GPUs of its node
    intra_node_link: str


CATALOGUE: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("a100-40g", 40 * GIB, 312.0, 1555.0, 300.0, "NVLink 3"),
        GPU("a100-80g", 80 * GIB, 312.0, 2039.0, 300.0, "NVLink 3"),
        # GeForce cards run bf16 tensor cores at half rate with FP32 accumulation (165 TFLOP/s with FP16
        # accumulation), and have no NVLink nor peer-to-peer: their GPUs talk over PCIe 4.0 x16.
        GPU("rtx4090-24g", 24 * GIB, 82.6, 1008.0, 25.0, "PCIe 4.0"),
        GPU("l40s-48g", 48 * GIB, 362.0, 864.0, 25.0, "PCIe 4.0"),
        GPU("h100-80g", 80 * GIB, 989.0, 3350.0, 450.0, "NVLink 4"),
        GPU("h200-141g", 141 * GB, 989.0, 4800.0, 450.0, "NVLink 4"),
    )
}

# Between nodes, per node: InfiniBand HDR 200 Gb/s per GPU on A100/H100 systems, 100 GbE otherwise.
INTER_NODE_GBS = {"infiniband": 25.0, "ethernet-100g": 12.5}


def get_gpu(name: str) -> GPU:
    """The catalogue entry for `name`; an unknown name is a `ConfigError` that lists the catalogue."""
    if name not in CATALOGUE:
        raise ConfigError(f"gpu: unknown GPU {name!r}; known GPUs: {', '.join(CATALOGUE)}")
    return CATALOGUE[name]


# Words in `torch.cuda.get_device_name()` that identify each catalogue entry ("NVIDIA A100-SXM4-80GB",
# "NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA L40S").
_DEVICE_NAME_WORDS = {
    "a100-80g": ("A100", "80GB"),
    "a100-40g": ("A100",),
    "rtx4090-24g": ("4090",),
    "l40s-48g": ("L40S",),
    "h100-80g": ("H100",),
    "h200-141g": ("H200",),
}


def gpu_from_device_name(device_name: str) -> GPU | None:
    """The catalogue entry for a CUDA device name, or None when the catalogue does not know the card."""
    for name, words in _DEVICE_NAME_WORDS.items():
        if all(word in device_name for word in words):
            return CATALOGUE[name]
    return None
