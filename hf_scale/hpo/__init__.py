"""Hyperparameter search with Optuna behind `ScaleTrainer.hyperparameter_search`: many processes, DeepSpeed, LoRA,
many nodes. One idea per module: `space` (what is searched), `sync` (the rank protocol: every message between ranks),
`objective` (what is scored), `storage` (where the study lives), `trial` (one trial on every rank, its callback and
its cleanup), `lora` (the LoRA fast path), `search` (the whole search and its pruner), `report` (trials table and
plots), `settings` (the search's and the default space's arguments).
"""

from hf_scale.hpo.settings import SearchArguments, SpaceArguments
from hf_scale.hpo.space import default_hp_space

__all__ = ["SearchArguments", "SpaceArguments", "default_hp_space"]
