"""`ThroughputCallback`: real tokens/s, samples/s, achieved TFLOP/s, MFU and peak memory in the Trainer's logs.

Real tokens are the tokens the model attends to: `attention_mask.sum()` for a padded batch, every token of a
packed batch (no attention mask, `position_ids` restarting at each example), every token of a batch with
neither. Padding is never counted, so padded and packed runs of the same data report the same token counts
and their tokens/s compare directly. FLOPs follow `hf_scale.flops` (6 x matmul weights + full-square
attention per token, the attention over each example's own length; frozen weights, a LoRA's base, compute no
weight gradients: 2 x those less, and the adapters add 6 x theirs).

Wiring. A callback does not see the batches: the trainer hands each micro-batch to `count_batch` from
`training_step`. The trainer should also add the figures, through `update_logs` from `Trainer.log` before
`super().log(...)`: the Trainer copies the logs into `state.log_history` and calls the report_to integrations
(which come before user callbacks in the callback list) before this callback's `on_log` runs. Without it,
`on_log` still adds the figures to the printed logs and to the last `log_history` entry, but report_to never
sees them. ScaleTrainer keeps its callback as `self.throughput` and does both (its `training_step` and `log`).

Counting is done on the batch's device without reading anything back (a `.item()` per micro-batch would make
the CPU wait for the GPU at every step); the counts are read once per log, summed over the processes when
torch.distributed is initialised. Under DeepSpeed AutoTP the `autotp_size` ranks of a tensor-parallel group train
on the same batch (each computes a slice of every split layer), so that sum holds each batch once per rank of
the group: it is divided by the tensor-parallel size, and every batch counts once. A window is the wall time
between two training logs, so an evaluation or a checkpoint save in between counts in it, as it does in the
Trainer's own `train_runtime`.
"""

from __future__ import annotations

import resource
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from hf_scale.flops import (
    adapter_parameters,
    effective_seq_len,
    frozen_matmul_parameters,
    mfu,
    training_flops_per_token,
)
from hf_scale.hardware import GIB, gpu_from_device_name

TRAINING_LOG_KEY = "loss"  # present in the logs of training steps, absent from eval and final-summary logs
TOKENS_PER_SECOND = "real_tokens_per_second"


def batch_counts(inputs: Mapping[str, Any]) -> torch.Tensor:
    """[real tokens, examples, sum of squared example lengths] of one batch, as an int64 tensor on its device."""
    input_ids = inputs["input_ids"]
    attention_mask = inputs.get("attention_mask")
    position_ids = inputs.get("position_ids")
    if attention_mask is None and position_ids is not None:
        # Packed: position ids count 0, 1, ... from each example's start (relative to the collator's start
        # value, which the row's first token holds); an example of n tokens has sum(2p + 1) = n^2.
        positions = (position_ids - position_ids.flatten()[0]).long()
        tokens = positions.new_full((), positions.numel())
        return torch.stack([tokens, (positions == 0).sum(), (2 * positions + 1).sum()])
    if attention_mask is not None and attention_mask.dim() == 2:
        lengths = attention_mask.long().sum(dim=-1)
        return torch.stack([lengths.sum(), lengths.new_full((), lengths.numel()), (lengths * lengths).sum()])
    rows, width = input_ids.shape
    return torch.tensor([rows * width, rows, rows * width * width], dtype=torch.long, device=input_ids.device)


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA max allocated on GPU, peak resident set size (all of the process) on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def tensor_parallel_size(args: Any) -> int:
    """Processes that train on the same batch: DeepSpeed AutoTP's `autotp_size` (1 without tensor parallelism).

    `ScaleTrainingArguments.tensor_parallel_size`, or for a stock `TrainingArguments` its DeepSpeed config."""
    size = getattr(args, "tensor_parallel_size", None)
    if size is None:
        deepspeed_config = getattr(args, "hf_deepspeed_config", None)
        size = deepspeed_config.config.get("tensor_parallel", {}).get("autotp_size", 1) if deepspeed_config else 1
    return int(size)


