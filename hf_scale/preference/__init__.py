"""Preference tuning after SFT (DPO, IPO, hinge, SimPO, ORPO): arguments, pair data with exact masks, losses and the
`PreferenceTrainer`, a `ScaleTrainer` that keeps every capability of the SFT one."""

from hf_scale.preference.arguments import LOSS_TYPES, REFERENCE_MODES, ScalePreferenceArguments
from hf_scale.preference.collator import PreferenceCollator
from hf_scale.preference.data import (
    PreferencePair,
    PreferenceSummary,
    load_preference_pairs,
    preference_pair,
    tokenize_preferences,
)
from hf_scale.preference.losses import preference_losses, sequence_logps
from hf_scale.preference.trainer import PreferenceTrainer

__all__ = [
    "LOSS_TYPES",
    "REFERENCE_MODES",
    "PreferenceCollator",
    "PreferencePair",
    "PreferenceSummary",
    "PreferenceTrainer",
    "ScalePreferenceArguments",
    "load_preference_pairs",
    "preference_pair",
    "preference_losses",
    "sequence_logps",
    "tokenize_preferences",
]
