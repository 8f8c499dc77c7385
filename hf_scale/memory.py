"""The memory planner: what each training strategy needs per GPU and per node, and which one to pick.

Accounting. Model states are what a DeepSpeed engine really holds (`accounting="deepspeed"`), read from its
tensors on a real run (tests/distributed/test_zero_memory.py): 16-bit parameters and gradients, plus fp32
master weights, fp32 gradient partitions and two fp32 Adam moments. ZeRO-2 then needs 2P + 18P/N bytes per
GPU, as DeepSpeed's own estimator says. ZeRO-3 needs 20P/N plus a gather buffer of four bytes per parameter of
the largest layer: DeepSpeed's stage-3 estimator says 18P/N, counting one gradient partition where the engine
holds two (the 16-bit one and, while the optimizer steps, its fp32 copy); we count what is allocated.
The ZeRO paper counts 2 + 2 + 12 bytes per parameter (no fp32 gradient copy); `accounting="paper"`
reproduces its figures. Plain DDP under autocast holds fp32 weights, fp32
gradients and two fp32 moments: 16P. Activations are counted per token and layer for a LLaMA block with a
fused attention kernel (no attention matrix kept), in bf16, plus the fp32 logits the loss needs; with
gradient checkpointing only each layer's input is kept, plus one layer recomputed at a time. Framework
overhead is 1 GiB (CUDA context, NCCL buffers) plus DeepSpeed's communication buckets. A strategy fits
when its total stays under 90 % of the GPU's memory.

LoRA keeps the base in 16 bits and trains fp32 adapters (weights, gradients, two Adam moments). QLoRA keeps the
projections as bitsandbytes stores them (`quantized_linear_bytes`: 4-bit codes, one constant per block of 64
weights, 8-bit with double quantization, and each tensor's code tables) and, after peft's
`prepare_model_for_kbit_training`, the rest of the base (embeddings, norms, LM head) in fp32; while a projection
computes, its weight is dequantized into a compute-dtype copy (counted as the largest one, twice: forward and
its backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from hf_scale.hardware import GIB, GPU, INTER_NODE_GBS

Accounting = Literal["deepspeed", "paper"]
# Fastest first: the planner recommends the first of these that fits (LoRA is offered separately: it trains
# a different model).
SPEED_ORDER = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")
STRATEGIES = (*SPEED_ORDER, "lora", "qlora")
ADAPTER_STRATEGIES = ("lora", "qlora")
QUANTIZATION_BLOCK = 64  # bitsandbytes' 4-bit block: one constant per 64 weights
NESTED_BLOCK = 256  # double quantization: the constants quantized in blocks of 256
HEADROOM = 0.9
CONTEXT_BYTES = 1 * GIB
ALLGATHER_BUCKET_ELEMENTS = 2e8  # the zero2 presets' allgather_bucket_size
OFFLOAD_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for host memory
PCIE_GBS = 25.0  # host <-> device, PCIe 4.0 x16 in practice


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a decoder-only transformer."""

    name: str
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def largest_layer_parameters(self) -> int:
        """The biggest single weight: the embedding or the LM head (vocab x hidden)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    @property
    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one block."""
        kv = self.hidden // self.heads * self.kv_heads
        return {
            "q_proj": (self.hidden, self.hidden),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (self.hidden, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }

    def lora_parameters(self, rank: int, targets: tuple[str, ...]) -> int:
        return self.layers * sum(rank * sum(self.projections[t]) for t in targets if t in self.projections)


@dataclass(frozen=True)
class Workload:
    """How the model is trained: the hardware and the batch."""

    gpu: GPU
    gpus_per_node: int = 1
    nodes: int = 1
    seq_len: int = 512
    micro_batch: int = 1
    gradient_checkpointing: bool = False
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    quantization: str = "nf4"  # the qlora row's base: nf4, fp4 or int8
    double_quantization: bool = True
    inter_node: str = "infiniband"

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class StrategyEstimate:
    """Bytes per GPU by kind, host bytes per node, and the time a step spends computing and communicating."""

    strategy: str
    parameters: float
    gradients: float
    optimizer_states: float
    gather_buffer: float
    activations: float
    overhead: float
    cpu_per_node: float
    fits: bool = False
    communication_bytes: float = 0.0
    communication_seconds: float = 0.0
    compute_seconds: float = 0.0

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.gather_buffer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.overhead

    @property
    def communication_bound(self) -> bool:
        return self.communication_seconds > self.compute_seconds


@dataclass
class Plan:
    shape: ModelShape
    workload: Workload
    estimates: dict[str, StrategyEstimate]
    recommendation: str | None
    advice: list[str] = field(default_factory=list)


def model_states(strategy: str, parameters: float, gpus: int, largest_layer: float, accounting: Accounting):
    """(parameters, gradients, optimizer states, gather buffer) bytes per GPU for full fine-tuning.

    Gradients are a 16-bit partition plus its fp32 copy while the optimizer steps; ZeRO-1 holds the whole
    16-bit gradient until the reduction and frees it before the fp32 partition is made, so its peak is the
    larger of the two.
    """
    p, n = parameters, gpus
    if strategy == "ddp":
        return (4 * p, 4 * p, 8 * p, 0.0) if accounting == "deepspeed" else (2 * p, 2 * p, 12 * p, 0.0)
    if accounting == "paper":
        gradients = 2 * p if strategy == "zero1" else 2 * p / n
        return (2 * p / n if strategy == "zero3" else 2 * p), gradients, 12 * p / n, 0.0
    if strategy == "zero1":
        return 2 * p, max(2 * p, 6 * p / n), 12 * p / n, 0.0
    if strategy == "zero2":
        return 2 * p, 6 * p / n, 12 * p / n, 0.0
    if strategy == "zero3":
        # The gather buffer holds the largest layer's 16-bit parameters and gradients while it computes.
        return 2 * p / n, 6 * p / n, 12 * p / n, 4 * largest_layer
    raise ValueError(f"no model-state formula for {strategy!r}")


def quantized_linear_bytes(in_features: int, out_features: int, quantization: str, double: bool = True) -> int:
    """Bytes bitsandbytes stores for one quantized weight of `out_features` x `in_features`, constants included.

    4-bit (nf4, fp4): two weights a byte; one absmax per block of 64 weights, fp32, or with double quantization
    8-bit with an fp32 absmax per 256 of those, an fp32 offset and the 256-entry fp32 code of the nested
    quantization; the 16-entry fp32 code of the 4-bit type. int8 (LLM.int8): a byte a weight and an fp32 scale a row.
    """
    weights = in_features * out_features
    if quantization == "int8":
        return weights + 4 * out_features
    if quantization not in ("nf4", "fp4"):
        raise ValueError(f"unknown quantization {quantization!r}; known: nf4, fp4, int8")
    blocks = math.ceil(weights / QUANTIZATION_BLOCK)
    constants = blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 + 4 * 256 if double else 4 * blocks
    return math.ceil(weights / 2) + constants + 4 * 16


def quantized_base_bytes(shape: ModelShape, quantization: str, double: bool = True, other_bytes: int = 4) -> float:
    """The whole base as a QLoRA run holds it: the projections quantized, everything else in fp32 (`other_bytes` a
    weight: a base loaded to answer, not prepared for training, keeps the rest in its own dtype)."""
    quantized = shape.layers * sum(
        quantized_linear_bytes(i, o, quantization, double) for i, o in shape.projections.values()
    )
    linear_weights = shape.layers * sum(i * o for i, o in shape.projections.values())
    return quantized + other_bytes * (shape.parameters - linear_weights)


def activation_bytes(shape: ModelShape, workload: Workload) -> float:
    """Activations kept for the backward pass, per GPU, for one micro-batch."""
    tokens = workload.seq_len * workload.micro_batch
    kv = shape.hidden // shape.heads * shape.kv_heads
    # bf16 tensors a LLaMA block saves (norm outputs, q/k/v, attention output, gate/up/act/down inputs),
    # plus the fp32 inputs of its two RMSNorms
    per_layer = 2 * (5 * shape.hidden + 2 * kv + 4 * shape.intermediate) + 8 * shape.hidden
    if workload.gradient_checkpointing:
        kept = shape.layers * 2 * shape.hidden + per_layer
    else:
        kept = shape.layers * per_layer
    logits = shape.vocab * (2 + 4 + 4)  # bf16 logits, their fp32 upcast for the loss, its gradient
    return tokens * (kept + logits)


def estimate(shape: ModelShape, workload: Workload, strategy: str, accounting: Accounting = "deepspeed"):
    """The estimate of one strategy."""
    p, n = float(shape.parameters), workload.gpus
    largest = float(shape.largest_layer_parameters)
    buckets, gather, cpu = 0.0, 0.0, 0.0
    if strategy in ("ddp", "zero1", "zero2", "zero3"):
        params, grads, optim, gather = model_states(strategy, p, n, largest, accounting)
        buckets = 2 * ALLGATHER_BUCKET_ELEMENTS if strategy in ("zero1", "zero2") else 0.0
    elif strategy == "zero2_offload":
        params, grads, optim = 2 * p, 0.0, 0.0
        cpu = p * max(4 * n, 16) * OFFLOAD_BUFFER_FACTOR / workload.nodes
    elif strategy == "zero3_offload":
        params, grads, optim, gather = 0.0, 0.0, 0.0, 4 * largest
        cpu = p * 18 / workload.nodes * OFFLOAD_BUFFER_FACTOR
    elif strategy in ADAPTER_STRATEGIES:
        trainable = shape.lora_parameters(workload.lora_r, workload.lora_targets)
        grads, optim = 4 * trainable, 8 * trainable
        if strategy == "lora":
            params = 2 * p + 4 * trainable
        else:
            params = quantized_base_bytes(shape, workload.quantization, workload.double_quantization) + 4 * trainable
            gather = 2 * 2 * max(i * o for i, o in shape.projections.values())  # dequantized weight, fwd and bwd
    else:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    result = StrategyEstimate(
        strategy=strategy,
        parameters=params,
        gradients=grads,
        optimizer_states=optim,
        gather_buffer=gather,
        activations=activation_bytes(shape, workload),
        overhead=CONTEXT_BYTES + buckets,
        cpu_per_node=cpu,
    )
    result.fits = result.total <= HEADROOM * workload.gpu.memory_bytes
    _add_step_times(result, shape, workload)
    return result


def _add_step_times(result: StrategyEstimate, shape: ModelShape, workload: Workload) -> None:
    """Bytes each GPU moves per optimizer step and the time they take, beside the compute time."""
    p, n = float(shape.parameters), workload.gpus
    ring = 2 * (n - 1) / n if n > 1 else 0.0  # a ring all-reduce sends this many times the buffer
    if result.strategy in ADAPTER_STRATEGIES:
        network = ring * 4 * shape.lora_parameters(workload.lora_r, workload.lora_targets)
    elif result.strategy.startswith("zero3"):
        network = 1.5 * ring * 2 * p  # two all-gathers of the parameters and one reduce-scatter of gradients
    else:
        network = ring * 2 * p  # 16-bit gradients reduced (and ZeRO-1/2's parameters gathered back)
    bandwidth = workload.gpu.intra_node_gbs if workload.nodes == 1 else INTER_NODE_GBS[workload.inter_node]
    host = 0.0
    if result.strategy == "zero2_offload":
        host = 2 * p / n + 2 * p / n  # gradients out, updated parameters in
    elif result.strategy == "zero3_offload":
        host = 4 * p + 2 * p / n  # every 16-bit parameter in for forward and again for backward, gradients out
    result.communication_bytes = network + host
    result.communication_seconds = network / (bandwidth * 1e9) + host / (PCIE_GBS * 1e9)
    tokens = workload.seq_len * workload.micro_batch
    flops_per_token = (8 if workload.gradient_checkpointing else 6) * p
    if result.strategy in ADAPTER_STRATEGIES:
        flops_per_token = (6 if workload.gradient_checkpointing else 4) * p  # no weight gradients for the base
    result.compute_seconds = flops_per_token * tokens / (workload.gpu.bf16_tflops * 1e12)


def plan(shape: ModelShape, workload: Workload, accounting: Accounting = "deepspeed") -> Plan:
    """Every strategy's estimate, the fastest that fits, and what to change when none does.

    Example:
        name = "meta-llama/Llama-2-7b-hf"
        shape = shape_from_config(name, AutoConfig.from_pretrained(name))
        result = plan(shape, Workload(gpu=CATALOGUE["a100-80g"], gpus_per_node=4, micro_batch=2))
        print(result.recommendation)  # "zero1": the fastest strategy that fits in 90 % of the card
    """
    estimates = {s: estimate(shape, workload, s, accounting) for s in STRATEGIES}
    recommendation = next((s for s in SPEED_ORDER if estimates[s].fits), None)
    advice = [] if recommendation else _advice(shape, workload, estimates, accounting)
    return Plan(shape, workload, estimates, recommendation, advice)


def _advice(shape: ModelShape, workload: Workload, estimates, accounting: Accounting) -> list[str]:
    def fits(changed: Workload, strategies: tuple[str, ...] = SPEED_ORDER) -> bool:
        return any(estimate(shape, changed, s, accounting).fits for s in strategies)

    advice = []
    for gpus in (workload.gpus * 2, workload.gpus * 4, workload.gpus * 8):
        if fits(replace(workload, gpus_per_node=gpus // workload.nodes), ("zero3",)):
            advice.append(f"ZeRO-3 fits on {gpus} GPUs of this kind")
            break
    if estimates["lora"].fits:
        advice.append(f"LoRA (r={workload.lora_r}) fits: set lora_r")
    elif estimates["qlora"].fits:
        advice.append(f"QLoRA (r={workload.lora_r}, {workload.quantization}) fits: set lora_r and quantization")
    if not workload.gradient_checkpointing and fits(replace(workload, gradient_checkpointing=True)):
        advice.append("gradient checkpointing makes a strategy fit: set gradient_checkpointing")
    if workload.seq_len > 256 and fits(replace(workload, seq_len=workload.seq_len // 2, micro_batch=1)):
        advice.append(f"sequences of {workload.seq_len // 2} tokens at micro batch 1 fit")
    return advice or ["nothing fits on this hardware: use more or larger GPUs"]
