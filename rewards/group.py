"""Group-relative advantages (GRPO): each response's reward against the other responses to the same prompt.

Shao et al. (2024), "DeepSeekMath", section 4.1.2 (outcome supervision): for G responses to one prompt
with rewards r_1..r_G,

    A_i = (r_i - mean(r)) / (std(r) + eps)        every token of response i gets A_i

with std the sample standard deviation (n - 1), as verl's `compute_grpo_outcome_advantage` takes it.
Liu et al. (2025), "Understanding R1-Zero-Like Training" (Dr. GRPO), drop the division: A_i = r_i - mean(r),
since dividing by a group's std weighs prompts that are almost always (or never) solved the most.

The driver computes these, holding the whole group (train/driver.py); the learner trains on them as
they are, with no critic (learner_node/generation.py, [generation] advantage = "grpo").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantage:
    """How a group's rewards become advantages: centred, and scaled by the group's std unless `scale_by_std` is off."""

    scale_by_std: bool = True
    eps: float = 1e-6

    def __call__(self, rewards: Sequence[float]) -> list[float]:
        """The advantages of one group's responses, in order. A group needs two responses or more: one
        alone has no others to be measured against."""
        n = len(rewards)
        if n < 2:
            raise ValueError(f"a group needs at least 2 rewarded responses to compare, got {n}")
        mean = sum(rewards) / n
        centred = [r - mean for r in rewards]
        if not self.scale_by_std:
            return centred
        std = math.sqrt(sum(c * c for c in centred) / (n - 1))
        return [c / (std + self.eps) for c in centred]
