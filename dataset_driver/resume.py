"""Exact resume: every sample has an id, and what an earlier run stored is read back from Redis.

A sample is one position of the order of work (dataset_driver/data.py `PromptOrder`); its id is `<run>:<position>`,
where `run` names one order of work over one dataset (kept in driver_state.json, new with --no-resume). The
id travels with the sample's `feedback` (`sample`, docs/protocol.md); the broker marks it in `P:samples`
(id -> the reward stored) in the same atomic script that stores its transition, and stores an id once; the
learner counts it in `P:learner:samples` in the script that acknowledges its stream entry. So a resumed
driver skips exactly the samples whose transitions are in Redis, whatever moment the last run died at
(docs/train.md, "Resume").

GRPO and RLOO send each response's advantage over its group, so a group cut by a kill (some members stored,
the others not) is completed with the raw scores of its stored members, which the driver writes to
`P:samples:scores` before it sends any feedback of the group.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from common.segments import RedisKeys

log = logging.getLogger(__name__)

SCAN_COUNT = 1000  # hash fields per HSCAN round trip


def new_run_id() -> str:
    """A fresh id for one order of work: 12 hex digits, so sample ids stay short and match no glob pattern."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Samples:
    """How this run's drivers name their samples and what earlier runs of the same order of work stored."""

    run: str
    stored: Mapping[int, float] = field(default_factory=dict)  # positions stored before, and the reward stored with each
    scores: Mapping[int, float] = field(default_factory=dict)  # GRPO: raw scores of stored positions (P:samples:scores)
    marks: SampleMarks | None = None  # where scores are recorded; None: nowhere (no Redis; a cut group is completed alone)

    def id(self, position: int) -> str:
        return f"{self.run}:{position}"

    def record_scores(self, scores: Mapping[int, float]) -> None:
        """GRPO: the raw scores of a group's members, recorded before any of its feedbacks is sent."""
        if self.marks is None or not scores:
            return
        try:
            self.marks.record_scores({self.id(position): score for position, score in scores.items()})
        except redis.RedisError as e:  # the feedbacks still go: only a cut group's completion would lack these scores
            log.warning(
                "could not record the raw scores of samples %s (%s); if this group is cut, it is completed without them", sorted(scores), e
            )


class SampleMarks:
    """The samples' marks in one deployment's Redis (`key_prefix`): what the broker stored, the drivers' raw scores."""

    def __init__(self, client: redis.Redis, key_prefix: str) -> None:
        self.client = client
        self.keys = RedisKeys(key_prefix)

    def stored(self, run: str) -> dict[int, float]:
        """Positions of `run` whose transitions the broker stored, with the reward stored (an advantage, for GRPO)."""
        return self._positions(self.keys.samples, run)

    def scores(self, run: str) -> dict[int, float]:
        return self._positions(self.keys.sample_scores, run)

    def record_scores(self, scores: Mapping[str, float]) -> None:
        self.client.hset(self.keys.sample_scores, mapping=dict(scores))

    def _positions(self, key: str, run: str) -> dict[int, float]:
        out: dict[int, float] = {}
        prefix = f"{run}:"
        for name, value in self.client.hscan_iter(key, match=f"{prefix}*", count=SCAN_COUNT):
            text = name.decode() if isinstance(name, bytes) else name
            try:
                out[int(text[len(prefix) :])] = float(value)
            except ValueError:
                log.warning("%s: ignoring a malformed mark %r = %r", key, text, value)
        return out


def load_samples(run: str, marks: SampleMarks | None, grouped: bool) -> Samples:
    """The samples of `run` as earlier runs left them (nothing stored when there is no Redis to read)."""
    if marks is None:
        return Samples(run)
    return Samples(run, marks.stored(run), marks.scores(run) if grouped else {}, marks)
