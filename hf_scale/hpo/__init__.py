"""Hyperparameter search with Optuna behind `ScaleTrainer.hyperparameter_search`: many processes, DeepSpeed, LoRA,
many nodes. One idea per module: `space` (what is searched), `sync` (the rank protocol: every message between ranks),
`objective` (what is scored), `storage` (where the study lives), `trial` (one trial on every rank, its callback and
its cleanup), `lora` (the LoRA fast path), `search` (the whole search and its pruner), `report` (trials table and
plots), `settings` (the search's arguments).
"""

from hf_scale.hpo.settings import SearchArguments
from hf_scale.hpo.space import FINE_TUNING, PRE_TRAINING, SpaceSettings, default_hp_space

__all__ = ["FINE_TUNING", "PRE_TRAINING", "SearchArguments", "SpaceSettings", "default_hp_space"]
