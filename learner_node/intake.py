"""What one rollout's segments gave an update, as one record for every kind of policy.

A rollout is built into one batch per kind of policy (learner_node/rollout.py's `Rollout` of candidate
choices, learner_node/token_update.py's `GenerationBatch` of generated responses); each says what it took and
what it left out (their `Tally`). `Intake.of` reads one, and `+` adds them up, so the learner's figures
(`charts/...`) and its checkpointed counters are computed once, from the sum, whatever kinds the rollout held.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.learner_figures import Chart, LearnerCounter, mismatched_counter
from learner_node.rollout import Rollout
from learner_node.token_update import GenerationBatch

# The counts a batch's Tally keeps (learner_node/rollout.py) that an Intake carries and adds up, named once.
TALLIED = ("stored", "dropped_stale", "dropped_truncated", "dropped_unscorable_next_obs", "dropped_mismatched")


@dataclass(frozen=True)
class Intake:
    """The transitions a rollout's batches hold, and what they left out and why."""

    batched: int = 0  # transitions in the batches: trained, unless the update is discarded
    stored: int = 0  # transitions in the segments read
    dropped_stale: int = 0
    dropped_truncated: int = 0
    dropped_unscorable_next_obs: int = 0  # of dropped_truncated: the segment's next observation could not be scored
    dropped_mismatched: int = 0
    mismatched: Mapping[str, int] = field(default_factory=dict)  # dropped_mismatched by the field that disagreed
    lags: tuple[int, ...] = ()  # of each transition batched: versions between its behaviour policy and the learner's
    episodic_returns: tuple[float, ...] = ()
    unscorable_reason: str = ""  # why the last next observation that could not be scored could not (logged)

    @classmethod
    def of(cls, batch: Rollout | GenerationBatch, unscorable_reason: str | None = None) -> Intake:
        """`unscorable_reason`: in place of the batch's own (the candidate critic's, which the learner keeps)."""
        return cls(
            batched=len(batch),
            **{name: getattr(batch, name) for name in TALLIED},
            mismatched=dict(batch.mismatched),
            lags=tuple(batch.lags),
            episodic_returns=tuple(batch.episodic_returns),
            unscorable_reason=batch.unscorable_reason if unscorable_reason is None else unscorable_reason,
        )

    def __add__(self, other: Intake) -> Intake:
        """Both batches' counts summed, their lags and returns in order (this one's first); the reason of the later
        batch that dropped an unscorable next observation."""
        mismatched = collections.Counter(self.mismatched)
        mismatched.update(other.mismatched)
        return Intake(
            batched=self.batched + other.batched,
            **{name: getattr(self, name) + getattr(other, name) for name in TALLIED},
            mismatched=dict(mismatched),
            lags=self.lags + other.lags,
            episodic_returns=self.episodic_returns + other.episodic_returns,
            unscorable_reason=other.unscorable_reason if other.dropped_unscorable_next_obs else self.unscorable_reason,
        )

    def charts(self, trained: int, elapsed_s: float, version: int) -> dict[str, float]:
        """An applied update's `charts/...` figures: `trained` transitions in `elapsed_s`, making policy `version`."""
        lag = self.lags or (0,)
        returns = self.episodic_returns
        return {
            Chart.EPISODIC_RETURN.key: sum(returns) / len(returns) if returns else math.nan,
            Chart.EPISODES.key: len(returns),
            Chart.POLICY_LAG.key: sum(lag) / len(lag),
            Chart.SPS.key: trained / elapsed_s if elapsed_s > 0 else 0.0,
            Chart.POLICY_VERSION.key: version,
            Chart.DROPPED_STALE.key: self.dropped_stale,
            Chart.DROPPED_TRUNCATED.key: self.dropped_truncated,
            Chart.DROPPED_UNSCORABLE_NEXT_OBS.key: self.dropped_unscorable_next_obs,
            Chart.DROPPED_MISMATCHED.key: self.dropped_mismatched,
        }

    def count(self, counters: collections.Counter[str], trained: int) -> None:
        """Add to the learner's checkpointed counters what was stored and dropped, and why, and `trained`."""
        counters[LearnerCounter.TRANSITIONS_STORED] += self.stored
        counters[LearnerCounter.DROPPED_STALE] += self.dropped_stale
        counters[LearnerCounter.DROPPED_TRUNCATED] += self.dropped_truncated
        counters[LearnerCounter.DROPPED_UNSCORABLE_NEXT_OBS] += self.dropped_unscorable_next_obs
        counters[LearnerCounter.DROPPED_MISMATCHED] += self.dropped_mismatched
        for reason, count in self.mismatched.items():
            counters[mismatched_counter(reason)] += count
        counters[LearnerCounter.TRANSITIONS_TRAINED] += trained
