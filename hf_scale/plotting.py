"""Plots of a finished run, drawn from the Trainer's `state.log_history`."""

from __future__ import annotations

from pathlib import Path


def plot_loss_curve(log_history: list[dict], path: str | Path) -> Path:
    """Save training loss (and eval loss, when logged) against the step as a PNG; return the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    train = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry]
    # eval_loss during training; eval_before_loss / eval_after_loss from the recipe's own evaluations
    evals = [
        (entry["step"], value)
        for entry in log_history
        for key, value in entry.items()
        if key.startswith("eval") and key.endswith("_loss")
    ]
    figure, axes = plt.subplots(figsize=(7, 4))
    if train:
        axes.plot([step for step, _ in train], [loss for _, loss in train], label="train loss")
    if evals:
        axes.plot([step for step, _ in evals], [loss for _, loss in evals], "o-", label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_learning_rate(log_history: list[dict], path: str | Path) -> Path:
    """Save the learning rate against the step (warmup, then the schedule) as a PNG; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(entry["step"], entry["learning_rate"]) for entry in log_history if "learning_rate" in entry]
    figure, axes = plt.subplots(figsize=(7, 3))
    axes.plot([step for step, _ in points], [rate for _, rate in points])
    axes.set_xlabel("step")
    axes.set_ylabel("learning rate")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
