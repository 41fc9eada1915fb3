"""The loss-curve image that goes into a model card."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on the training machine
import matplotlib.pyplot as plt  # noqa: E402

from tokenmill.train.history import TrainHistory  # noqa: E402

SMOOTHING_WINDOW = 25


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    averaged = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        averaged.append(running / min(index + 1, window))
    return averaged


def plot_loss_curve(
    history: TrainHistory,
    title: str,
    path: Path,
    ylabel: str = "cross-entropy (nats / token)",
) -> None:
    """Training loss (raw and smoothed) and held-out loss against tokens seen."""
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    millions = [t / 1e6 for t in history.tokens]
    axes.plot(millions, history.train_loss, color="tab:blue", alpha=0.25, linewidth=0.8)
    axes.plot(
        millions,
        moving_average(history.train_loss, SMOOTHING_WINDOW),
        color="tab:blue",
        label=f"train (mean of {SMOOTHING_WINDOW} steps)",
    )
    if history.eval_loss:
        axes.plot(
            [t / 1e6 for t in history.eval_tokens],
            history.eval_loss,
            "o-",
            color="tab:orange",
            label="held-out",
        )
    axes.set_xlabel("tokens seen (millions)")
    axes.set_ylabel(ylabel)
    axes.set_title(f"{title}: training loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
