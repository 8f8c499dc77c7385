"""What the data pipeline makes of the shared Alpaca sets, as one digest per case: every template (the Alpaca ones,
LLaMA-2 chat, a JSON user template, ChatML and a real model's own chat template), every truncation policy, one-turn
records and chained conversations, on byte-level BPE and SentencePiece tokenizers.

`tests/data/pipeline_digests.json` holds the digests the pipeline gave before it moved to `datasets.map` (written by
`python -m tests.data.pipeline_cases OUT.json` on commit dc333fc, which tokenized into Python lists);
`test_pipeline_digests.py` checks that today's pipeline gives the same examples and the same summaries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from hf_scale.data.conversations import chain_conversations
from hf_scale.data.loading import load_records
from hf_scale.data.multiturn import chat_template_for, tokenize_conversations
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import tokenize_records
from hf_scale.tiny.build import build_sentencepiece_tokenizer
from tests.data.chat_tokenizers import chatml_tokenizer, llama2_tokenizer
from tests.helpers import SHARED_DATA

DIGESTS = Path(__file__).with_name("pipeline_digests.json")
USER_TEMPLATE = json.dumps({"with_input": "Q: {instruction}\n{input}\nA:", "without_input": "Q: {instruction}\nA:"})

# (tokenizer, set, template, system prompt): one-turn records
RECORD_CASES = [
    ("tiny", "en", "alpaca", None),
    ("tiny", "zh", "alpaca_zh", None),
    ("tiny", "en", "llama2_chat", "Answer briefly."),
    ("tiny", "en", USER_TEMPLATE, None),
    ("sentencepiece", "zh", "alpaca_zh", None),
    ("chatml", "zh", "chat_template", None),
    ("smollm2", "zh", "chat_template", None),
    ("smollm2", "en", "chat_template", "You are a helpful assistant."),
]
# (tokenizer, set, template): conversations chained from the records
CONVERSATION_CASES = [
    ("tiny", "en", "alpaca"),
    ("sentencepiece", "zh", "alpaca_zh"),
    ("llama2", "en", "llama2_chat"),
    ("chatml", "zh", "chat_template"),
    ("smollm2", "zh", "chat_template"),
]
RECORD_MAX_LENGTH = 128  # cuts or drops a good share of both sets
CONVERSATION_MAX_LENGTH = 384


def shared_records(language: str) -> list[dict[str, str]]:
    return load_records(str(SHARED_DATA / f"alpaca_{language}_demo.json"))[0]


def tokenizers(tiny_model_dir: Path, smollm2_dir: Path) -> dict:
    sentencepiece_text = [" ".join(r.values()) for language in ("en", "zh") for r in shared_records(language)]
    return {
        "tiny": AutoTokenizer.from_pretrained(tiny_model_dir),
        "sentencepiece": build_sentencepiece_tokenizer(sentencepiece_text),
        "chatml": chatml_tokenizer(tiny_model_dir),
        "llama2": llama2_tokenizer(tiny_model_dir),
        "smollm2": AutoTokenizer.from_pretrained(smollm2_dir),
    }


def digest(dataset, summary) -> str:
    """The examples, token by token, and every count of the summary."""
    hasher = hashlib.sha256(json.dumps(dataclasses.asdict(summary), sort_keys=True).encode())
    columns = dataset.to_dict()
    for row in zip(columns["input_ids"], columns["attention_mask"], columns["labels"], strict=True):
        hasher.update(json.dumps(list(row)).encode())
    return hasher.hexdigest()


def case_digests(tokenizer_of: dict) -> dict[str, str]:
    """Every case's digest, by a name that says what the case is."""
    digests = {}
    for tokenizer_name, language, template_name, system_prompt in RECORD_CASES:
        tokenizer = tokenizer_of[tokenizer_name]
        template = get_template(template_name, system_prompt, tokenizer)
        records = shared_records(language)
        for truncation in ("keep_prompt", "cut_prompt_left", "drop"):
            for train_on_inputs in (False, True) if template_name == "alpaca" else (False,):
                dataset, summary = tokenize_records(
                    records, tokenizer, template, RECORD_MAX_LENGTH, train_on_inputs, truncation
                )
                name = f"records {tokenizer_name} {language} {template_name[:12]} {truncation} {train_on_inputs}"
                digests[name] = digest(dataset, summary)
    for tokenizer_name, language, template_name in CONVERSATION_CASES:
        tokenizer = tokenizer_of[tokenizer_name]
        conversations = chain_conversations(shared_records(language))  # a list: every version takes one
        for truncation in ("keep_prompt", "drop"):
            for assistant_turns in ("all", "last"):
                dataset, summary = tokenize_conversations(
                    conversations,
                    tokenizer,
                    chat_template_for(template_name, tokenizer),
                    CONVERSATION_MAX_LENGTH,
                    assistant_turns=assistant_turns,
                    truncation=truncation,
                )
                name = f"conversations {tokenizer_name} {language} {template_name} {truncation} {assistant_turns}"
                digests[name] = digest(dataset, summary)
    return digests


if __name__ == "__main__":
    from hf_scale.gguf_source import ensure_converted, packaged_gguf
    from hf_scale.tiny import ensure_tiny_model

    found = case_digests(tokenizers(ensure_tiny_model(), ensure_converted(packaged_gguf("SmolLM2-135M-Instruct"))))
    Path(sys.argv[1]).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
