"""The learner's cycle profile: the wall-clock seconds of its loop, charged to one phase at a time.

Every second since the clock started is charged to exactly one phase (common/learner_figures.CyclePhase), so
the phases add up to the loop's wall time and their shares show the critical path. Phases nest: a checkpoint
begun between two reads of a rollout is charged to the checkpoint, and the read resumes after it. What no phase
claims is `other`. Wall time, not CPU time: a thread the loop does not wait for (the checkpoint's writer, the
weight store's) costs the loop nothing here, which is the point; its share of the cores shows in `ppoz bench
train`'s cores used instead.

The loop's thread alone uses a clock (it is not locked).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from common.learner_figures import CyclePhase


class CycleClock:
    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self.reset()

    def reset(self) -> None:
        """Start again from nothing (the loop begins: start-up is not part of its cycle)."""
        self._since = self._now()
        self._stack: list[CyclePhase] = [CyclePhase.OTHER]
        self.seconds: dict[CyclePhase, float] = dict.fromkeys(CyclePhase, 0.0)

    @contextmanager
    def phase(self, phase: CyclePhase) -> Iterator[None]:
        """Charge the time inside the block to `phase` (less what phases nested in it take)."""
        self._charge()
        self._stack.append(phase)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def recharge(self, phase: CyclePhase) -> None:
        """Charge the time since the current phase began, or since its last nested phase ended, to `phase`
        instead: a read that came back empty was a wait."""
        self._stack[-1] = phase
        self._charge()

    def figures(self) -> dict[str, float]:
        """The cumulative seconds by phase, up to now, as the learner's figures name them."""
        self._charge()
        return {phase.key: round(seconds, 6) for phase, seconds in self.seconds.items()}

    def _charge(self) -> None:
        now = self._now()
        self.seconds[self._stack[-1]] += now - self._since
        self._since = now
