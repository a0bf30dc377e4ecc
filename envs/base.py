"""The interface every environment implements, and the uniformly random baseline.

An observation is exactly what the protocol's `step` carries (docs/protocol.md):
`{"prompt": str, "question": str, "action": [str, ...]}`; the policy's answer is
the index of one candidate. Rewards and the two end flags follow gymnasium:
`terminated` (the episode ended; nothing to bootstrap) and `truncated` (cut
off by a time limit; the learner bootstraps from the next observation).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

Observation = dict[str, Any]

DEFAULT_QUESTION = "Which action should I choose next? I shall choose No. "


@dataclass
class StepResult:
    obs: Observation  # the next observation (after a reset-free end it is still the state reached)
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class TextEnv(Protocol):
    """An environment whose observations are text prompts with candidate actions."""

    name: str

    def reset(self, seed: int | None = None) -> Observation:
        """Start a new episode (deterministic for a given seed) and return its first observation."""
        ...

    def step(self, action: int) -> StepResult:
        """Apply candidate `action` (an index into the last observation's `action` list)."""
        ...


EnvFactory = Callable[[int], TextEnv]  # client index -> its own environment instance


class InvalidAction(ValueError):
    """The chosen index is not one of the observation's candidates."""


def check_action(action: Any, n_candidates: int) -> int:
    if isinstance(action, bool) or not isinstance(action, int) or not 0 <= action < n_candidates:
        raise InvalidAction(f"action {action!r} is not a candidate index in [0, {n_candidates})")
    return action


def random_returns(make_env: EnvFactory, episodes: int, seed: int = 0) -> list[float]:
    """Undiscounted returns of the uniformly random policy, played locally (no broker): the baseline."""
    rng = random.Random(seed)
    env = make_env(0)
    returns = []
    for episode in range(episodes):
        obs = env.reset(seed=seed + episode)
        total, finished = 0.0, False
        while not finished:
            result = env.step(rng.randrange(len(obs["action"])))
            total += result.reward
            obs = result.obs
            finished = result.terminated or result.truncated
        returns.append(total)
    return returns
