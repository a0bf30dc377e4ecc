"""Small statistics helpers: percentiles and a time window of latency samples."""

from __future__ import annotations

import collections
import time


def percentiles(values_ms: list[float]) -> dict[str, float]:
    """n, p50, p99 and max of some latencies in milliseconds."""
    if not values_ms:
        return {"n": 0}
    ordered = sorted(values_ms)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {"n": len(ordered), "p50_ms": round(at(0.50), 3), "p99_ms": round(at(0.99), 3), "max_ms": round(ordered[-1], 3)}


class LatencyWindow:
    """The most recent latency samples (bounded), summarised over a trailing window.

    A sample costs about 120 bytes (a tuple of two floats in a deque); the bound keeps
    the broker's memory flat (the 10-minute soak, docs/reliability.md, filled a
    200,000-sample window: +21 MB) while holding a minute of a busy broker's replies.
    """

    def __init__(self, max_samples: int = 50_000) -> None:
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def add(self, seconds: float, now: float | None = None) -> None:
        self.samples.append((time.monotonic() if now is None else now, seconds * 1000))

    def summary(self, window_s: float | None = None) -> dict[str, float]:
        cutoff = time.monotonic() - window_s if window_s else float("-inf")
        return percentiles([ms for t, ms in self.samples if t >= cutoff])
