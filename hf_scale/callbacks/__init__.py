"""Trainer callbacks of hf_scale, and the checks ScaleTrainer runs at each step."""

from hf_scale.callbacks.divergence import DivergenceGuard, TrainingDiverged
from hf_scale.callbacks.throughput import ThroughputCallback

__all__ = ["DivergenceGuard", "ThroughputCallback", "TrainingDiverged"]
