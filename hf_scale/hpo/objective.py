"""What a trial scores: the best value of the objective seen at any of its evaluations, in the right direction.

The stock backend scores a trial by its last evaluation (a trial that peaked and then overfit looks bad), and by
the sum of all non-loss metrics when `compute_metrics` is set. Here the objective is `metric_for_best_model`
(eval_loss by default) unless `compute_objective` says otherwise, and a direction that contradicts the metric is
refused before any trial runs, or at the first evaluation for a `compute_objective` returning a known metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from hf_scale.errors import ConfigError

DIRECTIONS = ("minimize", "maximize")
# Metric names whose meaning fixes the direction; any other name leaves it to the caller.
LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error", "wer", "cer")
HIGHER_IS_BETTER = ("accuracy", "accuracies", "exact_match", "f1", "bleu", "rouge", "precision", "recall", "auc")

Objective = Callable[[dict[str, float]], float]


def objective_metric(args: Any) -> str:
    """The metric the default objective reads: `metric_for_best_model` with the eval_ prefix, or eval_loss."""
    name = args.metric_for_best_model or "eval_loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def natural_direction(metric: str) -> str | None:
    """Minimize for losses and error rates, maximize for accuracies and scores, None when the name says nothing."""
    name = metric.lower()
    if name.endswith(LOWER_IS_BETTER):
        return "minimize"
    if any(word in name for word in HIGHER_IS_BETTER):
        return "maximize"
    return None


def metric_objective(metric: str) -> Objective:
    """The default `compute_objective`: the value of one metric."""

    def compute_objective(metrics: dict[str, float]) -> float:
        if metric not in metrics:
            raise ConfigError(
                f"metric_for_best_model: the evaluation has no {metric!r}; it has {', '.join(sorted(metrics))}"
            )
        return float(metrics[metric])

    return compute_objective


def resolve_direction(direction: str | None, compute_objective: Objective | None, args: Any) -> str:
    """The direction of the search: given, or the default objective's own; a contradiction is a ConfigError."""
    if direction is not None and direction not in DIRECTIONS:
        raise ConfigError(
            f"direction: {direction!r} is neither 'minimize' nor 'maximize' (the search optimizes one objective)"
        )
    if compute_objective is not None:
        return direction or "minimize"
    metric = objective_metric(args)
    if args.metric_for_best_model and args.greater_is_better is not None:
        natural = "maximize" if args.greater_is_better else "minimize"
    else:
        natural = natural_direction(metric) or "minimize"
    if direction is not None and direction != natural:
        raise ConfigError(
            f"direction={direction!r} contradicts the objective {metric}, which is better when "
            f"{'higher' if natural == 'maximize' else 'lower'}: use direction={natural!r}, or set "
            "metric_for_best_model / greater_is_better to the metric you mean"
        )
    return natural


def check_against_direction(value: float, metrics: dict[str, float], direction: str) -> None:
    """Refuse a `compute_objective` whose value is a metric that is better the other way than `direction`.

    The value is matched to the metrics it equals; only when all of those have the same known direction can a
    contradiction be told apart from a coincidence."""
    matches = [key for key, metric in metrics.items() if isinstance(metric, int | float) and metric == value]
    naturals = {natural_direction(key) for key in matches}
    if len(naturals) == 1 and (natural := naturals.pop()) is not None and natural != direction:
        raise ConfigError(
            f"compute_objective returns {matches[0]} (better when {'higher' if natural == 'maximize' else 'lower'}) "
            f"but direction={direction!r}: the search would look for the worst trial; use direction={natural!r}"
        )


class BestValue:
    """The best objective value of one trial so far, and the evaluation (1-based) and step where it was seen."""

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.value: float | None = None
        self.evaluation = 0
        self.step = 0
        self.evaluations = 0

    def update(self, value: float, step: int) -> bool:
        """Record one evaluation; True when it is the best so far. NaN is never best."""
        self.evaluations += 1
        if math.isnan(value):
            return False
        better = self.value is None or (value < self.value if self.direction == "minimize" else value > self.value)
        if better:
            self.value, self.evaluation, self.step = value, self.evaluations, step
        return better
