"""`hf-scale export RUN_DIR OUT`: a run as a plain HF folder that loads without hf_scale.

OUT holds config.json, safetensors weights, generation_config.json, the tokenizer with the run's chat template and
a README.md model card (training configuration and metrics from run_config.json and metrics.json). A LoRA run is
merged into its base with `--merge-lora` (a QLoRA adapter into its base as quantized, then dequantized: as the run's
run_config.json says, or `--quantization` for a folder without one); without it the adapter is copied as is (loading
it needs peft and the base). A DeepSpeed ZeRO checkpoint saved without consolidated weights
(`stage3_gather_16bit_weights_on_model_save` off in a hand-written config) is consolidated with DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint`.

`--format gguf` writes OUT as one GGUF file for llama.cpp (and Ollama, LM Studio) instead: the same model (LoRA
always merged), its tokenizer and chat template, 2-D weights in `--gguf_type` f32, f16, bf16 or q8_0
(`hf_scale.gguf_export`); LLaMA-architecture models only, checked before any weights are loaded.

OUT is written beside itself under a temporary name and renamed at the end, so a failed export leaves no half folder
or file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_scale.data.loading import looks_like_local_path
from hf_scale.errors import ConfigError
from hf_scale.gguf_export import GGUF_TYPES, check_gguf_model, tokenizer_kind, write_gguf
from hf_scale.gguf_source import check_gguf_installed, model_folder
from hf_scale.model_card import model_card, read_json
from hf_scale.modeling import (
    PICKLE_FILES,
    QUANTIZATIONS,
    SAFETENSORS_FILES,
    ModelArguments,
    check_model_is_safe,
    quantization_config,
)

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MERGE_QUANTIZATIONS = ("none", *QUANTIZATIONS)
EXPORT_FORMATS = ("hf", "gguf")
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def run_kind(run_dir: Path) -> str:
    """What `run_dir` holds: "model" (config + safetensors), "adapter" (PEFT) or "zero" (a DeepSpeed ZeRO checkpoint
    without consolidated weights); a `ConfigError` naming the folder and what is missing otherwise."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such folder")
    if not any((run_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{run_dir}: no tokenizer (tokenizer.json or tokenizer_config.json) to export with the model")
    if (run_dir / "adapter_config.json").is_file():
        if not (run_dir / ADAPTER_WEIGHTS).is_file():
            raise ConfigError(f"{run_dir}: adapter_config.json but no {ADAPTER_WEIGHTS}")
        return "adapter"
    if (run_dir / "config.json").is_file():
        if any((run_dir / name).is_file() for name in SAFETENSORS_FILES):
            return "model"
        pickles = [name for name in PICKLE_FILES if (run_dir / name).is_file()]
        if pickles:  # unpickling can run code planted in the file: convert it knowingly, not as a side effect
            raise ConfigError(
                f"{run_dir}: only pickle weights ({', '.join(pickles)}); export reads safetensors only: load the "
                "folder yourself if you trust it and save_pretrained it (transformers writes safetensors)"
            )
        if zero_checkpoint_tag(run_dir):
            return "zero"
    raise ConfigError(
        f"{run_dir}: neither a model (config.json and model.safetensors), a PEFT adapter (adapter_config.json and "
        f"{ADAPTER_WEIGHTS}) nor a DeepSpeed ZeRO checkpoint (config.json, latest, global_stepN/); give a run's "
        "output_dir or one of its checkpoint-N folders"
    )


def zero_checkpoint_tag(run_dir: Path) -> str | None:
    """The tag (`global_stepN`) named by `latest` when its folder holds ZeRO model states, else None."""
    latest = run_dir / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    return tag if tag and any((run_dir / tag).glob("*_model_states.pt")) else None


def check_out(out: Path) -> None:
    """OUT must not exist, or be an empty folder: an export never overwrites."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is a file: give a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: hf-scale export does not overwrite, give a new folder")


def adapter_base(run_dir: Path) -> str:
    """The base model an adapter's config names; a local base must exist (checked before any loading)."""
    config = json.loads((run_dir / "adapter_config.json").read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{run_dir}/adapter_config.json names no base model (base_model_name_or_path)")
    if looks_like_local_path(base) and not Path(base).expanduser().is_dir():
        raise ConfigError(f"{run_dir}: the base model its adapter names is not there: {base}")
    return base


def load_causal_lm(name: str | Path, dtype: str) -> PreTrainedModel:
    """A model folder or hub id, safetensors only, no remote code; `ConfigError` when it cannot be loaded."""
    check_model_is_safe(str(name))
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], use_safetensors=True)
    except OSError as error:
        raise ConfigError(f"cannot load the model {name}: {error}") from error


def run_config_path(run_dir: Path) -> Path | None:
    """The run's run_config.json: beside `run_dir` (a run's output_dir) or one folder up (one of its checkpoints)."""
    for folder in (run_dir, run_dir.parent):
        if isinstance((read_json(folder / "run_config.json") or {}).get("model"), dict):
            return folder / "run_config.json"
    return None


def trained_model_arguments(run_config: Path) -> ModelArguments:
    """The model arguments a run trained with: the "model" section of its run_config.json."""
    settings = read_json(run_config)["model"]
    known = {f.name for f in dataclasses.fields(ModelArguments)}
    arguments = {key: value for key, value in settings.items() if key in known}
    if arguments.get("quantization") == "None":  # as an older run_config.json wrote None
        arguments["quantization"] = None
    return ModelArguments(**arguments)


def trained_quantization(run_dir: Path) -> ModelArguments | None:
    """The model arguments of a QLoRA run (its run_config.json says how its base was quantized), else None: a LoRA
    run, or a folder without run_config.json."""
    run_config = run_config_path(run_dir)
    trained = trained_model_arguments(run_config) if run_config else None
    return trained if trained is not None and trained.quantization else None


def merge_quantization(run_dir: Path, given: str | None) -> ModelArguments | None:
    """How the base of the adapter to merge was loaded in training: a QLoRA run's model arguments, None for LoRA.

    An adapter folder does not record it (adapter_config.json names the base, nothing more): it is read from the
    run's run_config.json (a search writes one beside its best-model), or taken from `given` (--quantization) where
    there is none, as for an adapter copied out of its run. Neither: a `ConfigError`, since a QLoRA adapter merged
    into the unquantized base gives weights it never trained with, and nothing would show it.
    """
    run_config = run_config_path(run_dir)
    if run_config is None:
        if given is None:
            raise ConfigError(
                f"{run_dir}: no run_config.json beside it or one folder up, so whether its adapter was trained on a "
                "quantized base (QLoRA) is not known: pass --quantization nf4 (or fp4, int8) as the run was trained, "
                "or --quantization none for an adapter trained on the unquantized base"
            )
        # The recipe's defaults for the rest (double quantization, bfloat16 compute); lora_r only passes the check
        # that a quantized base has adapters.
        return None if given == "none" else ModelArguments(quantization=given, lora_r=1)
    trained = trained_model_arguments(run_config)
    recorded = trained.quantization or "none"
    if given is not None and given != recorded:
        raise ConfigError(
            f"{run_config} says quantization {recorded}, the way its base was loaded in training; --quantization "
            f"{given} contradicts it: leave the flag out"
        )
    return trained if trained.quantization else None


def merge_adapter(run_dir: Path, base: str, dtype: str, quantized: ModelArguments | None) -> PreTrainedModel:
    """The base with the run's LoRA adapter merged in, in the base's dtype (or `dtype`).

    A QLoRA adapter (`quantized`: its run's model arguments) was trained on the quantized base, not on the original
    weights: the base is quantized as the run loaded it and dequantized (transformers' `dequantize`), so the merged
    weights are the ones it trained on.
    """
    from peft import PeftModel

    if quantized is None:
        base_model = load_causal_lm(base, dtype)
    else:
        check_model_is_safe(base)
        base_model = AutoModelForCausalLM.from_pretrained(
            base,
            dtype=DTYPES[dtype],
            quantization_config=quantization_config(quantized),
            device_map={"": "cpu"},
            use_safetensors=True,
        ).dequantize()  # before any forward: on CPU, bitsandbytes re-packs the weights at the first one
    return PeftModel.from_pretrained(base_model, run_dir).merge_and_unload()


def consolidate_zero_checkpoint(run_dir: Path, dtype: str) -> PreTrainedModel:
    """The model of config.json with the fp32 weights DeepSpeed gathers from the checkpoint's ZeRO shards.

    DeepSpeed reads its shards with `torch.load(weights_only=False)`: export only checkpoints you trust.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config = AutoConfig.from_pretrained(run_dir)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(run_dir))
    # "auto": the dtype the model was trained in (config.json), not the fp32 of the optimizer's master copy.
    target = (getattr(config, "dtype", None) or torch.float32) if dtype == "auto" else DTYPES[dtype]
    model = AutoModelForCausalLM.from_config(config, dtype=target)
    model.load_state_dict(state_dict)  # strict: a checkpoint of another model fails here, naming the keys
    return model


def _with_pad_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    # As in training (hf_scale.modeling.load_model): a base without a pad token (LLaMA-2) pads with the tokenizer's.
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = True  # training turns the KV cache off in the config; generation wants it
    return model


def _size(folder: Path) -> str:
    total = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    return f"{total / 2**30:.2f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"


def exported_model(kind: str, run_dir: Path, base: str | None, dtype: str, quantized: ModelArguments | None):
    """The model to write: the run's own, its adapter merged into its base, or its ZeRO shards consolidated."""
    if kind == "adapter":
        return merge_adapter(run_dir, base, dtype, quantized)
    if kind == "zero":
        return consolidate_zero_checkpoint(run_dir, dtype)
    return load_causal_lm(run_dir, dtype)


def check_gguf_out(out: Path) -> None:
    """OUT of a GGUF export: a new file named *.gguf."""
    if out.suffix != ".gguf":
        raise ConfigError(f"{out}: --format gguf writes one file; give a path ending in .gguf")
    if out.exists():
        raise ConfigError(f"{out} exists: hf-scale export does not overwrite, give a new file")


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    merge_lora: bool = False,
    dtype: str = "auto",
    quantization: str | None = None,
    format: str = "hf",
    gguf_type: str = "f16",
) -> Path:
    """Write the run in `run_dir` to `out`: a new HF folder (see the module docstring), or with `format="gguf"` one
    GGUF file whose 2-D weights are in `gguf_type` (f32, f16, bf16, q8_0; `hf_scale.gguf_export`).

    `quantization` ("none", "nf4", "fp4", "int8"): how the base of the adapter to merge was loaded in training, for
    a folder without its run's run_config.json (`merge_quantization`).
    """
    run_dir, out = model_folder(str(run_dir)), Path(out)
    if format not in EXPORT_FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(EXPORT_FORMATS)}, got {format!r}")
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf_type: expected one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantization not in (None, *MERGE_QUANTIZATIONS):
        raise ConfigError(f"--quantization: expected one of {', '.join(MERGE_QUANTIZATIONS)}, got {quantization!r}")
    kind = run_kind(run_dir)
    if format == "gguf":
        return export_gguf(run_dir, out, kind, dtype, quantization, gguf_type)
    check_out(out)
    base = adapter_base(run_dir) if kind == "adapter" else None
    copy_adapter = kind == "adapter" and not merge_lora
    if copy_adapter and dtype != "auto":
        raise ConfigError(f"--dtype {dtype} converts a model; {run_dir} holds a LoRA adapter: add --merge-lora")
    if quantization is not None and (kind != "adapter" or not merge_lora):
        raise ConfigError(
            f"--quantization says how a LoRA adapter's base was loaded, to merge it with --merge-lora; {run_dir} "
            + ("holds a LoRA adapter: add --merge-lora" if kind == "adapter" else "holds a full model")
        )
    if merge_lora and kind != "adapter":
        print(f"note: {run_dir} holds a full model, not a LoRA adapter: --merge-lora has nothing to merge")
    quantized = merge_quantization(run_dir, quantization) if kind == "adapter" and merge_lora else None

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(run_dir)
        if copy_adapter:
            for name in ("adapter_config.json", ADAPTER_WEIGHTS):
                shutil.copy2(run_dir / name, staging / name)
            saved_dtype = "adapter weights as saved"
        else:
            model = exported_model(kind, run_dir, base, dtype, quantized)
            _with_pad_token(model, tokenizer).save_pretrained(staging)
            saved_dtype = str(model.dtype).removeprefix("torch.")
        tokenizer.save_pretrained(staging)
        card = model_card(
            run_dir,
            out,
            adapter=copy_adapter,
            merged=kind == "adapter" and merge_lora,
            base=base,
            dtype=saved_dtype,
            chat_template=tokenizer.chat_template,
        )
        (staging / "README.md").write_text(card, encoding="utf-8")
        if out.is_dir():
            out.rmdir()  # empty (check_out): replaced by the finished folder
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise

    how = {
        "model": "full model",
        "zero": "full model consolidated from the DeepSpeed ZeRO checkpoint",
        "adapter": "LoRA merged into its base" if merge_lora else "LoRA adapter, not merged",
    }[kind]
    print(f"exported {run_dir} to {out}: {how}, {saved_dtype}, weights {_size(out)}")
    print("wrote " + ", ".join(sorted(path.name for path in out.iterdir())))
    if copy_adapter:
        print(
            f"note: loading it needs peft and the base model {base}; add --merge-lora for a folder that plain "
            "transformers loads"
        )
    else:
        print(f'load it with AutoModelForCausalLM.from_pretrained("{out}") and AutoTokenizer.from_pretrained("{out}")')
    return out


