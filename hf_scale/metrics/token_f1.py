"""`token_f1`: SQuAD-style token-overlap F1 between each prediction and its reference, averaged.

A local `evaluate` module (hub metrics cannot load offline): `evaluate.load("<path>/token_f1.py")`, or
`hf_scale.metrics.load_metric("token_f1")`. Self-contained on purpose: `evaluate` copies this one file into its
module cache and imports it from there, so it must not import from hf_scale.
"""

import re
from collections import Counter

import datasets
import evaluate

# Chinese and Japanese write no spaces between words: each of these characters is a token of its own.
# Han ideographs (with extension A, the compatibility block and the supplementary planes), kana, CJK punctuation
# and full-width forms. Korean puts spaces between words, so Hangul stays whitespace-tokenised.
_CJK = (
    "\u3000-\u303f"  # CJK symbols and punctuation (、。「」)
    "\u3040-\u30ff"  # hiragana, katakana
    "\u3400-\u4dbf"  # CJK unified ideographs extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\uff00-\uffef"  # half-width and full-width forms (，！？０-９)
    "\U00020000-\U0002fa1f"  # CJK extensions B-F and the compatibility supplement
)
_TOKEN = re.compile(rf"[{_CJK}]|[^\s{_CJK}]+")

_DESCRIPTION = """Token-overlap F1 as in SQuAD: for each pair, the tokens both texts share (counted with
multiplicity) give precision (shared / prediction tokens) and recall (shared / reference tokens), and F1 is their
harmonic mean; the score is the mean F1 over the pairs. Tokens are whitespace-separated words, except that each
CJK character (Chinese has no spaces) is a token of its own: "答案是42" is 答, 案, 是, 42. Unlike SQuAD, text is not
lower-cased and punctuation and articles are kept, so that an exact match always scores 1. Two empty texts score 1,
one empty text scores 0."""

_INPUTS = """
Args:
    predictions (list of str): generated texts.
    references (list of str): expected texts, one per prediction.
Returns:
    token_f1 (float): mean token-overlap F1, in [0, 1].
Example:
    >>> metric.compute(predictions=["the cat sat"], references=["the cat sat on the mat"])
    {'token_f1': 0.6666666666666666}
"""


def tokenize(text: str) -> list[str]:
    """Whitespace-separated words, with every CJK character split off as its own token."""
    return _TOKEN.findall(text)


def pair_f1(prediction: str, reference: str) -> float:
    predicted, expected = tokenize(prediction), tokenize(reference)
    if not predicted or not expected:
        return float(predicted == expected)  # SQuAD's rule for an empty answer: right only if both are empty
    shared = sum((Counter(predicted) & Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class TokenF1(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        scores = [pair_f1(p, r) for p, r in zip(predictions, references, strict=True)]
        return {"token_f1": sum(scores) / len(scores)}
