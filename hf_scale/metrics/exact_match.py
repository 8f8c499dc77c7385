"""`exact_match`: the share of predictions that equal their reference once both are stripped.

A local `evaluate` module (hub metrics cannot load offline): `evaluate.load("<path>/exact_match.py")`, or
`hf_scale.metrics.load_metric("exact_match")`. Self-contained on purpose: `evaluate` copies this one file into its
module cache and imports it from there, so it must not import from hf_scale.
"""

import datasets
import evaluate

_DESCRIPTION = """The share of predictions that equal their reference after stripping surrounding whitespace.
Case, punctuation and inner whitespace count: a generated answer is right only when it is the answer."""

_INPUTS = """
Args:
    predictions (list of str): generated texts.
    references (list of str): expected texts, one per prediction.
Returns:
    exact_match (float): share of exact matches, in [0, 1].
Example:
    >>> metric.compute(predictions=[" 101 ", "102"], references=["101", "103"])
    {'exact_match': 0.5}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class ExactMatch(evaluate.Metric):
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
        matches = [p.strip() == r.strip() for p, r in zip(predictions, references, strict=True)]
        return {"exact_match": sum(matches) / len(matches)}
