"""`ScalePreferenceArguments`: `ScaleTrainingArguments` plus what preference tuning needs, with its own defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_MODES = ("auto", "model", "adapters_off", "precomputed", "none")
# Losses defined without a reference model (their formulas use the policy's length-averaged log-probs alone).
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


@dataclass
class ScalePreferenceArguments(ScaleTrainingArguments):
    """`ScaleTrainingArguments` for preference tuning (DPO and its variants) after supervised fine-tuning.

    Every field of the SFT arguments works as there (ZeRO presets, early stopping, the divergence guard, throughput);
    the defaults that differ are set here explicitly: a learning rate of 1e-6 (preference tuning moves a fine-tuned
    model a little; the SFT default of 5e-5 destroys it) and `remove_unused_columns` off (the pairs' columns are not
    the model's arguments).

    Example:
        args = ScalePreferenceArguments(output_dir="out", beta=0.1, loss_type="sigmoid", reference="auto")
        trainer = PreferenceTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
    """

    learning_rate: float = field(
        default=1e-6, metadata={"help": "AdamW's learning rate; preference tuning takes 5e-7 to 5e-6 on 7B models."}
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Must stay False: the pairs' columns (chosen_input_ids, ...) are not the model's arguments."},
    )
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "sigmoid: DPO; ipo: IPO on length-averaged log-ratios; hinge: SLiC's hinge; simpo: SimPO "
            "(reference-free, length-averaged, margin simpo_gamma); orpo: ORPO (reference-free, chosen NLL plus "
            "beta x the odds-ratio term). sigmoid, ipo and hinge follow TRL 1.16's DPOTrainer.",
            "choices": LOSS_TYPES,
        },
    )
    beta: float = field(
        default=0.1,
        metadata={
            "help": "DPO's beta (the strength of the pull towards the reference); IPO's tau; SimPO's beta (try "
            "2.0-2.5); ORPO's lambda (the weight of its odds-ratio term)."
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "sigmoid and simpo: the assumed share of flipped pairs (conservative DPO), in [0, 0.5)."},
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "simpo: the target reward margin gamma."})
    sft_weight: float = field(
        default=0.0,
        metadata={
            "help": "Adds this weight x the chosen responses' mean token NLL to every loss but orpo (which has its "
            "own); 0 adds nothing."
        },
    )
    reference: str = field(
        default="auto",
        metadata={
            "help": "Where the reference log-probs come from. model: a second, frozen model (ref_model); "
            "adapters_off: the policy with its LoRA adapters off (LoRA and QLoRA); precomputed: computed once "
            "before training from the policy as it starts (adapters off under LoRA), kept beside the pairs; "
            "none: reference-free (simpo and orpo need it). auto: none for simpo and orpo, adapters_off under LoRA, "
            "precomputed otherwise.",
            "choices": REFERENCE_MODES,
        },
    )
    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "reference=model: the reference model's hub id or folder."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type: {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.reference not in REFERENCE_MODES:
            raise ConfigError(f"reference: {self.reference!r} is not one of {', '.join(REFERENCE_MODES)}")
        if self.beta <= 0:
            raise ConfigError(f"beta: must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type in REFERENCE_FREE_LOSSES and self.reference not in ("auto", "none"):
            raise ConfigError(
                f"reference: {self.reference} with loss_type {self.loss_type}, which is reference-free: set "
                "reference none (or auto)"
            )
        if self.remove_unused_columns:
            raise ConfigError(
                "remove_unused_columns: must be False for preference pairs (their columns are not "
                "the model's arguments)"
            )


@dataclass
class PreferenceDataArguments:
    """Where the preference pairs come from and how they are written (YAML keys and flags of the same names)."""

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A .json (list) or .jsonl file of pairs: TRL's prompt/chosen/rejected (text or messages), "
            "LLaMA-Factory's ranking forms (instruction/input/chosen/rejected; conversations/chosen/rejected). "
            "Empty: generated pairs for the embedded tiny model (chosen the right answer, rejected a wrong one)."
        },
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "Held-out pairs; by default eval_ratio of dataset is held out."}
    )
    eval_ratio: float = field(default=0.05, metadata={"help": "Share of dataset held out when eval_dataset is empty."})
    template: str = field(
        default="alpaca",
        metadata={
            "help": "How a pair's prompt and answers are written, as in SFT: alpaca, alpaca_zh, llama2_chat or a JSON "
            "user template write Alpaca-form pairs exactly as SFT wrote its records; conversations, and every pair "
            "under chat_template (the tokenizer's own), go through the chat template of that name."
        },
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt for llama2_chat and chat_template."}
    )
    max_length: int = field(default=512, metadata={"help": "Longest prompt + answer in tokens."})
    truncation: str = field(
        default="keep_prompt",
        metadata={
            "help": "Over-long halves: keep_prompt (cut the end of the answer), cut_prompt_left or drop. Every cut "
            "or dropped pair is counted.",
            "choices": ("keep_prompt", "cut_prompt_left", "drop"),
        },
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Each batch's chosen and rejected sequences in one row without padding (position ids restart at "
            "each; no sequence sees another); the log-probs are summed per sequence, equal to padded rows'."
        },
    )
    exact_match_samples: int = field(
        default=0,
        metadata={"help": "Held-out prompts answered greedily at each evaluation (eval_exact_match against chosen)."},
    )
    max_new_tokens: int = field(default=32, metadata={"help": "Longest generated answer when scoring exact match."})

    def __post_init__(self):
        if not 0 < self.eval_ratio < 1:
            raise ConfigError(f"eval_ratio: must be in (0, 1), got {self.eval_ratio}")
        if self.max_length < 8:
            raise ConfigError(f"max_length: must be at least 8, got {self.max_length}")
