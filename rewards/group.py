"""Group-relative advantages (GRPO, RLOO): each response's reward against the other responses to the same prompt.

Shao et al. (2024), "DeepSeekMath", section 4.1.2 (outcome supervision): for G responses to one prompt
with rewards r_1..r_G,

    A_i = (r_i - mean(r)) / (std(r) + eps)        every token of response i gets A_i

with std the sample standard deviation (n - 1), as verl's `compute_grpo_outcome_advantage` takes it.
Liu et al. (2025), "Understanding R1-Zero-Like Training" (Dr. GRPO), drop the division: A_i = r_i - mean(r),
since dividing by a group's std weighs prompts that are almost always (or never) solved the most.
RLOO (Ahmadian et al. 2024) measures each response against the mean of the others: A_i = n / (n - 1) (r_i - mean(r)).

The driver computes these, holding the whole group (dataset_driver/driver.py): a group's responses may reach the
learner in different updates, so only the driver can. The learner trains on them as they are, with no
critic (learner_node/generation.py, [generation] advantage = "grpo" or "rloo"); the rest of the update's
math is learner_node/core_algos.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def grpo(rewards: Sequence[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps), std with n - 1; centring only with `scale_by_std` off (Dr. GRPO)."""
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def rloo(rewards: Sequence[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): each response against
    the mean of the others, A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean(r)); as verl's
    compute_rloo_outcome_advantage. An unbiased baseline: r_i is not in its own. No scaling."""
    n = len(rewards)
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


# The group-relative estimators the drivers can apply ([generation] advantage); "gae" is the learner's critic.
GROUP_ESTIMATORS: dict[str, Callable[..., list[float]]] = {"grpo": grpo, "rloo": rloo}


@dataclass(frozen=True)
class GroupAdvantage:
    """How a group's rewards become advantages: by `estimator` (GROUP_ESTIMATORS), GRPO's scaled by the group's
    std unless `scale_by_std` is off."""

    estimator: str = "grpo"
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.estimator not in GROUP_ESTIMATORS:
            raise ValueError(f"unknown group estimator {self.estimator!r}; known: {', '.join(GROUP_ESTIMATORS)}")

    def __call__(self, rewards: Sequence[float]) -> list[float]:
        """The advantages of one group's responses, in order. A group needs two responses or more: one
        alone has no others to be measured against."""
        n = len(rewards)
        if n < 2:
            raise ValueError(f"a group needs at least 2 rewarded responses to compare, got {n}")
        return GROUP_ESTIMATORS[self.estimator](rewards, self.scale_by_std, self.eps)
