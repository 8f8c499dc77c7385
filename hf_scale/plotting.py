"""Plots of a finished run, drawn from the Trainer's `state.log_history`."""

from __future__ import annotations

from pathlib import Path


def _figure(height: float):
    # A bare Figure draws to files without pyplot: no backend to pick on a display-less training node and no
    # global figure registry to close.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, height))
    return figure, figure.subplots()


def _save(figure, axes, ylabel: str, path: str | Path) -> Path:
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path


def plot_loss_curve(log_history: list[dict], path: str | Path) -> Path:
    """Save training loss (and eval loss, when logged) against the step as a PNG; return the path."""
    train = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry]
    # eval_loss during training; eval_before_loss / eval_after_loss from the recipe's own evaluations
    evals = [
        (entry["step"], value)
        for entry in log_history
        for key, value in entry.items()
        if key.startswith("eval") and key.endswith("_loss")
    ]
    figure, axes = _figure(height=4)
    if train:
        axes.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        axes.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    axes.set_yscale("log")
    axes.legend()
    return _save(figure, axes, "loss", path)


def plot_learning_rate(log_history: list[dict], path: str | Path) -> Path:
    """Save the learning rate against the step (warmup, then the schedule) as a PNG; return the path."""
    points = [(entry["step"], entry["learning_rate"]) for entry in log_history if "learning_rate" in entry]
    figure, axes = _figure(height=3)
    axes.plot(*zip(*points, strict=True))
    return _save(figure, axes, "learning rate", path)
