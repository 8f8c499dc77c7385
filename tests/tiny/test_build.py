import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, LlamaTokenizer

from hf_scale.tiny.build import (
    build_sentencepiece_tokenizer,
    build_tiny_model,
    build_tiny_tokenizer,
    ensure_tiny_model,
)
from tests.helpers import SHARED_DATA

# Characters the Alpaca-trained vocabulary lacks (checked below): emoji, rare CJK (one outside the BMP), a ZWJ.
RARE_TEXTS = ["I love it 😀!", "龘 is rare", "𠀋 and 👩\u200d💻 and ∰", "mixed 😀龘\n\n𠀋 end"]


def test_saved_folder_loads_with_auto_classes(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>" and tokenizer.pad_token is None
    assert model.config.vocab_size == len(tokenizer)


def test_digits_are_single_tokens_and_text_round_trips(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.tokenize("417") == ["4", "1", "7"]
    text = "给这个数加一。\n\n### Response:\n418"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_build_is_deterministic(tmp_path, tiny_model_dir):
    tokenizer = build_tiny_tokenizer()
    first, second = build_tiny_model(tokenizer), build_tiny_model(tokenizer)
    pairs = zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()


def test_ensure_reuses_a_complete_build(tmp_path):
    path = ensure_tiny_model(tmp_path / "tiny")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no staging folder left behind


@pytest.fixture(scope="module")
def alpaca_texts() -> list[str]:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data (the real Alpaca sets) is absent")
    return [
        "\n".join([record["instruction"], record["input"], record["output"]])
        for name in ("alpaca_en_demo.json", "alpaca_zh_demo.json")
        for record in json.loads((SHARED_DATA / name).read_text(encoding="utf-8"))
    ]


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(alpaca_texts):
    return build_sentencepiece_tokenizer(alpaca_texts, vocab_size=2000)


def test_sentencepiece_layout_is_llama2s(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    assert len(tokenizer) == 2000 and tokenizer.pad_token is None
    assert [tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id] == [0, 1, 2]
    assert tokenizer.convert_tokens_to_ids("<0x41>") == 3 + 0x41
    assert tokenizer.convert_ids_to_tokens([3, 258]) == ["<0x00>", "<0xFF>"]
    assert set(tokenizer.get_added_vocab()) == {"<unk>", "<s>", "</s>"}  # the byte tokens are ordinary pieces
    pieces = tokenizer.tokenize("hello world")
    assert "".join(pieces) == "▁hello▁world" and pieces[0].startswith("▁")
    assert all(piece.startswith("▁") for piece in pieces if "▁" in piece)  # no piece runs over a word start
    assert tokenizer.tokenize("in 2023") == ["▁in", "▁", "2", "0", "2", "3"]
    assert tokenizer.tokenize("a\nb") == ["▁a", "<0x0A>", "b"]  # no newline piece, as in LLaMA-2


def test_sentencepiece_special_tokens_and_bos(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    ids = tokenizer("<s>[INST] hi [/INST] ok </s>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == ids.count(2) == 1
    assert tokenizer("hi", add_special_tokens=False)["input_ids"][0] != 1
    assert tokenizer("hi")["input_ids"] == [1, *tokenizer("hi", add_special_tokens=False)["input_ids"]]


def test_sentencepiece_round_trips_alpaca_and_rare_characters_exactly(sentencepiece_tokenizer, alpaca_texts):
    tokenizer = sentencepiece_tokenizer
    texts = alpaca_texts + RARE_TEXTS
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert [text for text, ids in zip(texts, encoded, strict=True) if tokenizer.decode(ids) != text] == []
    assert all(tokenizer.unk_token_id not in ids for ids in encoded)
    assert not {"😀", "龘", "𠀋", "👩", "\u200d", "💻", "∰"} & tokenizer.get_vocab().keys()
    for text, ids in zip(RARE_TEXTS, encoded[len(alpaca_texts) :], strict=True):
        assert any(3 <= token_id < 259 for token_id in ids), text  # spelled in byte tokens


def test_sentencepiece_digits_are_single_tokens(sentencepiece_tokenizer, alpaca_texts):
    tokenizer = sentencepiece_tokenizer
    encoded = tokenizer(alpaca_texts, add_special_tokens=False)["input_ids"]
    used = {token_id for ids in encoded for token_id in ids if token_id >= 259}  # pieces, not the byte tokens
    with_digits = [piece for piece in tokenizer.convert_ids_to_tokens(sorted(used)) if any(c.isdigit() for c in piece)]
    assert with_digits and all(len(piece) == 1 for piece in with_digits)
    assert tokenizer.tokenize("417") == ["▁", "4", "1", "7"]


def test_sentencepiece_reloads_and_rebuilds_identically(tmp_path, sentencepiece_tokenizer, alpaca_texts):
    sentencepiece_tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = alpaca_texts[::10] + RARE_TEXTS + ["<s>[INST] hi [/INST] ok </s>"]
    for add_special_tokens in (False, True):
        expected = sentencepiece_tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        assert reloaded(texts, add_special_tokens=add_special_tokens)["input_ids"] == expected
    rebuilt = build_sentencepiece_tokenizer(alpaca_texts, vocab_size=2000)
    assert rebuilt.backend_tokenizer.to_str() == sentencepiece_tokenizer.backend_tokenizer.to_str()


def test_sentencepiece_encodes_as_transformers_llama_tokenizer_does(sentencepiece_tokenizer, alpaca_texts):
    # LlamaTokenizer is what transformers 5 rebuilds the real LLaMA-2 tokenizer.json into (legacy=False).
    model = json.loads(sentencepiece_tokenizer.backend_tokenizer.to_str())["model"]
    llama = LlamaTokenizer(
        vocab=model["vocab"], merges=[tuple(merge) for merge in model["merges"]], legacy=False, add_bos_token=True
    )
    texts = alpaca_texts[::10] + RARE_TEXTS + ["<s>[INST] hi [/INST] ok </s>", "  two  spaces "]
    for add_special_tokens in (False, True):
        expected = llama(texts, add_special_tokens=add_special_tokens)["input_ids"]
        assert sentencepiece_tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"] == expected
    ids = llama(texts, add_special_tokens=False)["input_ids"]
    assert sentencepiece_tokenizer.batch_decode(ids) == llama.batch_decode(ids)


def test_sentencepiece_builds_from_the_generated_tasks():
    tokenizer = build_sentencepiece_tokenizer()
    text = "给这个数加一。\n\n### Response:\n418"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids)[-3:] == ["4", "1", "8"]
