"""What the drivers have done: the positions done, for the resume point, and the figures of their responses."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from rewards.composite import Scored


@dataclass
class DriverProgress:
    """Positions done (rewarded, or left without a reward), and the figures of the responses."""

    start: int = 0
    done: set[int] = field(default_factory=set)
    skipped: int = 0  # positions an earlier run stored: not played again
    rewarded: int = 0
    unrewarded: int = 0
    reward_sum: float = 0.0
    response_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # the first few reasons a response went unrewarded
    stopped_workers: list[str] = field(default_factory=list)  # workers that met an error they cannot go on from, and why
    groups: int = 0  # GRPO: groups settled
    uniform_groups: int = 0  # GRPO: groups whose rewarded responses all scored the same (advantages all 0: nothing to learn)
    lone: int = 0  # GRPO: rewarded responses not trained on, the only rewarded one of their group
    recent_uniform: list[bool] = field(default_factory=list)  # GRPO: whether each of the last groups scored alike
    recent: list[float] = field(default_factory=list)  # the last rewards, for a moving mean
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def resume_from(self) -> int:
        """The first position not yet done."""
        position = self.start
        while position in self.done:
            position += 1
        return position

    def skip(self, position: int) -> None:
        """A position an earlier run stored: done, and not counted among this run's responses."""
        with self.lock:
            self.done.add(position)
            self.skipped += 1

    def record(self, position: int, scored: Scored | None, tokens: int) -> None:
        with self.lock:
            self.done.add(position)
            self.response_tokens += tokens
            if scored is None or scored.reward is None:
                self.unrewarded += 1
                if scored is not None and len(self.errors) < 10:
                    self.errors.append(scored.error)
                return
            self.rewarded += 1
            self.reward_sum += scored.reward
            self.recent.append(scored.reward)
            del self.recent[:-200]

    def count_group(self, rewards: Sequence[float]) -> None:
        """A GRPO group settled, with the rewards of its rewarded responses."""
        with self.lock:
            self.groups += 1
            if len(rewards) == 1:
                self.lone += 1
            elif len(rewards) >= 2:
                uniform = max(rewards) == min(rewards)
                self.uniform_groups += uniform
                self.recent_uniform.append(uniform)
                del self.recent_uniform[:-100]

    def recent_mean(self, n: int = 100) -> float | None:
        """The mean of the last `n` rewards; None before the first."""
        recent = self.recent[-n:]
        return sum(recent) / len(recent) if recent else None
