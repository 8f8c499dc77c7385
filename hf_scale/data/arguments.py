"""`DataArguments`: where the instruction data comes from and how it becomes training examples."""

from dataclasses import dataclass, field


@dataclass
class DataArguments:
    """Data settings of the fine-tuning recipe (YAML keys and flags of the same names)."""

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Alpaca-format data (`instruction`, `input`, `output`): a .json/.jsonl file or a hub dataset id "
            "such as silk-road/alpaca-data-gpt4-chinese. Empty: the embedded generated tasks."
        },
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "Held-out data in the same format; empty: split eval_ratio off `dataset`."}
    )
    eval_ratio: float = field(
        default=0.05, metadata={"help": "Share of `dataset` held out for evaluation when eval_dataset is empty."}
    )
    template: str = field(default="alpaca", metadata={"help": "Prompt template name (see hf_scale.data.templates)."})
    max_length: int = field(
        default=512,
        metadata={"help": "Longest example in tokens; longer ones keep their prompt and lose the end of the response."},
    )
    exact_match_samples: int = field(
        default=200,
        metadata={"help": "Held-out records scored by greedy exact match before and after training (0: skip)."},
    )
    max_new_tokens: int = field(default=32, metadata={"help": "Longest generated response when scoring exact match."})

    def __post_init__(self):
        from hf_scale.errors import ConfigError

        if not 0 < self.eval_ratio < 1:
            raise ConfigError(f"eval_ratio must be between 0 and 1 (exclusive), got {self.eval_ratio}")
        if self.max_length < 2:
            raise ConfigError(f"max_length must be at least 2 tokens, got {self.max_length}")
        if self.exact_match_samples < 0:
            raise ConfigError(f"exact_match_samples must be 0 or more, got {self.exact_match_samples}")
