"""The learning curve as a PNG: episode returns over time against the random baseline."""

from __future__ import annotations

from collections.abc import Sequence
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


def write_learning_curve(
    path: str | Path, episodes: Sequence[Any], random_baseline: float, started: float, title: str = "learning curve", window: int = 20
) -> Path:
    """Plot each episode's return (dots), their moving average (line) and the random policy's mean (dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    minutes = [(e.ended_at - started) / 60 for e in episodes]
    returns = [e.ret for e in episodes]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.scatter(minutes, returns, s=6, color="#9ecae1", label="episode return")
    if returns:
        ax.plot(minutes, moving_average(returns, window), color=CURVE_COLOUR, linewidth=2.5, label=f"mean of last {window}")
    ax.axhline(random_baseline, color=BASELINE_COLOUR, linestyle="--", linewidth=1.5, label=f"random policy ({random_baseline:.2f})")
    ax.set_xlabel("minutes")
    ax.set_ylabel("return per episode")
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
