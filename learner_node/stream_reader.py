"""The learner's stream reader: segments from the Redis stream through the consumer group, and their
acknowledgement once the update that consumed them is checkpointed (learner_node/worker.py says why then).

Malformed entries, segments already trained (by id) and pending entries gone from the stream are dropped and
counted here; the counters are the learner's, checkpointed with it.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable

import redis

from common.learner_figures import CyclePhase, LearnerCounter
from common.sd_notify import Notifier
from common.segments import Segment, acknowledge, ensure_group, entry_samples
from learner_node.checkpoint import RecentIds
from learner_node.config import LearnerConfig
from learner_node.cycle import CycleClock

log = logging.getLogger("learner_node.worker.stream_reader")  # under the worker's logger, as before the split

# An entry id with the sample ids of its fields (None: not known, read from the stream when acknowledged: the
# entries a resumed learner's checkpoint names).
Unacked = tuple[str, list[str] | None]


class StreamReader:
    def __init__(
        self,
        cfg: LearnerConfig,
        client: redis.Redis,
        counters: collections.Counter[str],
        seen: RecentIds,
        stop_event: threading.Event,
        notifier: Notifier,
        undurable: set[str] | None = None,
        clock: CycleClock | None = None,
    ) -> None:
        self.cfg = cfg
        self.redis = client
        self.keys = cfg.store.keys
        self.stream = self.keys.stream
        self.counters = counters
        self.seen = seen
        self.stop_event = stop_event
        self.notifier = notifier
        # trained entries waiting for a checkpoint (learner_node/checkpointer.py): pending in Redis, not read again
        self.undurable: set[str] = undurable if undurable is not None else set()
        # called between reads while a rollout is collected: the learner acknowledges what its checkpoints written
        # meanwhile hold, so that a learner waiting for data does not sit on them
        self.between_reads: Callable[[], None] = lambda: None
        self.clock = clock or CycleClock()  # the learner's cycle profile: a read that comes back empty is idle time
        self._largest_segment: int | None = None  # transitions in the largest segment read so far (see _entries_for)
        # Read positions of the rollout being collected (`collect`): own pending entries, then claimed ones.
        self._own_cursor: str | None = "0"
        self._claim_cursor: str | None = "0-0"

    def ensure_group(self) -> None:
        ensure_group(self.redis, self.keys, self.cfg.store.consumer_group)

    def collect(self) -> tuple[list[tuple[str, dict]], list[Segment]]:
        """Stream entries until `rollout_batch` transitions are in hand (or the learner is stopped).

        Every rollout reads, in this order: this consumer's own pending entries (a rollout read
        before a restart or a Redis outage, or entries delivered by a read whose reply was lost
        and which redis-py retried), entries a dead consumer left pending for `claim_idle_ms`,
        then new entries; the first two only when they hold something (`_sources`). Each source is
        read with a cursor, and an entry id is taken at most once per rollout: a pending entry is
        never trained twice, nor counted twice as stored.
        """
        entries: list[tuple[str, dict]] = []
        rollout: list[Segment] = []
        taken: set[str] = set()
        transitions = 0
        self._own_cursor, self._claim_cursor = self._sources()
        give_up = time.monotonic() + self.cfg.rollout_timeout_s if self.cfg.rollout_timeout_s else math.inf
        while transitions < self.cfg.rollout_batch and not self.stop_event.is_set():
            self.notifier.watchdog()  # waiting for data is not hanging
            self.between_reads()
            if rollout and time.monotonic() > give_up:
                log.info("rollout timeout: training on %d transitions", transitions)
                break
            with self.clock.phase(CyclePhase.READ):
                read = self._read(self._entries_for(self.cfg.rollout_batch - transitions))
                if not read:
                    self.clock.recharge(CyclePhase.IDLE)
            for entry_id, fields in read:
                if entry_id in taken or entry_id in self.undurable:
                    continue
                taken.add(entry_id)
                entries.append((entry_id, fields))
                try:
                    seg = Segment.from_entry(fields)
                except ValueError as e:  # a malformed entry must not stop training; it is acknowledged with the batch
                    log.error("stream entry %s is not a segment (%s); skipping it", entry_id, e)
                    self.counters[LearnerCounter.MALFORMED_SEGMENTS] += 1
                    continue
                if seg.seg_id in self.seen:
                    self.counters[LearnerCounter.DUPLICATE_SEGMENTS] += 1
                    continue
                rollout.append(seg)
                transitions += len(seg.transitions)
                self._largest_segment = max(self._largest_segment or 0, len(seg.transitions))
        return entries, rollout

    def _sources(self) -> tuple[str | None, str | None]:
        """The start cursors of this rollout's own pending and claimed reads; None skips a source that holds nothing
        to read, as two counts in one round trip say.

        This consumer's pending entries are mostly those it trained that wait for their checkpoint (`undurable`):
        scanning them every rollout re-read each one's fields at every update until its checkpoint was written, a
        rollout's worth with a checkpoint after every update and O(backlog) with a cadence of seconds. They are
        scanned only when the consumer holds more pending entries than those (a restart, a reply lost and retried).
        The claim scan walks the whole pending list in steps of ten times the read's COUNT; it runs only when
        some entry has been idle for `claim_idle_ms`. (A count that matches while an entry of `undurable` was
        taken over by another consumer and an unknown one is pending leaves that one to the claim scan, once idle.)"""
        group = self.cfg.store.consumer_group
        pipe = self.redis.pipeline(transaction=False)
        pipe.xpending(self.stream, group)
        pipe.xpending_range(self.stream, group, "-", "+", 1, idle=self.cfg.claim_idle_ms)
        summary, idle = pipe.execute()
        mine = sum(int(c["pending"]) for c in summary["consumers"] if _text(c["name"]) == self.cfg.consumer)
        return ("0" if mine > len(self.undurable) else None), ("0-0" if idle else None)

    def _entries_for(self, transitions: int) -> int:
        """How many stream entries to ask for when `transitions` more are wanted.

        `rollout_batch` counts transitions but XREADGROUP's COUNT counts entries (segments of up to
        the broker's segment_len). Asking for as many entries as transitions made an update of 40
        hold 596 transitions; asking for transitions // (largest segment seen) keeps an update
        within one segment of rollout_batch (one entry at a time until a segment has been seen).
        """
        if self._largest_segment is None:
            return 1
        return max(1, transitions // self._largest_segment)

    def _read(self, want: int) -> list[tuple[str, dict]]:
        """The next entries of this rollout: own pending, then claimed, then new (see `collect`)."""
        group, me, count = self.cfg.store.consumer_group, self.cfg.consumer, max(want, 1)
        if self._own_cursor is not None:
            got = self.redis.xreadgroup(group, me, {self.stream: self._own_cursor}, count=count)
            own = got[0][1] if got else []
            if own:
                self._own_cursor = _text(own[-1][0])  # pending entries after this one next time
                return self._present(own)
            self._own_cursor = None
        if self._claim_cursor is not None:
            cursor, claimed = self.redis.xautoclaim(
                self.stream, group, me, min_idle_time=self.cfg.claim_idle_ms, start_id=self._claim_cursor, count=count
            )[:2]
            self._claim_cursor = None if _text(cursor) == "0-0" else _text(cursor)
            claimed = [(i, f) for i, f in claimed if i is not None]  # Redis 6.2 lists entries deleted meanwhile as nil
            if claimed:
                log.info("took over %d segments left pending by another consumer", len(claimed))
                return self._present(claimed)
            if self._claim_cursor is not None:
                return []
        got = self.redis.xreadgroup(group, me, {self.stream: ">"}, count=count, block=self.cfg.read_block_ms)
        return self._present(got[0][1]) if got else []

    def _present(self, entries: list[tuple[bytes, dict | None]]) -> list[tuple[str, dict]]:
        """Entries that still have their fields; pending ones deleted from the stream are acknowledged (nothing to train)."""
        gone = [_text(i) for i, f in entries if not f]
        if gone:
            log.warning("%d pending stream entries are no longer in the stream (trimmed or deleted); acknowledging them", len(gone))
            self.counters[LearnerCounter.VANISHED_SEGMENTS] += len(gone)
            self.redis.xack(self.stream, self.cfg.store.consumer_group, *gone)
        return [(_text(i), f) for i, f in entries if f]

    def acknowledge(self, unacked: list[Unacked]) -> None:
        """Acknowledge and delete the entries (not needed again; the stream stays small), and count each of their
        samples once in the ledger's `P:learner:samples`, in the same atomic script (common/segments.py). Sample
        ids not known (None: entries a resumed learner's checkpoint names) are read from the stream first."""
        unknown = [entry_id for entry_id, samples in unacked if samples is None]
        if unknown:
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in unknown:
                pipe.xrange(self.stream, entry_id, entry_id)
            read = {i: entry_samples(got[0][1] if got else None) for i, got in zip(unknown, pipe.execute())}
            unacked = [(entry_id, read[entry_id] if samples is None else samples) for entry_id, samples in unacked]
        if unacked:
            acknowledge(self.redis, self.keys, self.cfg.store.consumer_group, [(i, s or []) for i, s in unacked])


def with_samples(entries: list[tuple[str, dict]]) -> list[Unacked]:
    """Entries as `acknowledge` takes them: each id with the sample ids of its fields, read once, here."""
    return [(entry_id, entry_samples(fields)) for entry_id, fields in entries]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
