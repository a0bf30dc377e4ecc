"""The broker's state and its storage path, shared by the client and actor operations.

`BrokerState` holds what both sides of the broker read and change: sessions,
jobs, the step queue, counters, and the path to Redis. The storage path (the
staged batch, the one batch in flight, the replies waiting on them) is
broker/outbox.py; here is what happens when Redis fails. Wherever the broker
finds Redis failing or gone, `_storage_lost` answers what is unacknowledged
with `internal` and makes memory agree with Redis again (or hold no session
while Redis is away), so memory and Redis never disagree and nothing unstored
is acknowledged.

The operations themselves are broker/client_ops.py (the front end: attach,
step, feedback, ...) and broker/actor_ops.py (the back end: ready, results,
dispatch); broker/server.py joins them to the sockets and the loop.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import redis
import zmq

from broker.actors import ActorRegistry, Job
from broker.backlog import StreamTally
from broker.config import BrokerConfig
from broker.metrics import RateWindow, new_counters
from broker.outbox import Outbox, StorageFailure
from broker.scheduling import FairQueue
from broker.sessions import SegmentClose, Session, attach_key
from broker.store import SessionStore
from common import protocol as p
from common.learner_figures import read_latest

log = logging.getLogger(__name__)


class BrokerState:
    """Sessions, jobs and the step queue, with the storage path and the helpers both sides use."""

    def __init__(self, config: BrokerConfig, redis_client: redis.Redis) -> None:
        self.cfg = config
        self.limits = config.limits
        self.redis = redis_client
        self.store = SessionStore(redis_client, config.store.keys, config.store.consumer_group)
        self.sessions: dict[str, Session] = {}
        self.attach_rids: dict[Any, str] = {}  # (sender, attach rid) -> task_id, so a retried attach gets the same task
        self.sender = ""  # who sent the client request being handled (recv_frames_and_sender): attach keys its rid by it
        self.registry = ActorRegistry()
        self.queue = FairQueue()  # jobs waiting for an actor, taking turns between clients
        self.jobs: dict[int, Job] = {}  # every job not yet answered, queued or in flight
        self.task_jobs: dict[str, Job] = {}  # the step job in progress per task
        self.metrics: collections.Counter[str] = new_counters()  # every documented key, from 0
        self.step_rate = RateWindow()
        self.stream_length = 0  # entries (segments) in the stream, read from Redis
        self.stream_read = 0  # ... of them read by a learner, kept until its checkpoint holds them: no backlog
        self.tally = StreamTally(config.segment_len)  # the transitions of those unread (broker/backlog.py)
        # Back-pressure: `ask` answers wait while the stream holds more transitions than this (0: no limit). With
        # max_stream_backlog -1 it is what the learner publishes, re-read with the stream length.
        self.backlog_limit = max(0, self.cfg.max_stream_backlog)
        # `ask`s held while the stream backlog is over its limit: task id -> (envelope, rid, answer `wait` at), oldest first
        self.held_asks: collections.OrderedDict[str, tuple[tuple[bytes, ...], Any, float]] = collections.OrderedDict()
        self.holding_steps = False  # jobs wait in the queue for the stream backlog (dispatch): re-read it often
        self._stream_read_at = 0.0
        self.started = time.monotonic()
        self.now = time.monotonic()
        self.draining = False  # set by stop(): finish the steps in flight, take no new ones
        self.frontend: zmq.Socket | None = None  # bound by Broker.start
        self.backend: zmq.Socket | None = None
        self.outbox = Outbox(redis_client, config.storage_timeout_ms / 1000, self.metrics)
        self.storage_ok = True  # False from `_storage_lost` until `_reload` finds Redis again: writes are refused meanwhile

    # --- storage: the outbox (broker/outbox.py), and what happens when Redis fails ----------
    def reply(self, envelope: tuple[bytes, ...], body: dict[str, Any] | bytes, durable: bool = False, since: float = 0.0) -> None:
        """Send a reply; a durable one waits until the writes staged before it are in Redis (Outbox.reply)."""
        self.outbox.reply(envelope, body, durable, since)

    def commit(self) -> None:
        """Send the replies of the batch Redis applied, and the staged batch (Outbox.commit)."""
        try:
            self.outbox.commit(self.now)
        except StorageFailure as e:
            self._storage_lost(str(e), batch_failed=True)

    def flush(self, timeout: float = 5.0) -> None:
        """Commit everything staged and wait for it (shutdown)."""
        try:
            self.outbox.flush(timeout)
        except StorageFailure as e:
            self._storage_lost(str(e), batch_failed=True)

    def _storage_lost(self, why: str, batch_failed: bool = False) -> None:
        """Redis failed or is gone: nothing unacknowledged may be acknowledged, and memory must agree with Redis again.

        The one place for it, whoever finds it: a write that failed or went unanswered
        (commit, flush: `batch_failed`), the write connection that cannot connect
        (_redis_fd), a read in housekeeping (an idle broker writes nothing) or in a handler.

        1. A read that fails while a batch is in flight says nothing sure about that batch
           (it may yet be applied): its own answer, an error or none within
           storage_timeout_ms, comes through commit and calls this again. So nothing here.
        2. Every reply not yet sent (the batch in flight, the staged ones) is answered with
           `internal` first, while the writes they wait on are dropped unsent: the client
           retries with the same rid, and nothing it was not told about is applied twice.
        3. Then memory is made to agree with Redis (_reload): sessions are read back, or,
           while Redis does not answer, dropped, so that no reply can come from memory that
           may hold the failed batch's changes (the in-memory replay of a retried rid was
           one such reply: docs/reliability.md, "Redis restart"); writes are refused with
           `overloaded` until housekeeping's _reload finds Redis back.
        """
        if self.outbox.in_flight and not batch_failed:
            return
        self.metrics["errors/storage"] += 1
        answered = self.outbox.fail()
        log.error("%s; %d unacknowledged requests answered with `internal`, reloading sessions from Redis", why, answered)
        self._reload()

    def _reload(self) -> None:
        """Make memory agree with Redis again; while Redis is unreachable, hold no session and refuse writes."""
        try:
            sessions = self.store.load_sessions(self.cfg.segment_len, self.cfg.rag_history_len)
        except (redis.RedisError, OSError) as e:
            if self.storage_ok:
                log.error("Redis unreachable (%s): refusing writes with `overloaded` until it is back", e)
            self.storage_ok = False
            self.sessions, self.attach_rids = {}, {}  # they come back from Redis when it does
            return
        self._adopt(sessions)
        if not self.storage_ok:
            log.warning("Redis is back")
        self.storage_ok = True
        log.warning("reloaded %d sessions from Redis", len(self.sessions))

    def _adopt(self, sessions: dict[str, Session]) -> None:
        """Sessions read from Redis become the broker's, with the index of their attach rids."""
        self.sessions = sessions
        self.attach_rids = {attach_key(s.attach_sender, s.attach_rid): s.task_id for s in sessions.values() if s.attach_rid is not None}

    def _require_storage(self) -> None:
        if not self.storage_ok:
            raise p.ProtocolError(p.E_OVERLOADED, "storage (Redis) unavailable", retry_after_ms=self.cfg.retry_after_ms)

    def _read_stream_state(self) -> None:
        """The stream's length, and the learner's backlog limit where the broker follows it (max_stream_backlog -1)."""
        self._stream_read_at = self.now
        length, read, learner_limit = self.store.stream_state()
        self.stream_length, self.stream_read = length, read
        if self.cfg.max_stream_backlog < 0:
            self.backlog_limit = learner_limit

    @property
    def stream_transitions(self) -> int:
        """The transitions in the stream's segments no learner has read yet (broker/backlog.py): the backlog. What a
        learner has read is trained or being trained; that it stays in the stream until a checkpoint holds it delays
        nothing behind it, so counting it would hold clients back while the learner waits for them."""
        return self.tally.transitions(self.stream_length - self.stream_read)

    @property
    def over_backlog(self) -> bool:
        """The segment stream holds more transitions than the learner can train within its policy-lag bound."""
        return bool(self.backlog_limit) and self.stream_transitions > self.backlog_limit

    def _refresh_stream_state(self) -> None:
        try:
            self._read_stream_state()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            # Idle clients write nothing, so this read may be the first to find Redis gone.
            self._storage_lost(f"Redis read failed (stream length): {e}")
        except redis.RedisError as e:
            log.warning("cannot read the stream length: %s", e)

    def _learner(self) -> dict[str, float]:
        """The learner's latest update, as it left it in Redis (its version, losses); {} if none or unreadable."""
        if not self.storage_ok:  # a blocking read of a Redis known to be down would stall the loop
            return {}
        try:
            return read_latest(self.redis, self.cfg.store.key_prefix)
        except redis.RedisError:
            return {}

    # --- shared by both sides ------------------------------------------------------------------
    def _count_closed(self, closes: list[SegmentClose]) -> None:
        self.metrics["broker/segments_closed"] += len(closes)
        self.stream_length += len(closes)  # refreshed from Redis every second; counted here so back-pressure reacts at once
        for close in closes:
            self.tally.add(close.length)

    def _answer_job(self, job: Job, body: dict[str, Any]) -> None:
        """Answer every waiter of a job with an error and forget the job."""
        job.abandoned = True
        self.jobs.pop(job.job_id, None)
        if self.task_jobs.get(job.task_id) is job:
            del self.task_jobs[job.task_id]
        self.metrics[f"errors/{body['error']['code']}"] += 1
        for envelope in job.waiters:
            self.reply(envelope, body)

    def _abandon_task_job(self, task_id: str, code: str, message: str) -> None:
        job = self.task_jobs.get(task_id)
        if job is not None:
            self._answer_job(job, p.error_body(job.rid, job.mode, code, message))
