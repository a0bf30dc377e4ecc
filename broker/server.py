"""The broker process: client front end, actor back end, sessions in Redis.

One thread, one loop, in the spirit of the ZeroMQ guide's Majordomo broker:

    poll both sockets (timeout: the housekeeping interval)
    drain client messages  -> on_client_*   (may stage Redis writes and replies)
    drain actor messages   -> on_actor_*    (may stage Redis writes and replies)
    housekeeping           -> deadlines, dead or hung actors, heartbeats, session expiry
    commit                 -> the turn's writes in one atomic script call, then the replies they acknowledge
    dispatch               -> queued jobs to the least loaded actors with free credits

Each message kind has one short handler, found in a table (`_client_handlers`,
`_actor_handlers`). The storage path (the staged batch, the one batch in flight,
the replies waiting on them) is broker/outbox.py. Replies that acknowledge state
leave only after Redis applied their writes. Wherever the broker finds Redis
failing or gone, `_storage_lost` answers what is unacknowledged with `internal`
and makes memory agree with Redis again (or hold no session while Redis is
away), so memory and Redis never disagree and nothing unstored is acknowledged.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import zmq

from broker.actors import MAX_ATTEMPTS, ActorRegistry, Job
from broker.config import BrokerConfig
from broker.metrics import MetricsServer, RateWindow, latency_summary, new_counters
from broker.outbox import Outbox, StorageFailure
from broker.sessions import REASON_DETACH, REASON_EXPIRED, PendingStep, Session, now_ms
from broker.store import SessionStore
from common import protocol as p
from common.learner_figures import read_latest
from common.sd_notify import Notifier
from common.security import AllowList, apply_server
from common.segments import RedisKeys
from common.shared_settings import PolicyStamp
from common.zmqio import bound, recv_frames, send_frames, split_envelope

log = logging.getLogger(__name__)

DRAIN_BATCH = 512  # messages taken from one socket per loop turn, so neither side starves the other
HOUSEKEEPING_S = 0.05
ASK_RECHECK_S = 0.01  # while asks are held: how often the stream's length is re-read from Redis
SESSION_SCAN_S = 1.0
HWM = 100_000


class Broker:
    """Routes client steps to actors and records every transition in Redis."""

    def __init__(self, config: BrokerConfig, redis_client: redis.Redis, context: zmq.Context | None = None) -> None:
        self.cfg = config
        self.limits = config.limits
        self.store = SessionStore(redis_client, RedisKeys(config.key_prefix, config.stream_key), config.consumer_group)
        self.ctx = context or zmq.Context.instance()
        self.sessions: dict[str, Session] = {}
        self.attach_rids: dict[Any, str] = {}  # attach rid -> task_id, so a retried attach gets the same task
        self.registry = ActorRegistry()
        self.queue: collections.deque[Job] = collections.deque()
        self.jobs: dict[int, Job] = {}  # every job not yet answered, queued or in flight
        self.task_jobs: dict[str, Job] = {}  # the step job in progress per task
        self.metrics: collections.Counter[str] = new_counters()  # every documented key, from 0
        self.stream_length = 0
        # Back-pressure: `ask` answers wait while the stream holds more than this (0: no limit). With
        # max_stream_backlog -1 it is what the learner publishes, re-read with the stream length.
        self.backlog_limit = max(0, self.cfg.max_stream_backlog)
        # `ask`s held while the stream backlog is over its limit (envelope, rid, task id, answer `wait` at), oldest first
        self.held_asks: collections.deque[tuple[tuple[bytes, ...], Any, str, float]] = collections.deque()
        self._stream_read_at = 0.0
        self.started = time.monotonic()
        self.now = time.monotonic()
        self.running = False
        self.draining = False  # set by stop(): finish the steps in flight, take no new ones
        self.notifier = Notifier()  # systemd's notify socket, when run under systemd
        self._next_status = 0.0
        self.redis = redis_client
        self.step_rate = RateWindow()
        self.metrics_server: MetricsServer | None = None
        self.frontend: zmq.Socket | None = None
        self.backend: zmq.Socket | None = None
        self.frontend_endpoint = ""
        self.backend_endpoint = ""
        self.allow_lists: list[AllowList] = []  # CURVE: the ZAP checks of both sockets, closed with them
        self.outbox = Outbox(redis_client, config.storage_timeout_ms / 1000, self.metrics)
        self.storage_ok = True  # False from `_storage_lost` until `_reload` finds Redis again: writes are refused meanwhile
        self._next_housekeeping = 0.0
        self._next_session_scan = 0.0
        self._client_handlers: dict[str, Callable[[tuple[bytes, ...], Any, dict], None]] = {
            p.OP_ATTACH: self.on_attach,
            p.OP_DETACH: self.on_detach,
            p.OP_ASK: self.on_ask,
            p.OP_STEP: self.on_step,
            p.OP_RAG_STEP: self.on_step,
            p.OP_GENERATE: self.on_step,
            p.OP_FEEDBACK: self.on_feedback,
            p.OP_STATUS: self.on_status,
            p.OP_PING: self.on_ping,
        }
        # Actor messages: every op but `ready` comes from a registered actor (see on_actor_frames).
        self._actor_handlers: dict[str, Callable[[bytes, dict[str, Any]], None]] = {
            p.OP_READY: self.on_actor_ready,
            p.OP_HEARTBEAT: self.on_actor_heartbeat,
            p.OP_RESULT: self.on_actor_results,
            p.OP_DISCONNECT: self.on_actor_disconnect,
        }

    # --- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load sessions from Redis, create the stream, bind both sockets."""
        self.store.ensure_stream()
        self._adopt(self.store.load_sessions(self.cfg.segment_len, self.cfg.rag_history_len))
        if self.sessions:
            log.info(
                "recovered %d sessions from Redis (%d with a pending step)",
                len(self.sessions),
                sum(s.pending is not None for s in self.sessions.values()),
            )
        self._read_stream_state()
        self.frontend = self._router(self.cfg.frontend, self.cfg.max_message_bytes, "clients", self.cfg.curve_allowed_clients)
        self.outbox.sock = self.frontend
        self.backend = self._router(self.cfg.backend, self.cfg.max_message_bytes, "actors", self.cfg.curve_allowed_actors)
        self.frontend_endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("broker ready: clients on %s, actors on %s", self.frontend_endpoint, self.backend_endpoint)
        if self.cfg.metrics_bind:
            self.metrics_server = MetricsServer(self.cfg.metrics_bind).start()
        self.notifier.ready(f"clients on {self.frontend_endpoint}, actors on {self.backend_endpoint}")

    def _router(self, endpoint: str, max_message_bytes: int, name: str = "", allowed: str = "") -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Tell us when a reply has nowhere to go, rather than dropping it silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        # Messages over the configured limit get a `too_large` reply; ones far over it
        # are refused by libzmq itself (the peer is disconnected) so they never fill memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes + 65536)
        if self.cfg.curve_secret_key:  # before bind: a peer's security mechanism is fixed when it connects
            self.allow_lists.append(apply_server(sock, self.cfg.curve_secret_key, allowed, f"broker {name}"))
        sock.bind(endpoint)
        return sock

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Serve until stop() is called (or `until()` returns true)."""
        if self.frontend is None:
            self.start()
        frontend, backend = bound(self.frontend, "the client front end"), bound(self.backend, "the actor back end")
        poller = zmq.Poller()
        poller.register(frontend, zmq.POLLIN)
        poller.register(backend, zmq.POLLIN)
        redis_fd = None
        self.running = True
        drain_until = 0.0
        try:
            while self.running and not (until and until()):
                if self.draining:
                    if not drain_until:
                        drain_until = time.monotonic() + self.cfg.drain_timeout_s
                        self.notifier.stopping(f"draining {len(self.jobs)} steps in flight")
                        log.info("stopping: %d steps in flight, %d queued; new steps are refused", len(self.jobs), len(self.queue))
                    if not self.jobs or time.monotonic() > drain_until:
                        break
                # Wake up for Redis's answer too, so replies leave as soon as their batch is applied.
                fd = self._redis_fd()
                if fd != redis_fd:
                    if redis_fd is not None:
                        poller.unregister(redis_fd)
                    if fd is not None:
                        poller.register(fd, zmq.POLLIN)
                    redis_fd = fd
                events = dict(poller.poll(int((ASK_RECHECK_S if self.held_asks else HOUSEKEEPING_S) * 1000)))
                self.now = time.monotonic()
                if frontend in events:
                    self._drain(frontend, self.on_client_frames)
                if backend in events:
                    self._drain(backend, self.on_actor_frames)
                if self.now >= self._next_housekeeping:
                    self.housekeeping()
                self.release_asks()
                self.commit()
                self.dispatch()
        finally:
            self.release_asks(closing=True)
            self.flush()
            self.close()

    def _redis_fd(self) -> int | None:
        """The write connection's socket, connecting if needed; None while Redis is down."""
        if not self.storage_ok:
            return None
        try:
            return self.outbox.fileno()
        except (redis.RedisError, OSError) as e:  # went away after the last reload: refuse writes until it is back
            self._storage_lost(f"cannot connect to Redis: {e}")
            return None

    def stop(self) -> None:
        """Drain and return: refuse new steps, answer those in flight (up to drain_timeout_s), flush to Redis.

        Safe from a signal handler: it only sets a flag the loop reads."""
        self.draining = True

    def close(self) -> None:
        for sock in (self.frontend, self.backend):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        for allow_list in self.allow_lists:  # after the sockets: the last one stops the context's ZAP handler
            allow_list.close()
        self.allow_lists.clear()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            handle(frames)

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
        self.attach_rids = {_key(s.attach_rid): s.task_id for s in sessions.values() if s.attach_rid is not None}

    def _require_storage(self) -> None:
        if not self.storage_ok:
            raise p.ProtocolError(p.E_OVERLOADED, "storage (Redis) unavailable", retry_after_ms=self.cfg.retry_after_ms)

    # --- client front end -------------------------------------------------------------------
    def on_client_frames(self, frames: list[bytes]) -> None:
        """Split the envelope, decode, check, and hand the request to its handler."""
        self.metrics["broker/requests"] += 1  # every message, well framed or not
        split = split_envelope(frames)
        if split is None:
            self.metrics["dropped/malformed_frames"] += 1
            return
        envelope, body = split
        msg: dict[str, Any] = {}
        try:
            if len(body) > self.limits.max_message_bytes:
                raise p.ProtocolError(p.E_TOO_LARGE, f"message is {len(body)} bytes, the limit is {self.limits.max_message_bytes}")
            msg = p.decode(body)
            op, rid = p.check_header(msg)
            handler = self._client_handlers.get(op)
            if handler is None:
                raise p.ProtocolError(p.E_UNKNOWN_OP, f"unknown op {op!r}; known: {', '.join(sorted(p.CLIENT_OPS))}")
            handler(envelope, rid, msg)
        except p.ProtocolError as e:
            self._error(envelope, msg or p.read_header(body), e)  # unread (too large, undecodable): its rid, if it has one
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:  # a handler's read (detach's tombstone) found Redis gone
            self._storage_lost(f"Redis read failed: {e}")
            self._error(
                envelope, msg, p.ProtocolError(p.E_OVERLOADED, "storage (Redis) unavailable", retry_after_ms=self.cfg.retry_after_ms)
            )
        except Exception:
            log.exception("internal error on a %r request", msg.get("op"))
            self._error(envelope, msg, p.ProtocolError(p.E_INTERNAL, "the broker failed on this request; see its log"))

    def _error(self, envelope: tuple[bytes, ...], msg: dict[str, Any], e: p.ProtocolError) -> None:
        """An error reply: the request's rid (nil when none can be read) and op, never a task_id."""
        self.metrics[f"errors/{e.code}"] += 1
        rid = msg.get("rid")
        rid = rid if p.readable_rid(rid) else None
        extra = dict(e.extra)
        if e.code == p.E_UNSUPPORTED_VERSION:
            extra["supported"] = [p.PROTOCOL_VERSION]
        self.reply(envelope, p.error_body(rid, msg.get("op"), e.code, e.message, **extra))

    def _session(self, msg: dict[str, Any]) -> Session:
        task_id = p.check_task_id(msg)
        session = self.sessions.get(task_id)
        if session is None:
            raise p.ProtocolError(p.E_UNKNOWN_TASK, f"no session {task_id!r}: never attached, detached, or expired; attach again")
        session.last_seen_ms = now_ms()
        return session

    def on_attach(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """attach: open a session (or resume one by the client's own task_id)."""
        self._require_storage()
        task_id = p.check_optional_task_id(msg)
        if task_id is None:
            task_id = self.attach_rids.get(_key(rid)) or uuid.uuid4().hex
        session = self.sessions.get(task_id)
        resumed = session is not None
        if session is None:
            session = Session(task_id, self.cfg.segment_len, attach_rid=rid, epoch=uuid.uuid4().hex[:12])
            self.sessions[task_id] = session
            self.attach_rids[_key(rid)] = task_id
            self.store.stage_create(self.outbox.batch, session)
            self.metrics["broker/attached"] += 1
        session.last_seen_ms = now_ms()
        body = p.header(p.OP_ATTACH, rid)
        body.update(status="attached", task_id=task_id, resumed=resumed and session.attach_rid != rid)
        self.reply(envelope, body, durable=True)

    def on_detach(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """detach: close the open segment (truncated) and forget the session; a retried detach gets the first reply."""
        self._require_storage()
        task_id = p.check_task_id(msg)
        session = self.sessions.get(task_id)
        if session is None:
            replay = self.store.detach_reply(task_id, rid)
            if replay is None:
                raise p.ProtocolError(p.E_UNKNOWN_TASK, f"no session {task_id!r} to detach")
            self.reply(envelope, replay)
            return
        had_pending = session.pending is not None
        closed = self._end_session(session, REASON_DETACH, "the task was detached while its step was being scored")
        body = p.header(p.OP_DETACH, rid)
        body.update(status="detached", task_id=task_id, segments_closed=closed, dropped_pending_step=had_pending)
        data = p.encode(body)
        self.store.stage_tombstone(self.outbox.batch, task_id, rid, data)
        self.metrics["broker/detached"] += 1
        self.reply(envelope, data, durable=True)

    def _end_session(self, session: Session, reason: str, why: str) -> int:
        """End a session (detach, expiry): close its open segment, stage its deletion, forget it; return segments closed.

        A step of the task still waiting for an actor is answered `unknown_task` (`why`)
        and its late result dropped; the pending step, if any, is dropped (its observation
        is the closed segment's next_obs). An empty open segment closes nothing (0)."""
        closes = session.flush(reason)
        for close in closes:
            self.store.stage_close(self.outbox.batch, session, close)
        self.store.stage_delete(self.outbox.batch, session)
        self._abandon_task_job(session.task_id, p.E_UNKNOWN_TASK, why)
        del self.sessions[session.task_id]
        self.attach_rids.pop(_key(session.attach_rid), None)
        self._count_closed(len(closes))
        return len(closes)

    def on_ask(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """ask: may the client step now? `wait` with retry_after_ms under back-pressure; no effect, so answered afresh every time."""
        if not self.storage_ok:  # sessions are reloaded when Redis is back; until then, nobody may step
            body = p.header(p.OP_ASK, rid)
            body.update(task_id=p.check_task_id(msg), status="wait", retry_after_ms=self.cfg.retry_after_ms, reason="storage")
            self.metrics["broker/ask_wait"] += 1
            self.reply(envelope, body)
            return
        session = self._session(msg)
        reason = self._backpressure()
        body = p.header(p.OP_ASK, rid)
        body["task_id"] = session.task_id
        if reason == "stream_backlog" and self.cfg.ask_hold_ms:  # answered by release_asks once the learner has read
            self.held_asks.append((envelope, rid, session.task_id, self.now + self.cfg.ask_hold_ms / 1000))
            return
        if reason:
            body.update(status="wait", retry_after_ms=self.cfg.retry_after_ms, reason=reason)
            self.metrics["broker/ask_wait"] += 1
        else:
            body["status"] = "ok"
        self.reply(envelope, body)

    def release_asks(self, closing: bool = False) -> None:
        """Answer the held asks: all `ok` once the stream backlog is under its limit (re-read every ASK_RECHECK_S
        while any is held, so clients resume within moments of the learner's read instead of a retry_after_ms
        sleep); `wait` to those held ask_hold_ms, with retry_after_ms 1 (ask again at once: a long poll), or with
        the usual retry_after_ms once another reason holds (draining, no actor, ...) or the broker is closing."""
        if not self.held_asks:
            return
        if not closing and self.now - self._stream_read_at >= ASK_RECHECK_S:
            self._refresh_stream_state()
        reason = "draining" if closing else "storage" if not self.storage_ok else self._backpressure()
        while self.held_asks:
            envelope, rid, task_id, until = self.held_asks[0]
            if reason == "stream_backlog" and until > self.now:
                return  # the oldest is not due yet, nor is any younger one
            self.held_asks.popleft()
            body = p.header(p.OP_ASK, rid)
            body.update(task_id=task_id, status="ok")
            if reason:
                retry = 1 if reason == "stream_backlog" else self.cfg.retry_after_ms
                body.update(status="wait", retry_after_ms=retry, reason=reason)
                self.metrics["broker/ask_wait"] += 1
            self.reply(envelope, body)

    def _count_closed(self, n: int) -> None:
        self.metrics["broker/segments_closed"] += n
        self.stream_length += n  # refreshed from Redis every second; counted here so back-pressure reacts at once

    def _read_stream_state(self) -> None:
        """The stream's length, and the learner's backlog limit where the broker follows it (max_stream_backlog -1)."""
        self._stream_read_at = self.now
        length, learner_limit = self.store.stream_state()
        self.stream_length = length
        if self.cfg.max_stream_backlog < 0:
            self.backlog_limit = learner_limit

    def _backpressure(self) -> str:
        if self.draining:
            return "draining"
        if not self.registry.actors:
            return "no_actor"
        if len(self.queue) >= self.cfg.max_queue:
            return "queue_full"
        if self.backlog_limit and self.stream_length > self.backlog_limit:
            return "stream_backlog"
        return ""

    def on_step(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """step / rag_step / generate: queue the request for an actor; the reply comes with the result."""
        self._require_storage()  # before any session lookup: while Redis is down, sessions are not in memory
        session = self._session(msg)
        replay = session.replay(rid)
        if replay is not None:
            self.metrics["broker/replayed"] += 1
            self.reply(envelope, replay, durable=True)  # after the original's writes
            return
        running = self.task_jobs.get(session.task_id)
        if running is not None and _key(running.rid) == _key(rid):
            running.waiters.append(envelope)  # a retry of a step still being scored
            self.metrics["broker/joined_retries"] += 1
            return
        generate = msg["op"] == p.OP_GENERATE
        obs = p.check_generate(msg, self.limits) if generate else p.check_obs(msg, self.limits)
        if self.draining:  # shutting down: no new work; the client's retry reaches the restarted broker
            raise p.ProtocolError(
                p.E_OVERLOADED, "the broker is shutting down; retry with the same rid", retry_after_ms=self.cfg.retry_after_ms
            )
        if len(self.queue) >= self.cfg.max_queue:
            raise p.ProtocolError(p.E_OVERLOADED, f"{len(self.queue)} steps are queued", retry_after_ms=self.cfg.retry_after_ms)
        if running is not None:  # the client gave up on its previous step and sent a new one
            self._abandon_task_job(session.task_id, p.E_TIMEOUT, "superseded by a newer step of the same task")
        longest = self.cfg.generate_timeout_ms if generate else self.cfg.request_timeout_ms
        deadline_ms = p.optional(msg, "deadline_ms", int, "a positive int (milliseconds)", longest)
        if deadline_ms <= 0:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`deadline_ms` must be positive, got {deadline_ms}")
        deadline_ms = min(deadline_ms, longest)
        job = Job(
            self.registry.next_job_id(),
            session.task_id,
            msg["op"],
            rid,
            obs,
            [envelope],
            deadline=self.now + deadline_ms / 1000,
            created=self.now,
        )
        self.jobs[job.job_id] = job
        self.task_jobs[session.task_id] = job
        self.queue.append(job)

    def on_feedback(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """feedback: the reward of the pending step; acknowledged once the transition is in Redis."""
        self._require_storage()
        session = self._session(msg)
        replay = session.replay(rid)
        if replay is not None:
            self.metrics["broker/replayed"] += 1
            self.reply(envelope, replay, durable=True)
            return
        reward = p.check_reward(msg, self.limits.max_abs_reward)
        done = p.optional(msg, "done", bool, "a bool", False)
        truncated = p.optional(msg, "truncated", bool, "a bool", False)
        sample = p.check_sample(msg)
        next_obs = None
        given = msg.get("next_obs")
        if given is not None and not isinstance(given, dict):
            raise p.ProtocolError(
                p.E_BAD_REQUEST,
                f"`next_obs` must be a map (an observation) or nil, got {type(given).__name__}; nothing was recorded,"
                " the step still waits for its feedback",
            )
        if given:  # older Kea clients send next_obs: {}, which is ignored
            next_obs = p.check_obs(msg, self.limits, name="next_obs")
        if session.pending is None:
            self.metrics["broker/feedback_without_step"] += 1
            raise p.ProtocolError(p.E_FEEDBACK_WITHOUT_STEP, f"task {session.task_id!r} has no step waiting for a reward; nothing recorded")
        step = session.pending
        transition, closes = session.record_feedback(reward, done, truncated, next_obs, sample)
        if step.mode == p.OP_RAG_STEP and self.cfg.rag_history_len:
            entry = step.history_entry(reward, self.cfg.rag_history_chars)
            session.history = (session.history + [entry])[-self.cfg.rag_history_len :]
            self.store.stage_history(self.outbox.batch, session, entry, self.cfg.rag_history_len)
        body = p.header(p.OP_FEEDBACK, rid)
        body.update(status="ok", task_id=session.task_id, segment_closed=bool(closes))
        data = p.encode(body)
        self.store.stage_transition(self.outbox.batch, session, transition, session.remember(rid, data))
        for close in closes:
            self.store.stage_close(self.outbox.batch, session, close)
        self.metrics["broker/feedbacks"] += 1
        self._count_closed(len(closes))
        self.reply(envelope, data, durable=True, since=self.now)

    def on_status(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """status: the broker's figures, for `ppoz status`; `window_s` picks the latency window (default 60 s)."""
        window = p.optional(msg, "window_s", (int, float), "a positive number of seconds", 60.0)
        if window <= 0:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`window_s` must be positive, got {window}")
        body = p.header(p.OP_STATUS, rid)
        body.update(status="ok", **self.status(window))
        self.reply(envelope, body)

    def on_ping(self, envelope: tuple[bytes, ...], rid: Any, msg: dict[str, Any]) -> None:
        """ping: liveness check; no session needed."""
        body = p.header(p.OP_PING, rid)
        body.update(status="ok", time_ms=now_ms())
        self.reply(envelope, body)

    def status_line(self) -> str:
        """The key figures in one line (systemd's STATUS=)."""
        return (
            f"{len(self.sessions)} sessions, {len(self.registry.actors)} actors, {len(self.jobs)} steps in flight, "
            f"{len(self.queue)} queued, {self.metrics['broker/steps']} steps, stream backlog {self.stream_length}"
            + ("" if self.storage_ok else ", REDIS DOWN")
        )

    def status(self, window_s: float = 60.0) -> dict[str, Any]:
        """The `status` reply's figures (docs/protocol.md, section 3, lists each)."""
        return {
            "added_latency": latency_summary(self.outbox.added_latency, window_s),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "sessions": len(self.sessions),
            "pending_steps": sum(s.pending is not None for s in self.sessions.values()),
            "queued_jobs": len(self.queue),
            "jobs": len(self.jobs),
            "stream_length": self.stream_length,
            "stream_backlog_limit": self.backlog_limit,
            "storage_ok": self.storage_ok,
            "actors": [
                {"name": a.name, "credits": a.credits, "inflight": len(a.inflight), "policy_version": a.policy_version, "served": a.served}
                for a in self.registry.actors.values()
            ],
            "counters": dict(self.metrics),
            "steps_per_s": round(self.step_rate.rate(), 3),
            "learner": self._learner(),
            "limits": dataclasses.asdict(self.limits),
        }

    def _learner(self) -> dict[str, float]:
        """The learner's latest update, as it left it in Redis (its version, losses); {} if none or unreadable."""
        if not self.storage_ok:  # a blocking read of a Redis known to be down would stall the loop
            return {}
        try:
            return read_latest(self.redis, self.cfg.key_prefix)
        except redis.RedisError:
            return {}

    # --- actor back end --------------------------------------------------------------------
    def on_actor_frames(self, frames: list[bytes]) -> None:
        """Messages from actors (ready, heartbeat, result, disconnect): decode, check, hand to the op's handler.

        Every op but `ready` must come from a registered actor; an unknown one (say, after a
        broker restart) is told `disconnect`, which makes it announce itself again."""
        if len(frames) != 2:
            self.metrics["dropped/malformed_actor_frames"] += 1
            return
        identity, body = frames
        try:
            msg = p.decode(body)
            if msg.get("proto") != p.PROTOCOL_ID or msg.get("v") != p.PROTOCOL_VERSION:
                raise p.ProtocolError(p.E_UNSUPPORTED_VERSION, f"actor speaks proto={msg.get('proto')!r} v={msg.get('v')!r}")
            op = msg.get("op")
            handler = self._actor_handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise p.ProtocolError(p.E_UNKNOWN_OP, f"unknown actor op {op!r}")
            if op != p.OP_READY:
                actor = self.registry.get(identity)
                if actor is None:
                    self._send_actor(identity, p.header(p.OP_DISCONNECT))
                    return
                actor.last_heard = self.now
            handler(identity, msg)
        except p.ProtocolError as e:
            self.metrics["dropped/bad_actor_messages"] += 1
            log.warning("bad message from actor %r: %s", identity, e)

    def on_actor_heartbeat(self, identity: bytes, msg: dict[str, Any]) -> None:
        """heartbeat: the actor is alive (on_actor_frames noted it) and says which policy version it serves."""
        version = msg.get("policy_version")
        if isinstance(version, int) and not isinstance(version, bool):
            self.registry.actors[identity].policy_version = version

    def on_actor_results(self, identity: bytes, msg: dict[str, Any]) -> None:
        """result: the outcome of some of the actor's jobs, each handled on its own."""
        for result in p.require(msg, "results", list, "an array of result maps"):
            if isinstance(result, dict):
                self.on_job_result(identity, result)
            else:
                self.metrics["dropped/bad_actor_messages"] += 1

    def on_actor_disconnect(self, identity: bytes, msg: dict[str, Any]) -> None:
        """disconnect: the actor leaves; the jobs it held go back to the front of the queue."""
        log.info("actor %s disconnected", self.registry.actors[identity].name)
        self._requeue(self.registry.remove(identity))

    def on_actor_ready(self, identity: bytes, msg: dict[str, Any]) -> None:
        credits = p.require(msg, "credits", int, "a positive int")
        if credits <= 0:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`credits` must be positive, got {credits}")
        name = str(msg.get("name") or identity.hex())
        version = msg.get("policy_version")
        # Heartbeat intervals may differ between broker and actor configs: judge the
        # actor by the slower of the two, or a slow-beating actor would flap.
        beat = msg.get("heartbeat_ms")
        beat_s = max(self.cfg.heartbeat_ms, beat if isinstance(beat, int) and beat > 0 else 0) / 1000
        orphans = self.registry.register(identity, name, credits, version if isinstance(version, int) else -1, self.now, beat_s)
        self._requeue(orphans)
        log.info("actor %s ready with %d credits (policy version %s)", name, credits, version)

    def on_job_result(self, identity: bytes, msg: dict[str, Any]) -> None:
        """One job's result: record the pending step and answer the client once it is in Redis.

        The result of a job already answered (timeout, superseded, detached: `abandoned`) or
        unknown is dropped (jobs/late_results): nothing of it is recorded."""
        actor = self.registry.get(identity)
        job_id = msg.get("job")
        job = actor.inflight.pop(job_id, None) if actor is not None and isinstance(job_id, int) else None
        if actor is None or job is None:
            self.metrics["jobs/late_results"] += 1
            return
        actor.served += 1
        self.jobs.pop(job.job_id, None)
        if self.task_jobs.get(job.task_id) is job:
            del self.task_jobs[job.task_id]
        if job.abandoned:
            self.metrics["jobs/late_results"] += 1
            return
        if "error" in msg:
            error = msg["error"] if isinstance(msg["error"], dict) else {}
            code = error["code"] if error.get("code") in p.ERROR_CODES else p.E_INTERNAL
            extra = {"retry_after_ms": self.cfg.retry_after_ms} if code == p.E_OVERLOADED else {}  # `overloaded` always says when
            self._answer_job(job, p.error_body(job.rid, job.mode, code, f"actor {actor.name}: {error.get('message', 'failed')}", **extra))
            return
        try:
            step = self._checked_result(job, msg)
        except p.ProtocolError as e:
            log.error("actor %s sent an invalid result: %s", actor.name, e.message)
            self.metrics["errors/bad_actor_result"] += 1
            self._answer_job(job, p.error_body(job.rid, job.mode, p.E_INTERNAL, f"actor {actor.name} returned an invalid result"))
            return
        if not self.storage_ok:
            self._answer_job(
                job, p.error_body(job.rid, job.mode, p.E_OVERLOADED, "storage (Redis) unavailable", retry_after_ms=self.cfg.retry_after_ms)
            )
            return
        session = self.sessions.get(job.task_id)
        if session is None:
            self._answer_job(job, p.error_body(job.rid, job.mode, p.E_UNKNOWN_TASK, f"task {job.task_id!r} went away while scored"))
            return
        closes, orphaned = session.record_step(step)
        for close in closes:
            self.store.stage_close(self.outbox.batch, session, close)
        self.store.stage_pending(self.outbox.batch, session, session.remember(step.rid, step.reply))
        self.metrics["broker/steps"] += 1
        self.metrics["broker/orphan_steps"] += orphaned
        self._count_closed(len(closes))
        # Broker time of a step: its wait for an actor, plus the time since the result came back.
        since = self.now - (job.dispatched_at - job.created)
        for envelope in job.waiters:
            self.reply(envelope, step.reply, durable=True, since=since)

    def _checked_result(self, job: Job, msg: dict[str, Any]) -> PendingStep:
        stamp = None
        if msg.get("policy") is not None:
            try:
                stamp = PolicyStamp.from_wire(p.require(msg, "policy", dict, "a map (the policy stamp)")).to_wire()
            except ValueError as e:
                raise p.ProtocolError(p.E_BAD_REQUEST, str(e)) from None
        if job.mode == p.OP_GENERATE:
            return self._checked_generation(job, msg, stamp)
        n = len(job.obs["action"])
        action = p.require(msg, "action", int, "an int")
        if not 0 <= action < n:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"action {action} out of range for {n} candidates")
        logprob = float(p.require(msg, "logprob", (int, float), "a number"))
        probs = p.require(msg, "probs", list, "an array of numbers")
        if len(probs) != n or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in probs):
            raise p.ProtocolError(p.E_BAD_REQUEST, f"probs must be {n} numbers")
        version = p.require(msg, "policy_version", int, "an int")
        body = p.header(job.mode, job.rid)
        body.update(
            task_id=job.task_id, status="ok", action=action, logprob=logprob, probs=[float(x) for x in probs], policy_version=version
        )
        obs, context = job.obs, ""
        if job.mode == p.OP_RAG_STEP:  # the actor scored the client's prompt + `context`; that is what the learner must see
            context = p.optional(msg, "context", str, "a str (the text appended to the prompt)", "")
            if len(context) > self.cfg.rag_max_context_chars:
                raise p.ProtocolError(
                    p.E_TOO_LARGE, f"`context` has {len(context)} characters, the limit is {self.cfg.rag_max_context_chars}"
                )
            retrieved = p.optional(msg, "retrieved", list, "an array of str", [])
            if not all(isinstance(x, str) for x in retrieved):
                raise p.ProtocolError(p.E_BAD_REQUEST, "`retrieved` must be an array of strings")
            if context:
                obs = dict(job.obs, prompt=job.obs["prompt"] + context)
            body["retrieved"] = retrieved
        elif "context" in msg:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"a retrieval `context` came back for a {job.mode} job")
        return PendingStep(job.rid, job.mode, obs, action, logprob, body["probs"], version, now_ms(), p.encode(body), len(context), stamp)

    def _checked_generation(self, job: Job, msg: dict[str, Any], stamp: dict[str, Any] | None) -> PendingStep:
        """A generate job's result: the response, its tokens and their log-probabilities, checked against the request."""
        text = p.require(msg, "text", str, "a str")
        prompt_ids = _token_ids(msg, "prompt_ids")
        response_ids = _token_ids(msg, "response_ids")
        budget = job.obs["sampling"]["max_new_tokens"]
        if len(response_ids) > budget:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"{len(response_ids)} response tokens for a budget of {budget}")
        logprobs = p.require(msg, "logprobs", list, "an array of numbers")
        if len(logprobs) != len(response_ids) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 and x > -float("inf") for x in logprobs
        ):
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`logprobs` must be {len(response_ids)} finite numbers <= 0, one per response token")
        finish = p.require(msg, "finish_reason", str, "eos, stop or length")
        if finish not in p.FINISH_REASONS:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`finish_reason` must be one of {', '.join(p.FINISH_REASONS)}, got {finish!r}")
        version = p.require(msg, "policy_version", int, "an int")
        sampling = job.obs["sampling"]
        logprob = float(sum(logprobs))
        body = p.header(job.mode, job.rid)
        body.update(
            task_id=job.task_id,
            status="ok",
            text=text,
            n_tokens=len(response_ids),
            finish_reason=finish,
            logprob=logprob,
            policy_version=version,
        )
        generation = {
            "response_ids": response_ids,
            "logprobs": [float(x) for x in logprobs],
            "finish_reason": finish,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
        }
        obs = {"prompt_ids": prompt_ids, "sampling": sampling}
        return PendingStep(job.rid, job.mode, obs, 0, logprob, [], version, now_ms(), p.encode(body), 0, stamp, generation)

    def _send_actor(self, identity: bytes, body: dict[str, Any]) -> bool:
        try:
            send_frames(bound(self.backend, "the actor back end"), (identity, p.encode(body)))
        except zmq.ZMQError:
            self.metrics["dropped/unroutable_actor_messages"] += 1
            return False
        actor = self.registry.get(identity)
        if actor is not None:
            actor.last_sent = self.now
        return True

    # --- dispatch ----------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Hand queued jobs to the least loaded actors, within their credits, one message per actor."""
        batches: dict[bytes, list[dict[str, Any]]] = {}
        while self.queue:
            actor = self.registry.pick()
            if actor is None:
                break
            job = self.queue.popleft()
            if job.abandoned:
                continue
            job.actor, job.dispatched_at = actor.identity, self.now
            actor.inflight[job.job_id] = job
            message = {
                "job": job.job_id,
                "task_id": job.task_id,
                "mode": job.mode,
                "obs": job.obs,
                "deadline_ms": max(1, int((job.deadline - self.now) * 1000)),
            }
            if job.mode == p.OP_RAG_STEP:  # the task's own history travels with the job: any actor can serve any task
                session = self.sessions.get(job.task_id)
                message["history"] = session.history if session is not None else []
            batches.setdefault(actor.identity, []).append(message)
        for identity, jobs in batches.items():
            body = p.header(p.OP_SCORE)
            body["jobs"] = jobs
            if not self._send_actor(identity, body):
                actor = self.registry.get(identity)
                log.warning("actor %s is unreachable; dropping it", actor.name if actor else identity)
                self._requeue(self.registry.remove(identity))

    def _requeue(self, jobs: list[Job]) -> None:
        """Put the jobs of a lost actor at the front of the queue (oldest first)."""
        for job in sorted(jobs, key=lambda j: j.created, reverse=True):
            job.attempts += 1
            job.actor = None
            if job.attempts >= MAX_ATTEMPTS:
                self._answer_job(job, p.error_body(job.rid, job.mode, p.E_INTERNAL, f"{job.attempts} actors failed on this observation"))
                continue
            self.metrics["jobs/requeued"] += 1
            self.queue.appendleft(job)

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

    # --- housekeeping --------------------------------------------------------------------------
    def housekeeping(self) -> None:
        """Deadlines, dead and hung actors, heartbeats; session expiry once a second."""
        now = self.now
        self._next_housekeeping = now + HOUSEKEEPING_S
        for job in [j for j in self.jobs.values() if j.deadline <= now]:
            self._answer_job(
                job,
                p.error_body(
                    job.rid,
                    job.mode,
                    p.E_TIMEOUT,
                    "no answer within the deadline" + ("" if self.registry.actors else " (no actor connected)"),
                ),
            )
        heartbeat = self.cfg.heartbeat_ms / 1000
        for actor in self.registry.silent(now, self.cfg.heartbeat_liveness):
            log.warning(
                "actor %s silent for %.1f s: taken as dead, %d jobs requeued", actor.name, now - actor.last_heard, len(actor.inflight)
            )
            self.metrics["actors/dead"] += 1
            self._requeue(self.registry.remove(actor.identity))
        for actor in self.registry.stuck(now, self.cfg.actor_job_timeout_ms / 1000):
            log.warning(
                "actor %s held a job over %d ms (a generate job: past its deadline): taken as hung, %d jobs requeued",
                actor.name,
                self.cfg.actor_job_timeout_ms,
                len(actor.inflight),
            )
            self.metrics["actors/hung"] += 1
            self._send_actor(actor.identity, p.header(p.OP_DISCONNECT))
            self._requeue(self.registry.remove(actor.identity))
        self.notifier.watchdog(now)  # from the loop itself: a hung loop stops the pings
        if now >= self._next_status:
            self._next_status = now + 1.0
            self.step_rate.add(now, self.metrics["broker/steps"])
            self.notifier.status(self.status_line(), min_interval_s=5.0)
            if self.metrics_server is not None:
                self.metrics_server.update(self.status())
        for actor in list(self.registry.actors.values()):
            if now - actor.last_sent >= heartbeat:
                self._send_actor(actor.identity, p.header(p.OP_HEARTBEAT) | {"heartbeat_ms": self.cfg.heartbeat_ms})
        if now >= self._next_session_scan:
            self._next_session_scan = now + SESSION_SCAN_S
            if not self.storage_ok:
                self._reload()
                return
            self.expire_sessions()
            self._refresh_stream_state()

    def _refresh_stream_state(self) -> None:
        try:
            self._read_stream_state()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            # Idle clients write nothing, so this read may be the first to find Redis gone.
            self._storage_lost(f"Redis read failed (stream length): {e}")
        except redis.RedisError as e:
            log.warning("cannot read the stream length: %s", e)

    def expire_sessions(self) -> None:
        """Flush sessions that went silent (an emulator killed without detach) as truncated segments."""
        cutoff = now_ms() - int(self.cfg.session_ttl_s * 1000)
        for session in [s for s in self.sessions.values() if s.last_seen_ms < cutoff]:
            if session.task_id in self.task_jobs:
                continue  # its step is still being scored
            closed = self._end_session(session, REASON_EXPIRED, "the session expired while its step was being scored")
            self.metrics["sessions/expired"] += 1
            log.info("session %s expired after %.0f s of silence (%d segment closed)", session.task_id, self.cfg.session_ttl_s, closed)


def _token_ids(msg: dict[str, Any], name: str) -> list[int]:
    ids = p.require(msg, name, list, "a non-empty array of token ids")
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise p.ProtocolError(p.E_BAD_REQUEST, f"`{name}` must be a non-empty array of token ids (ints >= 0)")
    return ids


def _key(rid: Any) -> Any:
    return (type(rid).__name__, rid)
