"""What a rollout's batches took and dropped adds up in one record (learner_node/intake.py): the learner's figures
and counters come from the sum, as they came from the candidate rollout's and the generation batch's added by hand."""

from __future__ import annotations

import collections
import math

from learner_node.intake import Intake
from learner_node.rollout import Rollout
from learner_node.token_update import GenerationBatch


def rollout() -> Rollout:
    r = Rollout(stored=5, dropped_stale=1, dropped_truncated=2, dropped_unscorable_next_obs=1, dropped_mismatched=1)
    r.mismatched["run"] += 1
    r.actions, r.lags, r.episodic_returns = [0, 1, 2], [0, 1, 2], [1.0, 0.0]
    return r


def generated() -> GenerationBatch:
    g = GenerationBatch(stored=4, dropped_truncated=1, dropped_unscorable_next_obs=1, unscorable_reason="too long")
    g.dropped_mismatched = 2
    g.mismatched.update({"temperature": 1, "run": 1})
    g.responses, g.lags, g.episodic_returns = [[1], [2]], [3, 0], [0.5]
    return g


def test_the_sum_of_both_kinds_is_what_the_learner_added_by_hand() -> None:
    r, g = rollout(), generated()
    total = Intake.of(r, "empty prompt") + Intake.of(g)
    assert (total.batched, total.stored) == (len(r) + len(g), r.stored + g.stored)
    assert total.dropped_stale == r.dropped_stale + g.dropped_stale
    assert total.dropped_truncated == r.dropped_truncated + g.dropped_truncated
    assert total.dropped_unscorable_next_obs == 2 and total.dropped_mismatched == 3
    assert total.mismatched == {"run": 2, "temperature": 1}
    assert total.lags == (0, 1, 2, 3, 0) and total.episodic_returns == (1.0, 0.0, 0.5)  # the candidates' first
    assert total.unscorable_reason == "too long"  # the generation batch's, which dropped one
    assert (Intake.of(r, "empty prompt") + Intake.of(GenerationBatch())).unscorable_reason == "empty prompt"

    charts = total.charts(trained=5, elapsed_s=2.0, version=7)
    lag = r.lags + g.lags
    returns = r.episodic_returns + g.episodic_returns
    assert charts == {
        "charts/episodic_return": sum(returns) / len(returns),
        "charts/episodes": 3,
        "charts/policy_lag": sum(lag) / len(lag),
        "charts/SPS": 2.5,
        "charts/policy_version": 7,
        "charts/dropped_stale": 1,
        "charts/dropped_truncated": 3,
        "charts/dropped_unscorable_next_obs": 2,
        "charts/dropped_mismatched": 3,
    }


def test_an_empty_rollout_has_no_return_and_no_lag() -> None:
    charts = (Intake.of(Rollout()) + Intake.of(GenerationBatch())).charts(trained=0, elapsed_s=0.0, version=0)
    assert math.isnan(charts["charts/episodic_return"]) and charts["charts/policy_lag"] == 0 and charts["charts/SPS"] == 0.0


def test_the_counters_add_up_in_the_order_they_always_had() -> None:
    counters: collections.Counter[str] = collections.Counter()
    (Intake.of(rollout(), "") + Intake.of(generated())).count(counters, trained=5)
    assert list(counters.items()) == [
        ("transitions_stored", 9),
        ("dropped_stale", 1),
        ("dropped_truncated", 3),
        ("dropped_unscorable_next_obs", 2),
        ("dropped_mismatched", 3),
        ("mismatched_run", 2),
        ("mismatched_temperature", 1),
        ("transitions_trained", 5),
    ]
