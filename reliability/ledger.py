"""The accounting invariant every reliability scenario ends with.

    feedbacks acknowledged  =  transitions stored in Redis  =  trained + dropped stale + dropped truncated

`acknowledged` is what clients were told was recorded (a feedback reply); the
learner counts what it read from the stream (`transitions_stored`) and what
became of each transition; its counters are cumulative across restarts (they
are checkpointed) and published in `<prefix>:learner:latest`. A scenario
balances the ledger once every client has detached (which closes every open
segment) and the learner has read the whole stream.
"""

from __future__ import annotations

from dataclasses import dataclass
import redis

from common import learner_figures


@dataclass(frozen=True)
class Ledger:
    acknowledged: int
    stored: int
    trained: int
    dropped_stale: int
    dropped_truncated: int
    in_stream: int  # segments written but not yet read by the learner

    @property
    def balanced(self) -> bool:
        return self.in_stream == 0 and self.acknowledged == self.stored == self.trained + self.dropped_stale + self.dropped_truncated

    def __str__(self) -> str:
        return (f"acknowledged {self.acknowledged}, stored {self.stored} = trained {self.trained} + stale {self.dropped_stale} "
                f"+ truncated {self.dropped_truncated}; {self.in_stream} segments unread")  # fmt: skip


def read_ledger(client: redis.Redis, key_prefix: str, acknowledged: int, stream_key: str = "segments") -> Ledger:
    """The ledger from Redis: the learner's counters and what is still unread or unacknowledged in the stream."""
    counters = learner_figures.counters(learner_figures.read_latest(client, key_prefix))
    # The learner deletes what it acknowledged (XACK + XDEL after its checkpoint): what is left is unread.
    unread = int(client.xlen(f"{key_prefix}:{stream_key}"))
    return Ledger(acknowledged, counters.get("transitions_stored", 0), counters.get("transitions_trained", 0),
                  counters.get("dropped_stale", 0), counters.get("dropped_truncated", 0), unread)  # fmt: skip
