"""The broker's storage path: one turn's writes in one batch, one batch in flight, replies after it.

Group commit (docs/design.md): the handlers of one loop turn stage their Redis
writes into `Outbox.batch` and their replies with `reply()`. A reply that
acknowledges state (a step's pending record, a feedback's transition, an
attach, a detach) is *durable*: it leaves only once Redis has applied every
write staged before it. `commit()` sends the staged batch when none is in
flight and sends the replies of the one that Redis has answered, so the loop
never waits for Redis. Only one batch is in flight: a failed batch never has
a successor applied on top of it, and Redis is always at a turn boundary.

When a write fails, or Redis does not answer within `storage_timeout_s`,
`commit()` raises StorageFailure; the broker then calls `fail()`, which
answers every reply not yet sent (the batch in flight and the staged ones)
with `internal`, so nothing unacknowledged is ever acknowledged, and resyncs
its sessions from Redis (broker/server.py, `_storage_lost`). Non-durable
replies (errors, ask, status, ping, replays with nothing to wait for) go at once.

The Outbox knows nothing of sessions: it owns the batch, the replies waiting
on it, the Committer, and the send of replies (with the latency the broker
added to them).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import redis
import zmq

from broker.store import Batch, Committer
from common import protocol as p
from common.stats import LatencyWindow
from common.zmqio import bound, send_frames

log = logging.getLogger(__name__)

# A reply on its way: the client's envelope, the encoded body, and when the broker's own work on it began (0: not measured).
Reply = tuple[tuple[bytes, ...], bytes, float]

STORAGE_ERROR = "storage unavailable; nothing was applied, retry with the same rid"


class StorageFailure(Exception):
    """Redis refused or did not answer the batch in flight (or the send of one): its replies must not say `ok`."""


class Outbox:
    """The staged batch and its replies, the batch in flight and its replies, and the client socket they leave by."""

    def __init__(self, redis_client: redis.Redis, storage_timeout_s: float, metrics: collections.Counter[str]) -> None:
        self.committer = Committer(redis_client)
        self.storage_timeout_s = storage_timeout_s
        self.metrics = metrics
        self.sock: zmq.Socket | None = None  # the client front end, set once it is bound
        self.batch = Batch()  # the writes staged since the last send; handlers stage into it
        self._staged: list[Reply] = []  # durable replies waiting for `batch`
        self._inflight: list[Reply] | None = None  # replies waiting for the batch Redis is applying
        self.added_latency = LatencyWindow()  # time step and feedback replies spent in the broker, actor time excluded

    @property
    def in_flight(self) -> bool:
        """True while a batch has been sent and Redis has not answered it."""
        return self._inflight is not None

    @property
    def pending(self) -> bool:
        """True while anything is staged or in flight (flush has work to do)."""
        return self._inflight is not None or bool(self._staged) or len(self.batch) > 0

    def fileno(self) -> int:
        """The write connection's socket, for the broker's poller (connects if needed; raises redis.RedisError or OSError)."""
        return self.committer.fileno()

    def reply(self, envelope: tuple[bytes, ...], body: dict[str, Any] | bytes, durable: bool = False, since: float = 0.0) -> None:
        """Send a reply; a durable one waits until the writes staged before it are in Redis.

        `since` (monotonic s), when given, is when the broker's own work on the request
        began; the time to the send is recorded as latency the broker added."""
        data = body if isinstance(body, bytes) else p.encode(body)
        if durable:
            self._staged.append((envelope, data, since))
        else:
            self._send([(envelope, data, since)])

    def commit(self, now: float) -> None:
        """Finish the batch in flight if Redis answered, then send the staged one; StorageFailure if Redis failed.

        On StorageFailure nothing is sent or cleared here: the caller answers with fail()."""
        if self._inflight is not None:
            try:
                applied = self.committer.poll()
            except (redis.RedisError, OSError) as e:
                raise StorageFailure(f"Redis write failed: {e}") from e
            if not applied:
                if now - self.committer.sent_at > self.storage_timeout_s:
                    raise StorageFailure(f"Redis did not answer a write within {self.storage_timeout_s * 1000:.0f} ms")
                return
            replies, self._inflight = self._inflight, None
            self._send(replies)
        if not self._staged and not len(self.batch):
            return
        batch, replies = self.batch, self._staged
        self.batch, self._staged = Batch(), []
        if not len(batch):
            self._send(replies)  # nothing to write (replays): only their order after earlier writes mattered
            return
        self._inflight = replies  # before the send: if it fails, these are the replies fail() must answer
        try:
            self.committer.send(batch, now)
        except (redis.RedisError, OSError) as e:
            raise StorageFailure(f"cannot send writes to Redis: {e}") from e
        self.metrics["broker/commits"] += 1

    def flush(self, timeout: float = 5.0) -> None:
        """Commit everything staged and wait for it (shutdown); StorageFailure as commit()."""
        end = time.monotonic() + timeout
        while self.pending and time.monotonic() < end:
            self.commit(time.monotonic())
            if self._inflight is not None:
                time.sleep(0.001)

    def fail(self) -> int:
        """Answer every reply not yet sent with `internal` and drop the staged writes; return how many were answered.

        The batch in flight may or may not be applied (a write that timed out may still
        land): either way its clients retry with the same rid, and the broker's replay
        of the task's recent writes (in Redis) answers a retry of one that did land."""
        unacked = (self._inflight or []) + self._staged
        self._inflight, self._staged, self.batch = None, [], Batch()
        self.committer.reset()
        self.metrics[f"errors/{p.E_INTERNAL}"] += len(unacked)
        self._send([(envelope, _storage_error(data), 0.0) for envelope, data, _ in unacked])
        return len(unacked)

    def _send(self, replies: list[Reply]) -> None:
        now = time.monotonic()
        for envelope, data, since in replies:
            try:
                send_frames(bound(self.sock, "the client front end"), (*envelope, data))
            except zmq.ZMQError:  # EHOSTUNREACH (client gone) or EAGAIN (client not reading)
                self.metrics["dropped/unroutable_replies"] += 1
                continue
            if since:
                self.added_latency.add(now - since, now)


def _storage_error(data: bytes) -> bytes:
    """The `internal` reply that replaces a reply whose writes did not reach Redis: same rid and op."""
    try:
        original = p.decode(data)
    except p.ProtocolError:
        original = {}
    return p.encode(p.error_body(original.get("rid"), original.get("op"), p.E_INTERNAL, STORAGE_ERROR))
