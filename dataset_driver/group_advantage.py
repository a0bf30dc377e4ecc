"""How the drivers turn the rewards of a prompt's group of responses into advantages (GRPO, RLOO).

The estimators are learner_node/core_algos.py's (`grpo`, `rloo`: their formulas and sources are there and in
docs/design.md). The driver applies them, holding the whole group (dataset_driver/driver.py): a group's responses
may reach the learner in different updates, so only the driver can. The learner trains on each response's
advantage as it is, with no critic (learner_node/token_update.py, [generation] advantage = "grpo" or "rloo").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from learner_node.core_algos import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS


@dataclass(frozen=True)
class GroupAdvantage:
    """How a group's rewards become advantages: by `estimator` (core_algos' GROUP_ESTIMATORS), GRPO's scaled by the
    group's std unless `scale_by_std` is off."""

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
        return ADVANTAGE_ESTIMATORS[self.estimator](rewards, self.scale_by_std, self.eps)
