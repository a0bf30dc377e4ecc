"""Group-relative advantages against hand-computed vectors (Shao et al. 2024, eq. in section 4.1.2; verl's
compute_grpo_outcome_advantage uses the sample std)."""

from __future__ import annotations

import math

import pytest

from dataset_driver.group_advantage import GroupAdvantage


def test_advantages_are_centred_and_scaled_by_the_groups_sample_std() -> None:
    # [1, 0, 0, 1]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    got = GroupAdvantage(eps=0.0)([1.0, 0.0, 0.0, 1.0])
    assert got == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)
    # [0.5, 1.0, 0.0]: mean 0.5, sample std sqrt((0 + 0.25 + 0.25) / 2) = 0.5
    assert GroupAdvantage(eps=0.0)([0.5, 1.0, 0.0]) == pytest.approx([0.0, 1.0, -1.0])
    assert GroupAdvantage(eps=1e-6)([0.5, 1.0, 0.0]) == pytest.approx([0.0, 0.5 / 0.500001, -0.5 / 0.500001], rel=1e-9)


def test_dr_grpo_only_centres() -> None:
    assert GroupAdvantage(scale_by_std=False)([3.0, 1.0, 2.0, 2.0]) == [1.0, -1.0, 0.0, 0.0]


def test_a_group_that_scored_alike_has_nothing_to_learn_and_a_lone_response_is_refused() -> None:
    assert GroupAdvantage()([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # eps keeps 0 / 0 away
    assert all(math.isfinite(a) for a in GroupAdvantage()([0.2, 0.2 + 1e-12]))
    with pytest.raises(ValueError, match="at least 2 rewarded responses"):
        GroupAdvantage()([1.0])


def test_rloo_measures_each_response_against_the_mean_of_the_others() -> None:
    # [1, 0, 0, 1]: the others' means are 1/3, 2/3, 2/3, 1/3 -> 2/3, -2/3, -2/3, 2/3 (= 4/3 (r - 0.5))
    assert GroupAdvantage("rloo")([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # [3, 1]: 3 - 1 = 2 and 1 - 3 = -2; no std scaling, whatever scale_by_std says
    assert GroupAdvantage("rloo", scale_by_std=True)([3.0, 1.0]) == pytest.approx([2.0, -2.0])
    assert GroupAdvantage("rloo")([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown group estimator 'ppo'; known: grpo, rloo"):
        GroupAdvantage("ppo")
