"""Policies an actor can serve without a model.

`uniform` picks every candidate with equal probability. It is the stand-in the
broker tests and `ppoz bench broker` use (an actor that answers at once), and a
baseline to compare a learned policy with. The LLM policy is actor_node/llm_policy.py;
both answer `choose_batch(jobs)` with one Choice (or exception) per job.
"""

from __future__ import annotations

import math
import random
from typing import Any

from actor_node.llm_policy import Choice


class UniformPolicy:
    """Samples a candidate uniformly at random; its policy version is always 0."""

    policy_version = 0

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, obs: dict[str, Any]) -> tuple[int, float, list[float]]:
        n = len(obs["action"])
        return self.rng.randrange(n), -math.log(n), [1.0 / n] * n

    def choose_batch(self, jobs: list[dict[str, Any]]) -> list[Choice | Exception]:
        out: list[Choice | Exception] = []
        for job in jobs:
            try:
                out.append(Choice(*self.choose(job["obs"])))
            except Exception as e:  # a malformed observation fails its own job only
                out.append(e)
        return out
