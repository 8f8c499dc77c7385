"""Hyperparameter search with Optuna behind `ScaleTrainer.hyperparameter_search`: many processes, DeepSpeed, LoRA,
many nodes. One idea per module: `space` (what is searched), `sync` (ranks in step), `objective` (what is scored),
`pruning`, `storage` (where the study lives), `callback` and `trial` (one trial on every rank), `release` (memory
between trials), `lora` (the LoRA fast path), `search` (the whole search), `report` (trials table and plots),
`settings` (the search's arguments).
"""

from hf_scale.hpo.settings import SearchArguments
from hf_scale.hpo.space import FINE_TUNING, PRE_TRAINING, SpaceSettings, default_hp_space

__all__ = ["FINE_TUNING", "PRE_TRAINING", "SearchArguments", "SpaceSettings", "default_hp_space"]
