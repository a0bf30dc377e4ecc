"""The learning curve as a PNG: episode returns over time against the random baseline."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CURVE_COLOUR = "#1f77b4"  # the moving average; tests look for it in the image
BASELINE_COLOUR = "#d62728"


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


@contextlib.contextmanager
def _minutes_plot(path: str | Path, ylabel: str, title: str) -> Iterator[Any]:
    """An 8x4.5-inch axis over minutes; labelled, gridded and saved as the PNG `path` on leaving."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        yield ax
        ax.set_xlabel("minutes")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def write_learning_curve(
    path: str | Path, episodes: Sequence[Any], random_baseline: float, started: float, title: str = "learning curve", window: int = 20
) -> Path:
    """Plot each episode's return (dots), their moving average (line) and the random policy's mean (dashed)."""
    minutes = [(e.ended_at - started) / 60 for e in episodes]
    returns = [e.ret for e in episodes]
    with _minutes_plot(path, "return per episode", title) as ax:
        ax.scatter(minutes, returns, s=6, color="#9ecae1", label="episode return")
        if returns:
            ax.plot(minutes, moving_average(returns, window), color=CURVE_COLOUR, linewidth=2.5, label=f"mean of last {window}")
        ax.axhline(random_baseline, color=BASELINE_COLOUR, linestyle="--", linewidth=1.5, label=f"random policy ({random_baseline:.2f})")
    return Path(path)


VALIDATION_COLOUR = "#2ca02c"


def write_training_curve(path: str | Path, rows: Sequence[dict[str, Any]], val_before: float | None, val_after: float | None) -> Path:
    """`ppoz train`'s curve: the drivers' reward mean over time (progress.jsonl's rows: time in s,
    reward_mean) and the validation reward before (at 0) and after (at the end) training."""
    points = [(row["time"] / 60, row["reward_mean"]) for row in rows if row.get("reward_mean") is not None]
    with _minutes_plot(path, "reward", "ppoz train") as ax:
        if points:
            minutes, rewards = [m for m, _ in points], [r for _, r in points]
            ax.plot(minutes, rewards, color=CURVE_COLOUR, linewidth=2.5, label="reward (mean of the last 100)")
        end = points[-1][0] if points else 1.0
        marks = [(m, v) for m, v in ((0.0, val_before), (end, val_after)) if v is not None]
        if marks:
            minutes, values = [m for m, _ in marks], [v for _, v in marks]
            ax.plot(minutes, values, "o--", color=VALIDATION_COLOUR, markersize=9, label="validation reward (greedy)")
    return Path(path)
