"""The accounting invariant every reliability scenario ends with.

    feedbacks acknowledged  =  transitions stored in Redis  =  trained + dropped (stale, truncated, mismatched, non-finite)

`acknowledged` is what clients were told was recorded (a feedback reply); the
learner counts what it read from the stream (`transitions_stored`) and what
became of each transition; its counters are cumulative across restarts (they
are checkpointed) and published in `<prefix>:learner:latest`. Transitions of
sessions still attached sit in Redis in their open segments, not yet in the
stream: they count as stored, beside what the learner read. The ledger
balances once the learner has read the whole stream; when every client has
detached (which closes every open segment) the open part is zero.

Per sample (a feedback that named its `sample`, as `ppoz train` does): the broker's
marks say which sample ids were stored, and the learner counts each id it
acknowledged; exactly once means every stored id counted once, and no other
(`SampleLedger`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from common import learner_figures
from common.learner_figures import LearnerCounter
from common.segments import RedisKeys


@dataclass(frozen=True)
class Ledger:
    acknowledged: int
    stored: int
    trained: int
    dropped_stale: int
    dropped_truncated: int
    in_stream: int  # segments written but not yet read by the learner
    dropped_mismatched: int = 0  # scored by another run, other policy settings, or a version ahead of the learner's
    still_open: int = 0  # transitions in Redis in the open segments of sessions still attached
    learner_reported: bool = True  # the learner's figures hash exists (False: its counters are unknown, not zero)
    figures_key: str = ""
    dropped_nonfinite: int = 0  # in an update the learner undid because a loss, gradient or weight was not finite
    duplicate_samples: int = 0  # feedbacks acknowledged whose sample id was stored before: nothing stored for them

    @property
    def balanced(self) -> bool:
        return (
            self.learner_reported
            and self.in_stream == 0
            and self.acknowledged == self.stored + self.still_open + self.duplicate_samples
            and self.stored == self.trained + self.dropped_stale + self.dropped_truncated + self.dropped_mismatched + self.dropped_nonfinite
        )

    @property
    def progress(self) -> tuple[int, ...]:
        """What moves while the system works through the stream; settle_ledger waits while it changes."""
        return (
            self.stored,
            self.trained,
            self.dropped_stale,
            self.dropped_truncated,
            self.dropped_mismatched,
            self.dropped_nonfinite,
            self.in_stream,
            self.still_open,
        )

    def __str__(self) -> str:
        opened = f" + {self.still_open} in open segments" if self.still_open else ""
        if self.duplicate_samples:
            opened += f" + {self.duplicate_samples} duplicate samples (acknowledged, stored once before)"
        if not self.learner_reported:
            return (
                f"acknowledged {self.acknowledged}; the learner's side is missing: it has published no counters "
                f"({self.figures_key} is absent: no learner has started on this key prefix, or it cannot reach Redis); "
                f"{self.in_stream} segments unread{opened}"
            )
        return (
            f"acknowledged {self.acknowledged}, stored {self.stored}{opened}; {self.stored} = trained {self.trained} + stale "
            f"{self.dropped_stale} + truncated {self.dropped_truncated} + mismatched {self.dropped_mismatched} "
            f"+ non-finite {self.dropped_nonfinite}; "
            f"{self.in_stream} segments unread"
        )


def add_settle_flag(parser: argparse.ArgumentParser, default: float, until: str = " (the learner counting, the stream shrinking)") -> None:
    """`--settle-s`: how long `settle_ledger` waits for a ledger that has stopped moving (`until`: what moving is)."""
    settle_help = f"give up on the ledger once it has not moved{until} for this long (default: {default:g})"
    parser.add_argument("--settle-s", type=float, default=default, help=settle_help)


def read_ledger(client: redis.Redis, key_prefix: str, acknowledged: int, stream_key: str = "segments") -> Ledger:
    """The ledger from Redis: the learner's counters and what is still unread or unacknowledged in the stream."""
    figures = learner_figures.read_latest(client, key_prefix)
    counters = learner_figures.counters(figures)
    # The learner deletes what it acknowledged (XACK + XDEL after its checkpoint): what is left is unread.
    unread = int(client.xlen(RedisKeys(key_prefix, stream_key).stream))
    return Ledger(
        acknowledged,
        counters.get(LearnerCounter.TRANSITIONS_STORED, 0),
        counters.get(LearnerCounter.TRANSITIONS_TRAINED, 0),
        counters.get(LearnerCounter.DROPPED_STALE, 0),
        counters.get(LearnerCounter.DROPPED_TRUNCATED, 0),
        unread,
        counters.get(LearnerCounter.DROPPED_MISMATCHED, 0),
        open_transitions(client, key_prefix),
        bool(figures),
        learner_figures.latest_key(key_prefix),
        counters.get(LearnerCounter.DROPPED_NONFINITE, 0),
        int(client.get(RedisKeys(key_prefix, stream_key).duplicate_samples) or 0),
    )


