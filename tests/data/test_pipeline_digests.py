"""The data pipeline gives, case by case, the examples and summaries it gave before it moved to `datasets.map`
(`pipeline_cases.py` says how the digests were made)."""

import json

import pytest

from tests.data.pipeline_cases import DIGESTS, case_digests, tokenizers
from tests.helpers import SHARED_DATA


@pytest.mark.slow  # the real model's tokenizer comes from the converted GGUF file
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data (the real Alpaca sets) is absent")
def test_every_template_and_truncation_gives_the_examples_it_gave_before(tiny_model_dir, smollm2):
    expected = json.loads(DIGESTS.read_text())
    found = case_digests(tokenizers(tiny_model_dir, smollm2))
    assert sorted(found) == sorted(expected)
    assert [name for name in expected if found[name] != expected[name]] == []
