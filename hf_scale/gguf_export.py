"""A LLaMA-architecture model and its tokenizer as one GGUF file, the format llama.cpp (and Ollama, LM Studio,
llama-cpp-python) runs.

The file is written with the `gguf` package's writer, tensor names and quantization, as llama.cpp lays out a LLaMA:
- the query and key projections' rows are permuted from transformers' rotary layout (two halves per head) to
  llama.cpp's (interleaved pairs); transformers' GGUF loader undoes the permutation when it reads the file back;
- 1-D tensors (the norms) stay f32 in every type, as llama.cpp's own converter keeps them; a q8_0 file keeps a 2-D
  weight whose rows do not split into 32-value blocks in f16;
- tied embeddings are written once (`token_embd`): llama.cpp and transformers use it for the output as well;
- the tokenizer: byte-level BPE as `gpt2` (tokens in the byte alphabet, merges, and the pre-tokenizer's llama.cpp
  name) or a SentencePiece-style BPE with byte fallback as `llama` (scores that rank the merges, which llama.cpp
  merges by, and the merges themselves, which transformers reads); BOS/EOS/UNK/pad ids, whether the tokenizer adds
  BOS and EOS, and the chat template the run trained with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_scale.errors import ConfigError
from hf_scale.gguf_source import check_gguf_installed

# --gguf_type -> (the ggml type of 2-D weights, llama.cpp's file type name)
GGUF_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
GGUF_MODEL_TYPES = ("llama", "mistral")
# A byte-level BPE's pre-tokenizer (tokenizer.json) -> the name llama.cpp splits text by for it.
BYTE_LEVEL_SPLITS = {
    "ByteLevel": "gpt-2",  # GPT-2's regex, as transformers writes a byte-level BPE read from GGUF
    "Digits+ByteLevel": "smollm",  # each digit alone, then GPT-2's regex: SmolLM's and hf_scale's tiny tokenizer
}
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def check_gguf_model(config: PretrainedConfig, source: str | Path) -> None:
    """One `ConfigError` line for a model the GGUF writer cannot write as llama.cpp's LLaMA, before any work."""
    model_type = getattr(config, "model_type", None)
    if model_type not in GGUF_MODEL_TYPES:
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise ConfigError(
            f"--format gguf writes the LLaMA architecture (LLaMA-2, SmolLM2, Mistral-shaped); {source} is a "
            f"{model_type} model ({architectures}): export it with --format hf and convert it with llama.cpp's "
            "convert_hf_to_gguf.py"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"--format gguf: {source} uses {rope['rope_type']} rope scaling, which hf_scale does not write"
        )
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConfigError(f"--format gguf: {source} has attention or MLP biases, which llama.cpp's LLaMA has not")
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise ConfigError(
            f"--format gguf: {source} attends through a sliding window of {window} tokens, which llama.cpp's LLaMA "
            "does not"
        )


