"""The broker's front end: what clients ask (attach, ask, step, feedback, detach, status, ping).

Each op has one short handler, found in `client_handlers`. A handler checks the
request (common/protocol.py), changes the state, stages its Redis writes and
its reply; replies that acknowledge state leave only after Redis applied the
writes (broker/outbox.py). Step requests go to the step queue
(broker/scheduling.py), which the actor side dispatches. Whether a client may
step now, and the asks held until it may, are broker/backpressure.py; the
figures a status reply gives, broker/status_report.py.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis

from broker.actors import Job
from broker.backpressure import ASK_RECHECK_S, Backpressure
from broker.sessions import REASON_DETACH, REASON_EXPIRED, Session, attach_key, now_ms, rid_key
from broker.status_report import StatusReport
from common import protocol as p
from common.zmqio import split_envelope

log = logging.getLogger(__name__)

__all__ = ["ASK_RECHECK_S", "ClientOps"]  # broker/server.py takes ASK_RECHECK_S from here


class ClientOps(Backpressure, StatusReport):
    """The client operations, one handler per op."""

    @functools.cached_property
    def client_handlers(self) -> dict[str, Callable[[tuple[bytes, ...], Any, dict[str, Any]], None]]:
        return {
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

    def on_client_frames(self, frames: list[bytes], sender: str = "") -> None:
        """Split the envelope, decode, check, and hand the request to its handler; `sender`: who sent it
        (recv_frames_and_sender), read by attach."""
        self.metrics["broker/requests"] += 1  # every message, well framed or not
        self.sender = sender
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
            handler = self.client_handlers.get(op)
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
            task_id = self.attach_rids.get(attach_key(self.sender, rid)) or uuid.uuid4().hex
        session = self.sessions.get(task_id)
        resumed = session is not None
        if session is None and len(self.sessions) >= self.cfg.max_sessions:  # an attach flood must not grow Redis without bound
            raise p.ProtocolError(
                p.E_OVERLOADED,
                f"{len(self.sessions)} sessions are open, the broker's max_sessions; detach idle ones, or wait for them to expire",
                retry_after_ms=self.cfg.retry_after_ms,
            )
        if session is None:
            session = Session(task_id, self.cfg.segment_len, attach_rid=rid, attach_sender=self.sender, epoch=uuid.uuid4().hex[:12])
            self.sessions[task_id] = session
            self.attach_rids[attach_key(self.sender, rid)] = task_id
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
        held = self.held_asks.pop(session.task_id, None)
        if held is not None:  # it would say `ok` to a step that can only get unknown_task
            ended = "detached" if reason == REASON_DETACH else "expired"
            message = f"task {session.task_id!r} was {ended} while this ask was held; attach again"
            self._error(held[0], p.header(p.OP_ASK, held[1]), p.ProtocolError(p.E_UNKNOWN_TASK, message))
        del self.sessions[session.task_id]
        self.attach_rids.pop(attach_key(session.attach_sender, session.attach_rid), None)
        self._count_closed(closes)
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
        reason = self._backpressure(envelope[0])
        if reason == "stream_backlog" and self.cfg.ask_hold_ms:  # answered by release_asks once the learner has read
            # One held ask per task, so what is held is bounded by the sessions: a task's newer ask (a retry on a new
            # socket, a client that asks twice) takes the place of its older one, which is answered `wait` at once.
            older = self.held_asks.pop(session.task_id, None)
            if older is not None:
                self._answer_ask(older[0], older[1], session.task_id, "stream_backlog")
            self.held_asks[session.task_id] = (envelope, rid, self.now + self.cfg.ask_hold_ms / 1000)
            return
        self._answer_ask(envelope, rid, session.task_id, reason)

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
        if running is not None and rid_key(running.rid) == rid_key(rid):
            running.waiters.append(envelope)  # a retry of a step still being scored
            self.metrics["broker/joined_retries"] += 1
            return
        generate = msg["op"] == p.OP_GENERATE
        obs = p.check_generate(msg, self.limits) if generate else p.check_obs(msg, self.limits)
        # checked before anything changes: a refused request must not abandon the task's running step
        longest = self.cfg.generate_timeout_ms if generate else self.cfg.request_timeout_ms
        deadline_ms = p.optional(msg, "deadline_ms", int, "a positive int (milliseconds)", longest)
        if deadline_ms <= 0:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`deadline_ms` must be positive, got {deadline_ms}")
        deadline_ms = min(deadline_ms, longest)
        if self.draining:  # shutting down: no new work; the client's retry reaches the restarted broker
            raise p.ProtocolError(
                p.E_OVERLOADED, "the broker is shutting down; retry with the same rid", retry_after_ms=self.cfg.retry_after_ms
            )
        client = envelope[0]
        if not self.queue.admits(client, self.cfg.max_queue):
            raise p.ProtocolError(
                p.E_OVERLOADED,
                f"{len(self.queue)} steps are queued, {self.queue.queued(client)} of them yours",
                retry_after_ms=self.cfg.retry_after_ms,
            )
        if running is not None:  # the client gave up on its previous step and sent a new one
            self._abandon_task_job(session.task_id, p.E_TIMEOUT, "superseded by a newer step of the same task")
        job = Job(
            self.registry.next_job_id(),
            session.task_id,
            msg["op"],
            rid,
            obs,
            [envelope],
            deadline=self.now + deadline_ms / 1000,
            created=self.now,
            client=client,
        )
        if self.over_backlog and self.cfg.step_hold_share > 0:  # it waits for the learner (broker/backpressure.py)
            job.held = True
            self.metrics["broker/steps_held"] += 1
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
        self._count_closed(closes)
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

    def expire_sessions(self) -> None:
        """Flush sessions that went silent (an emulator killed without detach) as truncated segments."""
        cutoff = now_ms() - int(self.cfg.session_ttl_s * 1000)
        for session in [s for s in self.sessions.values() if s.last_seen_ms < cutoff]:
            if session.task_id in self.task_jobs:
                continue  # its step is still being scored
            closed = self._end_session(session, REASON_EXPIRED, "the session expired while its step was being scored")
            self.metrics["sessions/expired"] += 1
            log.info("session %s expired after %.0f s of silence (%d segment closed)", session.task_id, self.cfg.session_ttl_s, closed)
