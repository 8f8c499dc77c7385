"""`DataArguments`: where the instruction data comes from and how it becomes training batches.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

from dataclasses import dataclass, field
from typing import get_args

from hf_scale.data.loading import OnBadRecord
from hf_scale.data.mixture import FIELD_KEYS, DataFormat, DataSource, Mixture, parse_sources
from hf_scale.data.multiturn import AssistantTurns
from hf_scale.data.tokenize import Truncation
from hf_scale.errors import ConfigError


@dataclass
class DataArguments:
    """Data settings of the fine-tuning recipe (YAML keys and flags of the same names)."""

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Instruction data in `data_format`: a .json/.jsonl/.csv/.parquet file or folder, or a hub dataset "
            "id such as silk-road/alpaca-data-gpt4-chinese. Empty: the embedded generated tasks."
        },
    )
    data_format: DataFormat = field(
        default="alpaca",
        metadata={
            "help": "alpaca (instruction/input/output records), sharegpt (conversations: [{from: system|human|gpt, "
            "value}]) or messages (messages: [{role: system|user|assistant, content}]). With no dataset: the "
            "embedded one-turn tasks (alpaca) or two-turn conversations (sharegpt, messages)."
        },
    )
    datasets: str | None = field(
        default=None,
        metadata={
            "help": "Several datasets in one run, instead of `dataset`: a list (in YAML; a JSON list as a flag) of "
            "{path, weight, data_format, eval_path, and any *_field key}; keys left out take this run's values."
        },
    )
    mixture: Mixture = field(
        default="interleave",
        metadata={
            "help": "How `datasets` mix: interleave (by weight, seeded, until the first source is used up), "
            "interleave_all (until every source is; the others are drawn again) or concatenate (each example "
            "once). The run prints what it took from each source."
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
    conversation_field: str | None = field(
        default=None, metadata={"help": "Field holding a record's turns (default: conversations or messages)."}
    )
    role_field: str | None = field(default=None, metadata={"help": "A turn's field naming the speaker (from, role)."})
    content_field: str | None = field(default=None, metadata={"help": "A turn's text field (value, content)."})
    assistant_turns: AssistantTurns = field(
        default="all",
        metadata={"help": "Conversations: train on every assistant turn (all) or on the last one only (last)."},
    )
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
            'user template {"with_input": ..., "without_input": ..., "response": "{output}"} (one-turn data only). '
            "It renders conversations too (the Alpaca ones extended to several turns) and is saved with the "
            "tokenizer as its chat template."
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
            "help": "Processes that tokenize (datasets.map num_proc). Empty: one a core for a set of 10,000 records "
            "or more, else one (the fast tokenizer's batch call uses every core already). The result is the same."
        },
    )
    cache_tokenized: bool = field(
        default=True,
        metadata={
            "help": "Keep each source's examples in $HF_SCALE_CACHE/tokenized (Arrow files, keyed by the data files' "
            "paths, sizes and times, the tokenizer, the template and every data setting): the first process of a "
            "node makes them, the others and every relaunch memory-map them. Off: each process tokenizes for "
            "itself into a folder removed at exit."
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
        choices = {
            "truncation": Truncation,
            "on_bad_record": OnBadRecord,
            "data_format": DataFormat,
            "mixture": Mixture,
            "assistant_turns": AssistantTurns,
        }
        for name, choice in choices.items():
            if getattr(self, name) not in get_args(choice):
                raise ConfigError(f"{name} must be one of {', '.join(get_args(choice))}, got {getattr(self, name)!r}")
        if self.datasets and (self.dataset or self.eval_dataset):
            raise ConfigError("datasets and dataset/eval_dataset are both set: give one (datasets may list one source)")
        self.sources()  # every source's mistake stops here

    def sources(self) -> list[DataSource]:
        """The run's data sources: the entries of `datasets`, else `dataset` (or the embedded tasks) alone."""
        defaults = {name: getattr(self, name) for name in ("data_format", *FIELD_KEYS)}
        if self.datasets:
            return parse_sources(self.datasets, defaults)
        return [DataSource(self.dataset, eval_path=self.eval_dataset, **defaults)]