@dataclass(frozen=True)
class SampleLedger:
    """Sample ids the broker stored (id -> reward stored) and how many times the learner acknowledged each."""

    stored: dict[str, float]
    trained: dict[str, int]

    @property
    def twice(self) -> dict[str, int]:
        """Ids the learner consumed more than once."""
        return {k: n for k, n in self.trained.items() if n > 1}

    @property
    def missing(self) -> list[str]:
        """Ids stored but never consumed (still in the stream, or lost)."""
        return sorted(set(self.stored) - set(self.trained))

    @property
    def unknown(self) -> list[str]:
        """Ids consumed without a mark: a transition stored outside the marking script."""
        return sorted(set(self.trained) - set(self.stored))

    @property
    def exactly_once(self) -> bool:
        return not self.twice and not self.missing and not self.unknown


def read_sample_ledger(client: redis.Redis, key_prefix: str, prefix: str = "") -> SampleLedger:
    """The sample ledger of the ids that start with `prefix` (one `ppoz train` run: "<run>:")."""
    keys = RedisKeys(key_prefix)

    def scan(key: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in client.hscan_iter(key, match=f"{prefix}*", count=1000)}

    return SampleLedger(
        {k: float(v) for k, v in scan(keys.samples).items()},
        {k: int(v) for k, v in scan(keys.samples_trained).items()},
    )


def open_transitions(client: redis.Redis, key_prefix: str) -> int:
    """Transitions stored in the open segments of live sessions (in Redis, not yet closed into the stream)."""
    keys = RedisKeys(key_prefix)
    tasks = [t.decode() for t in client.smembers(keys.tasks)]
    pipe = client.pipeline(transaction=False)
    for task_id in tasks:
        pipe.llen(keys.open_segment(task_id))
    return sum(pipe.execute()) if tasks else 0


def settle_ledger(
    client: redis.Redis,
    key_prefix: str,
    acknowledged: int,
    stall_s: float,
    still_running: Callable[[], None] | None = None,
    poll_s: float = 1.0,
) -> Ledger:
    """Wait until the learner has trained (or dropped by rule) every stored transition; the last ledger read.

    Waits as long as the ledger moves (the learner counting an update, the stream shrinking,
    segments closing) and gives up once it has not moved for `stall_s`: a slow machine takes
    longer but still moves, a stuck learner does not. `stall_s` must exceed the longest single
    update. `still_running()` is called between reads and may raise to give up early (a process died).
    """
    ledger = read_ledger(client, key_prefix, acknowledged)
    moved_at = time.monotonic()
    while not ledger.balanced:
        if time.monotonic() - moved_at > stall_s:
            return ledger
        if still_running is not None:
            still_running()
        time.sleep(poll_s)
        before, ledger = ledger, read_ledger(client, key_prefix, acknowledged)
        if ledger.progress != before.progress or ledger.learner_reported != before.learner_reported:
            moved_at = time.monotonic()
    return ledger
