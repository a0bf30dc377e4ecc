"""Policies an actor can serve without a model.

`uniform` picks every candidate with equal probability. It is the stand-in the
broker tests and `ppoz bench broker` use (an actor that answers at once), and a
baseline to compare a learned policy with. The LLM policy lives beside it.
"""

from __future__ import annotations

import math
import random
from typing import Any


class UniformPolicy:
    """Samples a candidate uniformly at random; its policy version is always 0."""

    policy_version = 0

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, obs: dict[str, Any]) -> tuple[int, float, list[float]]:
        n = len(obs["action"])
        return self.rng.randrange(n), -math.log(n), [1.0 / n] * n
