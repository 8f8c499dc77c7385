"""`ModelArguments` and loading: a hub id, a local folder, or (when empty) the embedded tiny default.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

import json
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_scale.data.loading import looks_like_local_path
from hf_scale.errors import ConfigError

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # unpickling can run code planted in them
WEIGHT_FILES = (*SAFETENSORS_FILES, *PICKLE_FILES)


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
    allow_pickle_weights: bool = field(
        default=False,
        metadata={
            "help": "Load a model that has only pickle weights (pytorch_model.bin). Off: only safetensors are "
            "loaded, since unpickling a file can run code planted in it; convert such a model to safetensors, or "
            "set this for a source you trust (torch still loads it with weights_only=True)."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Run the Python code that a model folder or hub repo ships (auto_map in its config). Off: "
            "hf_scale never runs code that comes with a model; LLaMA-2 models need none."
        },
    )

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype: expected auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r must be 0 (full fine-tuning) or a positive rank, got {self.lora_r}")
        if self.model_name_or_path:  # checked while the arguments are parsed: before any work
            check_model_is_safe(self.model_name_or_path, self.allow_pickle_weights, self.trust_remote_code)


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


def check_model_is_safe(name: str, allow_pickle_weights: bool = False, trust_remote_code: bool = False) -> None:
    """Loading a local model folder must run no code from it, unless asked for by name; a `ConfigError` otherwise.

    Pickle-only weights are refused without `allow_pickle_weights`, and a config or tokenizer config that maps
    to the folder's own Python code (`auto_map`) without `trust_remote_code`. A hub id is left to
    `from_pretrained`, which `load_model` tells the same (`use_safetensors`, `trust_remote_code`).
    """
    path = Path(name).expanduser()
    if not path.is_dir():
        return
    has_safetensors = any((path / weights).is_file() for weights in SAFETENSORS_FILES)
    pickles = [weights for weights in PICKLE_FILES if (path / weights).is_file()]
    if pickles and not has_safetensors and not allow_pickle_weights:
        raise ConfigError(
            f"model_name_or_path: folder {name} has only pickle weights ({', '.join(pickles)}), and loading a "
            "pickle can run code planted in it; convert them to safetensors, or set allow_pickle_weights: true "
            "if you trust where they come from"
        )
    if not trust_remote_code:
        for config_name in ("config.json", "tokenizer_config.json"):
            try:
                config = json.loads((path / config_name).read_text(encoding="utf-8"))
            except (OSError, ValueError):  # a missing or broken config is from_pretrained's to report
                continue
            if isinstance(config, dict) and "auto_map" in config:
                raise ConfigError(
                    f"model_name_or_path: {path / config_name} maps to Python code shipped in the folder (auto_map); "
                    "hf_scale runs none unless you set trust_remote_code: true"
                )


def load_tokenizer(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token: LLaMA-2 has none. `unk` is used when there is one, so pad != EOS.

    Its `padding_side` stays as saved (it is saved again with the fine-tuned model): training batches pad on the
    right (`make_collator`) and generation batches on the left (`hf_scale.evaluation`), each whatever it says.

    Example:
        tokenizer = load_tokenizer("meta-llama/Llama-2-7b-hf")
        assert tokenizer.pad_token_id != tokenizer.eos_token_id
    """
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            # Still exact: labels are built from lengths, never from the pad id, so the EOS stays trained on.
            warnings.warn("the tokenizer has no pad or unk token: padding with EOS", stacklevel=2)
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args: ModelArguments, name: str, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The causal LM, told the tokenizer's pad token, wrapped with LoRA adapters when `lora_r` > 0.

    Example:
        model = load_model(ModelArguments(lora_r=16, dtype="bfloat16"), "meta-llama/Llama-2-7b-hf", tokenizer)
    """
    check_model_is_safe(name, args.allow_pickle_weights, args.trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=args.dtype,  # from_pretrained reads "bfloat16" as torch.bfloat16 itself
            attn_implementation=args.attn_implementation,
            use_safetensors=None if args.allow_pickle_weights else True,  # None: safetensors first, then pickle
            trust_remote_code=args.trust_remote_code,
        )
    except pickle.UnpicklingError as error:  # torch.load(weights_only=True) met more than tensors
        found = re.search(r"Unsupported global: [^.]*", str(error))  # torch's advice around it is to unpickle anyway
        raise ConfigError(
            f"model_name_or_path: the pickle weights in {name} hold more than tensors and were not loaded"
            f"{f' ({found.group(0)})' if found else ''}"
        ) from None
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
