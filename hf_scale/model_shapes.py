"""The shape of a model for the planner, from a hub id, a local folder, a GGUF file or a config, without any weights.

LLaMA-2 7B, 13B and 70B are known offline (their published configs); anything else is read with
`AutoConfig` (from a GGUF file's metadata, without dequantizing it) and built on the meta device, where parameters
take no memory, to count them exactly.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from hf_scale.errors import ConfigError
from hf_scale.gguf_source import check_gguf_installed, gguf_path, is_gguf_source
from hf_scale.memory import ModelShape


def _llama2(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


KNOWN_CONFIGS = {
    "meta-llama/Llama-2-7b-hf": _llama2(4096, 32, 32, 32, 11008),
    "meta-llama/Llama-2-13b-hf": _llama2(5120, 40, 40, 40, 13824),
    "meta-llama/Llama-2-70b-hf": _llama2(8192, 80, 64, 8, 28672),
}
KNOWN_CONFIGS.update({name.replace("-hf", "-chat-hf"): config for name, config in list(KNOWN_CONFIGS.items())})


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the causal LM that `config` describes, counted on the meta device (tied weights once)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


def shape_from_config(name: str, config: PretrainedConfig) -> ModelShape:
    heads = config.num_attention_heads
    return ModelShape(
        name=name,
        parameters=count_parameters(config),
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        vocab=config.vocab_size,
    )


def model_shape(model: str | PretrainedConfig) -> ModelShape:
    """The shape of a known LLaMA-2, a local model folder, a hub id (reads its config.json), a GGUF file
    (`model.gguf`, `packaged:SmolLM2-135M-Instruct`), or a config."""
    if isinstance(model, PretrainedConfig):
        return shape_from_config(getattr(model, "name_or_path", "") or model.model_type, model)
    if model in KNOWN_CONFIGS:
        return shape_from_config(model, KNOWN_CONFIGS[model])
    if is_gguf_source(model):
        path = gguf_path(model)
        check_gguf_installed()
        try:
            return shape_from_config(model, AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
        except (ValueError, KeyError) as error:
            raise ConfigError(f"model: transformers cannot read {path} as a causal LM: {error}") from None
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        known = ", ".join(name for name in KNOWN_CONFIGS if "chat" not in name)
        raise ConfigError(f"model: cannot read a config for {model!r} ({error}); known offline: {known}") from None
    return shape_from_config(model, config)
