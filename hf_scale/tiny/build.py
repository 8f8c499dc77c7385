"""Build the embedded tiny default: a byte-level BPE tokenizer and a tiny LLaMA, saved as a normal HF folder.

Both are built from the project's own generated text in a few seconds, deterministically, so every process
and every machine builds the same model. `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(folder)`
load the result like any hub model. `build_sentencepiece_tokenizer` builds a second kind, shaped like LLaMA-2's
SentencePiece tokenizer, for tests that need its quirks (▁ word starts, byte fallback) without the hub.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_scale.data.templates import TEMPLATES
from hf_scale.paths import cache_dir
from hf_scale.tiny.tasks import generate_tasks

# Bump when the build changes, so that a cached folder from an older build is not reused.
TINY_BUILD_VERSION = 1
TINY_MODEL_SEED = 0
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
# LLaMA-2's layout: <unk>, <s>, </s> at ids 0-2, then one token per byte at ids 3-258, then the learned pieces.
BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]
# LLaMA-2's SentencePiece setting: characters rarer than this share of the training text are left to the bytes.
CHARACTER_COVERAGE = 0.9995


def _generated_texts() -> list[str]:
    """Every generated task in every template's wording: the default training text of both tokenizers."""
    train, held_out = generate_tasks()
    return [
        template.format_prompt(record["instruction"], record["input"]) + record["output"]
        for template in TEMPLATES.values()
        for record in train + held_out
    ]


def build_tiny_tokenizer(vocab_size: int = 1024, texts: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE like LLaMA's in the ways that matter here: digits are single tokens, `<s>`/`</s>`
    are BOS/EOS, and there is no pad token (the recipe chooses one, as it must for LLaMA-2).

    Trained on the generated tasks, or on `texts` (the benchmarks train one on real Alpaca text)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_generated_texts() if texts is None else texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS, add_bos_token=False)


def build_sentencepiece_tokenizer(
    texts: Iterable[str] | None = None, vocab_size: int = 2000
) -> PreTrainedTokenizerFast:
    """A BPE tokenizer laid out like meta-llama/Llama-2-7b-hf's, as transformers 5 loads it, for tests of what
    LLaMA-2's SentencePiece tokenizer does that a byte-level one does not.

    Like LLaMA-2's: ids 0, 1, 2 are `<unk>`, `<s>`, `</s>` (UNK, BOS, EOS; no pad token); ids 3-258 are the byte
    tokens `<0x00>`-`<0xFF>`, through which characters outside the vocabulary (emoji, rare CJK, the newline) are
    encoded and decoded exactly; a word starts with "▁", one "▁" is put before the text; digits are single
    tokens; `<s>`/`</s>` written in a text are the special ids; BOS is added unless `add_special_tokens=False`.
    Trained on the generated tasks, or on `texts`; `vocab_size` counts the special and byte tokens. The same
    texts give the same vocabulary.

    Example:
        tokenizer = build_sentencepiece_tokenizer(["hello world 42", "你好，世界"] * 10, vocab_size=300)
        tokenizer.tokenize("hello 24")  # ['▁hello', '▁', '2', '4']
        tokenizer.tokenize("world 😀")  # ['▁world', '▁', '<0xF0>', '<0x9F>', '<0x98>', '<0x80>']
    """
    special = list(SPECIAL_TOKENS.values())
    budget = vocab_size - len(special) - len(BYTE_TOKENS)
    if budget < 2:
        reserved = len(special) + len(BYTE_TOKENS)
        raise ValueError(
            f"vocab_size {vocab_size} leaves no room for pieces after the {reserved} special and byte tokens"
        )
    texts = _generated_texts() if texts is None else list(texts)

    # SentencePiece keeps the commonest characters (by coverage) and leaves the rest to the byte tokens; the
    # newline is never a piece in LLaMA-2 (SentencePiece reads its corpus line by line), so it is a byte too.
    # Half the budget at most, so that a vocabulary this small still has room for merges. Ties are broken by
    # the character, not left to the trainer's own cut (`limit_alphabet`), whose order is not fixed.
    counts = Counter(char for text in texts for char in text)
    del counts["\n"]
    if not counts:
        raise ValueError("texts hold no characters to learn pieces from")
    total, covered, alphabet = sum(counts.values()), 0, []
    for char, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if covered >= CHARACTER_COVERAGE * total or len(alphabet) >= budget // 2:
            break
        alphabet.append(char)
        covered += count
    # Special tokens are cut out too: in encoding they are matched before the pieces, never merged into one.
    cuts = re.compile("|".join([*map(re.escape, special), "[^" + "".join(map(re.escape, sorted(alphabet))) + "]+"]))

    def fragments() -> Iterable[str]:
        # Cut at the characters left to the bytes so that no piece learns them; only the start of the text gets
        # the prepended "▁", as at encoding time (a word after a newline, an emoji or `<s>` starts without one).
        for text in texts:
            for index, fragment in enumerate(cuts.split(text)):
                if fragment:
                    yield " " + fragment if index == 0 and not fragment.startswith(" ") else fragment

    # Trained with the text cut at every "▁" and around every digit, so that no merge crosses a word start or
    # joins a digit to anything: then encoding the whole text as one word, as LLaMA-2 does, splits the same way.
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(BYTE_TOKENS), special_tokens=special, show_progress=False)
    learner.train_from_iterator(fragments(), trainer=trainer)
    learned = json.loads(learner.to_str())["model"]

    # The byte tokens go in as ordinary vocabulary (as in LLaMA-2), not as added tokens, for byte fallback to find
    # them. No learned piece can be named like one: "<0x..>" holds the digit 0, and digits are never merged.
    pieces = sorted((index, piece) for piece, index in learned["vocab"].items() if index >= len(special))
    vocab = {token: index for index, token in enumerate(special + BYTE_TOKENS + [piece for _, piece in pieces])}
    merges = [tuple(merge) for merge in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # transformers 5 builds LLaMA-2's (legacy=False) this way: "▁" before the first word only, not after each
    # special token, and the whole text one word for the merges.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # add_bos_token as LLaMA-2's; the recipe's own tokenizing passes add_special_tokens=False and adds BOS itself.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS, add_bos_token=True)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, max_position_embeddings: int = 512) -> LlamaForCausalLM:
    """A 3-layer LLaMA with hidden size 64, randomly initialised at a fixed seed."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        # LLaMA's 0.02 suits width 4096; at width 64 it leaves attention nearly uniform and the model sits on a
        # loss plateau for hundreds of steps (measured: held-out exact match 0.28 vs 0.99 after 1200 steps).
        initializer_range=0.1,
    )
    torch.manual_seed(TINY_MODEL_SEED)
    return LlamaForCausalLM(config)


def ensure_tiny_model(path: str | os.PathLike | None = None) -> Path:
    """Build the tiny model and tokenizer into `path` unless a complete build is already there; return the path.

    By default the path is in `$HF_SCALE_CACHE` or `~/.cache/hf_scale`, one folder per build version. The folder
    appears whole or not at all (built beside it, then renamed), so processes that start together never load a
    half-written folder.
    """
    target = Path(path) if path is not None else cache_dir() / f"tiny-llama-v{TINY_BUILD_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer)
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished first; its build is identical.
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