class ThroughputCallback(TrainerCallback):
    """Adds to each training log, over the steps since the previous one:

    - `real_tokens_per_second`, `samples_per_second`: all processes together, each batch once (the
      tensor-parallel ranks that share a batch count it once);
    - `flops_per_token`: training FLOPs per real token for these batches (`hf_scale.flops`; the frozen weights and
      the LoRA adapters are read from the trained model at on_train_begin);
    - `tflops_per_device`: achieved model TFLOP/s of one device (the total over the world size: under tensor
      parallelism each device computes 1/tp of every split product of its group's batch);
    - `mfu`: tflops_per_device over the GPU's dense bf16 peak, when the GPU is in the hardware catalogue
      (absent on CPU and on unknown GPUs);
    - `peak_memory_gib`: the largest peak of any process so far (CUDA max allocated, or peak RSS on CPU);
    - `real_tokens_seen`: real tokens trained on since train() started, all processes.

    `ScaleTrainer` calls `count_batch` on each micro-batch from `training_step` (see the module docstring).
    """

    def __init__(self, model_config: Any = None, peak_flops: float | None = None) -> None:
        """`model_config`: the LLaMA-architecture config to count FLOPs with (default: the trained model's);
        `peak_flops`: one device's peak FLOP/s for MFU (default: the catalogue's figure for this GPU)."""
        self.model_config = model_config
        self.peak_flops = peak_flops
        self.totals: torch.Tensor | None = None  # running `batch_counts`, kept on the batches' device until read
        self.real_tokens_seen = 0
        self.tensor_parallel_size = 1  # from the training arguments at on_train_begin
        self.frozen_matmul_parameters = 0  # from the trained model at on_train_begin, as are the adapters
        self.adapter_parameters = 0
        self.reference_forward = False  # a preference reference's forward at every step (PreferenceTrainer sets it)
        self._window_start = time.perf_counter()
        self._warned_no_batches = False

    def count_batch(self, inputs: Mapping[str, Any]) -> None:
        """Count one training micro-batch (called by the trainer from `training_step`, before the forward)."""
        counts = batch_counts(inputs)
        self.totals = counts if self.totals is None else self.totals + counts.to(self.totals.device)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.model_config is None and model is not None:
            self.model_config = model.config
        if model is not None:
            self.frozen_matmul_parameters = frozen_matmul_parameters(model)
            self.adapter_parameters = adapter_parameters(model)
        if self.peak_flops is None and torch.cuda.is_available():
            # The catalogue holds SXM figures: an H100 PCIe (756 TFLOP/s) matches h100-80g, so its MFU reads low.
            gpu = gpu_from_device_name(torch.cuda.get_device_name())
            self.peak_flops = gpu.bf16_tflops * 1e12 if gpu else None
        self.tensor_parallel_size = tensor_parallel_size(args)
        self.totals = None
        self.real_tokens_seen = 0
        self._window_start = time.perf_counter()

    def update_logs(self, logs: dict[str, float], device: torch.device | str | None = None) -> None:
        """Add the figures since the last training log to `logs` when it is a training log; start a new window.

        Every process must call it at the same logs when torch.distributed is initialised (a collective).
        `device`: where the collective runs (`args.device`: a CUDA device under NCCL, the CPU under gloo)."""
        if TRAINING_LOG_KEY not in logs or TOKENS_PER_SECOND in logs:
            return  # not a training log, or already done (by the trainer, before on_log)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the window ends when the GPU has finished its steps
        elapsed = time.perf_counter() - self._window_start
        totals = torch.zeros(3, dtype=torch.long) if self.totals is None else self.totals
        peak = torch.tensor([peak_memory_bytes()], dtype=torch.long)
        world_size = 1
        if _distributed():
            totals, peak = totals.to(device), peak.to(device)
            torch.distributed.all_reduce(totals)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            world_size = torch.distributed.get_world_size()
            # The ranks of a tensor-parallel group all counted the same batches: keep one copy of each.
            totals = totals // self.tensor_parallel_size
        tokens, samples, squared_lengths = totals.tolist()
        self.totals = None
        self._window_start = time.perf_counter()
        if tokens == 0:
            if not self._warned_no_batches:
                warnings.warn(
                    "ThroughputCallback counted no batches: the trainer must call count_batch(inputs) from "
                    "training_step (ScaleTrainer does)",
                    stacklevel=2,
                )
                self._warned_no_batches = True
            return
        self.real_tokens_seen += tokens
        flops_per_token = training_flops_per_token(
            self.model_config,
            effective_seq_len(tokens, squared_lengths),
            frozen=self.frozen_matmul_parameters,
            adapters=self.adapter_parameters,
            reference_forward=self.reference_forward,
        )
        tokens_per_second = tokens / elapsed
        logs[TOKENS_PER_SECOND] = tokens_per_second
        logs["samples_per_second"] = samples / elapsed
        logs["flops_per_token"] = flops_per_token
        logs["tflops_per_device"] = tokens_per_second * flops_per_token / world_size / 1e12
        if self.peak_flops:
            logs["mfu"] = mfu(tokens_per_second / world_size, flops_per_token, self.peak_flops)
        logs["peak_memory_gib"] = peak.item() / GIB
        logs["real_tokens_seen"] = self.real_tokens_seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or TOKENS_PER_SECOND in logs:
            return
        before = set(logs)
        self.update_logs(logs, args.device)
        added = {key: logs[key] for key in logs.keys() - before}
        if added and state.log_history:
            # The Trainer stored a copy of these logs before calling the callbacks: complete it too.
            state.log_history[-1].update(added)