def rotary_to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a query or key projection from transformers' rotary layout (each head's first half, then its
    second half) to llama.cpp's (the two halves' rows interleaved), for `heads` heads."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_tensors(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor in llama.cpp's layout) for every weight of a LLaMA-architecture model."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = []
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding's own tensor
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ConfigError(f"--format gguf: no llama.cpp name for the weight {name}")
        tensor = tensor.detach().to(torch.float32)
        if name.endswith("self_attn.q_proj.weight"):
            tensor = rotary_to_interleaved(tensor, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = rotary_to_interleaved(tensor, config.num_key_value_heads)
        tensors.append((gguf_name, tensor))
    return tensors


def encoded(tensor: torch.Tensor, gguf_type: str) -> tuple[np.ndarray, object]:
    """The tensor's data as written, and its ggml type (None: numpy's own dtype says it)."""
    import gguf

    data = tensor.numpy()
    if data.ndim == 1 or gguf_type == "f32":
        return data, None
    qtype = gguf.GGMLQuantizationType[GGUF_TYPES[gguf_type]]
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if gguf_type == "f16" or data.shape[-1] % block_size:  # rows that do not split into blocks stay f16
        return data.astype(np.float16), None
    return gguf.quants.quantize(data, qtype), qtype


def tokenizer_kind(tokenizer: PreTrainedTokenizerBase) -> tuple[str, dict]:
    """("gpt2" or "llama", the tokenizer.json) of a BPE fast tokenizer; a `ConfigError` for any other."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("--format gguf needs the run's fast tokenizer (tokenizer.json)")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] == "BPE" and model.get("byte_fallback"):
        return "llama", spec
    if model["type"] == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        return "gpt2", spec
    raise ConfigError(
        f"--format gguf writes byte-level BPE and SentencePiece-style BPE tokenizers; this one is a {model['type']} "
        "model without either"
    )


def byte_level_split(spec: dict) -> str:
    """llama.cpp's name for how a byte-level BPE splits text before merging (`tokenizer.ggml.pre`)."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    shape = "+".join(part.get("type", "?") for part in parts)
    split = BYTE_LEVEL_SPLITS.get(shape)
    individual_digits = all(part.get("individual_digits", True) for part in parts if part.get("type") == "Digits")
    byte_level_regex = all(part.get("use_regex", True) for part in parts if part.get("type") == "ByteLevel")
    if split is None or not individual_digits or not byte_level_regex:
        raise ConfigError(
            f"--format gguf: the tokenizer splits text by {shape or 'nothing'} before merging, which has no llama.cpp "
            f"pre-tokenizer name hf_scale knows (it knows {', '.join(BYTE_LEVEL_SPLITS)})"
        )
    return split


def write_tokenizer(writer, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """The tokenizer's vocabulary, merges, special ids, BOS/EOS flags and chat template (module docstring)."""
    import gguf

    kind, spec = tokenizer_kind(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if len(tokens) > vocab_size:
        raise ConfigError(f"--format gguf: the tokenizer has {len(tokens)} tokens, more than the model's {vocab_size}")
    added = {token.content: token.special for token in tokenizer.added_tokens_decoder.values()}
    special_ids = set(tokenizer.all_special_ids)
    types = []
    for index, token in enumerate(tokens):
        if index in special_ids or added.get(token):
            types.append(gguf.TokenType.CONTROL)
        elif token in added:
            types.append(gguf.TokenType.USER_DEFINED)
        elif kind == "llama" and BYTE_TOKEN.fullmatch(token):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    padding = vocab_size - len(tokens)  # embedding rows beyond the tokenizer, as llama.cpp's converter names them
    tokens += [f"[PAD{index}]" for index in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * padding

    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"].get("merges", [])]
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if kind == "gpt2":
        writer.add_tokenizer_pre(byte_level_split(spec))
    else:
        # llama.cpp merges a SentencePiece vocabulary by score, highest first: a merged token scores minus its
        # merge's rank, so it merges in the order tokenizer.json's merges do; every other token scores 0 (never
        # looked up as a merge result).
        rank = {merge.replace(" ", ""): position for position, merge in enumerate(merges)}
        writer.add_token_scores([-float(rank[token]) if token in rank else 0.0 for token in tokens])
        writer.add_add_space_prefix(adds_space_prefix(spec))

    probe = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id])
    for role, token_id in (
        ("bos", tokenizer.bos_token_id),
        ("eos", tokenizer.eos_token_id),
        ("unk", tokenizer.unk_token_id),
        ("pad", tokenizer.pad_token_id),
    ):
        if token_id is not None:
            getattr(writer, f"add_{role}_token_id")(token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def adds_space_prefix(spec: dict) -> bool:
    """Whether a SentencePiece-style tokenizer writes "▁" before the text (a Metaspace that prepends, or a
    Prepend normalizer)."""
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer")])
    return '"Prepend"' in text or ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text)


def write_gguf(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path, gguf_type: str, name: str
) -> None:
    """`model` (a LLaMA-architecture causal LM) and `tokenizer` as the GGUF file `path`, 2-D weights in `gguf_type`."""
    check_gguf_installed("--format gguf")
    import gguf

    config = model.config
    check_gguf_model(config, name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[gguf_type]])
    if gguf_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10_000.0))))
    write_tokenizer(writer, tokenizer, config.vocab_size)
    for tensor_name, tensor in gguf_tensors(model):
        data, raw_dtype = encoded(tensor, gguf_type)
        writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
