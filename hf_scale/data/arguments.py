"""`DataArguments`: where the instruction data comes from and how it becomes training batches.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

from dataclasses import dataclass, field
from typing import get_args

from hf_scale.data.loading import FieldNames, OnBadRecord
from hf_scale.data.tokenize import Truncation
from hf_scale.errors import ConfigError


@dataclass
class DataArguments:
    """Data settings of the fine-tuning recipe (YAML keys and flags of the same names)."""

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Alpaca-format data: a .json/.jsonl/.csv/.parquet file or folder, or a hub dataset id such as "
            "silk-road/alpaca-data-gpt4-chinese. Empty: the embedded generated tasks."
        },
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "Held-out data in the same format; empty: split eval_ratio off `dataset`."}
    )
    eval_ratio: float = field(
        default=0.05, metadata={"help": "Share of `dataset` held out for evaluation when eval_dataset is empty."}
    )
    instruction_field: str = field(default="instruction", metadata={"help": "Column holding the instruction."})
    input_field: str = field(default="input", metadata={"help": "Column holding the optional input."})
    output_field: str = field(default="output", metadata={"help": "Column holding the response."})
    on_bad_record: OnBadRecord = field(
        default="error",
        metadata={
            "help": "A record with a missing, non-text or empty field: 'error' stops naming the record and field; "
            "'skip' skips it and reports the count and the first indices."
        },
    )
    template: str = field(
        default="alpaca",
        metadata={
            "help": "Prompt template: alpaca, alpaca_zh, llama2_chat, chat_template (the tokenizer's own), or a JSON "
            'user template {"with_input": ..., "without_input": ..., "response": "{output}"}.'
        },
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt for llama2_chat and chat_template."}
    )
    max_length: int = field(default=512, metadata={"help": "Longest example in tokens."})
    truncation: Truncation = field(
        default="keep_prompt",
        metadata={
            "help": "Over-long records: keep_prompt (cut the end of the response), cut_prompt_left (cut the start "
            "of the prompt) or drop. Every cut or dropped record is counted in the summary."
        },
    )
    train_on_inputs: bool = field(
        default=False, metadata={"help": "Train on the prompt tokens too (by default only the response and EOS)."}
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Padding-free packing: each batch is one row with per-example position_ids, no example "
            "attending to another. Otherwise batches are padded to their longest example."
        },
    )
    pad_to_multiple_of: int | None = field(
        default=8, metadata={"help": "Round padded batch widths up to a multiple of this (tensor-core friendly)."}
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={
            "help": "Processes that tokenize (datasets.map num_proc). One process already uses every core in the "
            "fast tokenizer's batch call; more helps on large sets with many cores. The result is the same."
        },
    )
    cache_tokenized: bool = field(
        default=True,
        metadata={
            "help": "Keep the tokenized sets in $HF_SCALE_CACHE/tokenized, keyed by data, tokenizer, template and "
            "settings, and reuse them on the next run."
        },
    )
    exact_match_samples: int = field(
        default=200,
        metadata={"help": "Held-out records scored by greedy exact match before and after training (0: skip)."},
    )
    max_new_tokens: int = field(default=32, metadata={"help": "Longest generated response when scoring exact match."})

    def __post_init__(self):
        if not 0 < self.eval_ratio < 1:
            raise ConfigError(f"eval_ratio must be between 0 and 1 (exclusive), got {self.eval_ratio}")
        if self.max_length < 2:
            raise ConfigError(f"max_length must be at least 2 tokens, got {self.max_length}")
        if self.exact_match_samples < 0:
            raise ConfigError(f"exact_match_samples must be 0 or more, got {self.exact_match_samples}")
        # The flags get these as choices; a script that builds the arguments in Python gets the same check.
        for name, allowed in (("truncation", get_args(Truncation)), ("on_bad_record", get_args(OnBadRecord))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    @property
    def fields(self) -> FieldNames:
        return FieldNames(self.instruction_field, self.input_field, self.output_field)
