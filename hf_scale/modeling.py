"""`ModelArguments` and loading: a hub id, a local folder, or (when empty) the embedded tiny default.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_scale.data.loading import looks_like_local_path
from hf_scale.errors import ConfigError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class ModelArguments:
    """Model settings of the fine-tuning recipe (YAML keys and flags of the same names)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub id (e.g. meta-llama/Llama-2-7b-hf) or local folder of a causal LM. Empty: the embedded "
            "tiny LLaMA, built on first use into $HF_SCALE_CACHE (default ~/.cache/hf_scale)."
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Weights dtype when loading: auto (as saved), bfloat16, float16 or float32."},
    )
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "Attention kernel: sdpa, eager, flash_attention_2."}
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains every weight (full fine-tuning)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Module names that get LoRA adapters."},
    )

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype: expected auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r must be 0 (full fine-tuning) or a positive rank, got {self.lora_r}")


def check_model_path(name: str) -> None:
    """A local model folder must exist and hold a config and weights; a hub id is left to `from_pretrained`."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_name_or_path: folder {name} has no config.json")
        if not any((path / weights).is_file() for weights in WEIGHT_FILES):
            raise ConfigError(f"model_name_or_path: folder {name} has no weights ({', '.join(WEIGHT_FILES)})")
    elif path.exists() or looks_like_local_path(name):
        raise ConfigError(f"model_name_or_path: model folder not found: {name}")


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token: LLaMA-2 has none. `unk` is used when there is one, so pad != EOS."""
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        if tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            # Still exact: labels are built from lengths, never from the pad id, so the EOS stays trained on.
            warnings.warn("the tokenizer has no pad or unk token: padding with EOS", stacklevel=2)
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArguments, name: str, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The causal LM, told the tokenizer's pad token, wrapped with LoRA adapters when `lora_r` > 0."""
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=args.attn_implementation)
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model