def export_gguf(run_dir: Path, out: Path, kind: str, dtype: str, quantization: str | None, gguf_type: str) -> Path:
    """The run's model (an adapter merged into its base) as the GGUF file `out`; the architecture and tokenizer are
    checked before any weights are loaded."""
    check_gguf_out(out)
    check_gguf_installed("--format gguf")
    if dtype != "auto":
        raise ConfigError(f"--dtype {dtype} is for --format hf; a GGUF file's weights are in --gguf_type ({gguf_type})")
    base = adapter_base(run_dir) if kind == "adapter" else None
    check_gguf_model(AutoConfig.from_pretrained(base or run_dir), run_dir)
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    tokenizer_kind(tokenizer)
    quantized = merge_quantization(run_dir, quantization) if kind == "adapter" else None
    if quantization is not None and kind != "adapter":
        raise ConfigError(f"--quantization says how a LoRA adapter's base was loaded; {run_dir} holds a full model")

    # Loaded in fp32, so the GGUF type is the only rounding (a bf16 run's weights are exact in fp32).
    model = exported_model(kind, run_dir, base, "float32", quantized)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(handle)
    staging = Path(staging)
    try:
        write_gguf(model, tokenizer, staging, gguf_type, name=out.stem)
        staging.rename(out)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    how = {
        "model": "full model",
        "zero": "full model consolidated from the DeepSpeed ZeRO checkpoint",
        "adapter": "LoRA merged into its base" + (" (dequantized from the base it trained on)" if quantized else ""),
    }[kind]
    size = out.stat().st_size
    shown = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    template = "with its chat template" if tokenizer.chat_template else "no chat template"
    print(f"exported {run_dir} to {out}: {how}, GGUF {gguf_type} (norms f32), {shown}, tokenizer {template}")
    print(f"run it with llama.cpp: llama-cli -m {out}   (Ollama: a Modelfile with the line FROM {out.resolve()})")
    return out
