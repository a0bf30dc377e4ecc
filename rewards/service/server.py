"""The reward service's server: one reward model and/or LLM judge that every driver of a farm calls over ZeroMQ
(`ppoz reward-server`).

Why a service: a driver that loads a reward model itself holds a copy per driver process, and each
driver keeps its own limit on the judge's requests. One service holds the model once, scores the
pairs of several drivers in one batch, and keeps one limit on the judge for the whole farm.

Its messages and error codes are rewards/service/protocol.py's.

Threads of the server: the socket's loop (reads, checks, answers `ping` at once, sends every reply); one
reward-model thread (batches the pairs of the `rm_score` requests of all drivers); one judge thread that hands
the items of `judge` requests to at most min(judge_workers, judge_concurrency) judge calls at once, so a slow
judge never holds up a reward-model request or a ping. Both share their work among the requests in progress the
same way (rewards/service/scheduler.py `round_robin`): each request gets an equal share of every batch of pairs,
or of the judge calls that come free, in turn, so a small request is not held behind a large one for longer than
a batch or a judge call or two. The scoring itself is the RewardModel's and the Judge's
(rewards/reward_model.py, rewards/judge.py).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from common import protocol as p
from common.sd_notify import Notifier
from common.security import AllowList, apply_server
from common.zmqio import bound, recv_frames, send_frames, split_envelope
from rewards.config import RewardServiceConfig
from rewards.service.protocol import (
    COMPONENT_OF_OP,
    E_NOT_HOSTED,
    E_SCORING_FAILED,
    OP_JUDGE,
    OP_PING,
    OP_RM_SCORE,
    OPS,
    Limits,
    check_rows,
    checked_scores,
    checked_verdict,
    error_reply,
    rows_over,
    verdict_to_wire,
)
from rewards.service.scheduler import Job, Scoring, request_key, round_robin, split

log = logging.getLogger(__name__)

SLOT_FREED = "slot freed"  # on the judge's queue: a judge call finished, there is room for another


class RewardService:
    """Serves `ping`, `rm_score` and `judge` on one ROUTER socket until stop(); the models are given built."""

    def __init__(self, cfg: RewardServiceConfig, reward_model: Any = None, judge: Any = None, context: zmq.Context | None = None) -> None:
        if reward_model is None and judge is None:
            raise ValueError("a reward service needs a reward model, a judge or both")
        self.cfg = cfg
        self.reward_model = reward_model  # rewards.reward_model.RewardModel: score(pairs) -> list[float]
        self.judge = judge  # rewards.judge.Judge: judge_many(items) -> list[Verdict]
        self.components = [name for name, source in (("rm_score", reward_model), ("judge_score", judge)) if source is not None]
        self.limits = Limits(cfg.max_request_bytes, cfg.max_items)
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.endpoint = ""
        self.counts: Counter[str] = Counter()  # through _count: the workers add to it too
        self._counts_lock = threading.Lock()
        self.notifier = Notifier()
        self._stopping = threading.Event()
        self._allow_list: AllowList | None = None  # CURVE's check of the drivers' keys
        self._in_progress: dict[tuple[str, bytes], Job] = {}  # the loop's own: only its thread reads or writes it
        self._finished: queue.SimpleQueue[tuple[Job, dict[str, Any]]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()  # a worker's finished job wakes the loop's poll
        os.set_blocking(self._wake_write, False)
        self._wake_lock = threading.Lock()  # a late worker must never write to a closed (and maybe reused) descriptor
        self._closed = False
        self._rm_queue: queue.Queue[Job | str | None] = queue.Queue()
        self._rm_thread: threading.Thread | None = None
        # judge calls in flight at once: more than the judge's own limit would only wait inside it, first come first served
        self._judge_slots = min(cfg.judge_workers, cfg.judge_concurrency)
        self._judge_in_flight = 0  # under _judge_lock: the judge thread adds, the calls that finish take away
        self._judge_lock = threading.Lock()
        self._judge_queue: queue.Queue[Job | str | None] = queue.Queue()
        self._judge_thread: threading.Thread | None = None
        self._judge_pool = ThreadPoolExecutor(max_workers=self._judge_slots, thread_name_prefix="judge-call")

    def start(self) -> None:
        """Bind the socket (an endpoint ending in `:*` takes a free port: `endpoint` says which) and start the workers."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a client gone since is an error we count, not a silent drop
        # Requests far over the limit are refused by libzmq itself, so they never fill memory; those a little
        # over it get `too_large`.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.cfg.max_request_bytes + 65536)
        if self.cfg.curve_secret_key:  # before bind, as every CURVE server socket
            self._allow_list = apply_server(sock, self.cfg.curve_secret_key, self.cfg.curve_allowed_clients, "reward service")
        sock.bind(self.cfg.bind)
        self.sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.reward_model is not None:
            self._rm_thread = threading.Thread(target=self._reward_model_loop, name="reward-model", daemon=True)
            self._rm_thread.start()
        if self.judge is not None:
            self._judge_thread = threading.Thread(target=self._judge_loop, name="judge", daemon=True)
            self._judge_thread.start()
        self.notifier.ready(f"rewards on {self.endpoint}: {', '.join(self.components)}")

    def stop(self) -> None:
        """Stop taking requests and finish those in progress (up to drain_timeout_s). Safe from a signal handler."""
        self._stopping.set()

    def run(self) -> None:
        """Serve until stop(), then drain."""
        sock = bound(self.sock, "the reward service's socket")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        drain_until: float | None = None
        while True:
            now = time.monotonic()
            if self._stopping.is_set() and drain_until is None:
                drain_until = now + self.cfg.drain_timeout_s
                log.info("stopping: finishing %d requests in progress (up to %.0f s)", len(self._in_progress), self.cfg.drain_timeout_s)
                self.notifier.stopping(f"finishing {len(self._in_progress)} requests")
            if drain_until is not None and (not self._in_progress or now >= drain_until):
                break
            events = dict(poller.poll(200))
            if self._wake_read in events:
                os.read(self._wake_read, 4096)
            self._send_finished(sock)
            if sock in events:
                for _ in range(256):  # a turn's share, so the finished replies go out between floods of requests
                    try:
                        frames = recv_frames(sock)
                    except zmq.Again:
                        break
                    self.on_frames(sock, frames)
            self.notifier.watchdog(now)
        if self._in_progress:
            log.warning("%d requests unanswered after drain_timeout_s; their drivers will retry elsewhere", len(self._in_progress))

    def close(self) -> None:
        """After run() returned: stop the workers, close the socket. A second call does nothing."""
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
        self._stopping.set()
        self._rm_queue.put(None)
        self._judge_queue.put(None)
        for thread in (self._rm_thread, self._judge_thread):
            if thread is not None:
                thread.join(self.cfg.drain_timeout_s + 5)
        self._judge_pool.shutdown(wait=False, cancel_futures=True)
        if self.sock is not None and not self.sock.closed:
            self.sock.close(linger=0)
        if self._allow_list is not None:  # after its socket: the last one stops the ZAP handler
            self._allow_list.close()
            self._allow_list = None
        self.notifier.close()

    def summary(self) -> str:
        with self._counts_lock:
            return ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "no requests"

    def _count(self, key: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[key] += n

    # --- the loop's side -------------------------------------------------------------------------
    def on_frames(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        """Split the envelope, decode, check, and answer (ping) or hand the request to its workers."""
        self._count("requests")
        split = split_envelope(frames)
        if split is None:
            self._count("dropped/malformed_frames")
            return
        envelope, body = split
        msg: dict[str, Any] = {}
        try:
            if len(body) > self.limits.max_request_bytes:
                raise p.ProtocolError(p.E_TOO_LARGE, f"the request is {len(body)} bytes, the limit is {self.limits.max_request_bytes}")
            over = rows_over(body, self.limits.max_items)  # before decoding: millions of empty rows fit in the bytes
            if over is not None:
                raise p.ProtocolError(p.E_TOO_LARGE, f"`{over[0]}` has {over[1]} entries, the limit is {self.limits.max_items}")
            msg = p.decode(body)
            p.check_rid(msg.get("rid"))
            op = p.require(msg, "op", str, f"a str: {', '.join(OPS)}")
            if op == OP_PING:
                self._send(sock, [envelope], self.ping_reply(msg["rid"]))
            elif op in COMPONENT_OF_OP:
                self._admit(op, msg, envelope, request_key(op, body))
            else:
                raise p.ProtocolError(p.E_UNKNOWN_OP, f"unknown op {op!r}; known: {', '.join(OPS)}")
        except p.ProtocolError as e:
            self._count(f"errors/{e.code}")
            header = msg or p.read_header(body)  # unread (too large, undecodable): its rid, if one can be read
            self._send(sock, [envelope], error_reply(header.get("op"), header.get("rid"), e))
        except Exception:
            log.exception("internal error on a %r request", msg.get("op"))
            self._count(f"errors/{p.E_INTERNAL}")
            self._send(sock, [envelope], error_reply(msg.get("op"), msg.get("rid"), p.ProtocolError(p.E_INTERNAL, "see the service's log")))

    def ping_reply(self, rid: Any) -> dict[str, Any]:
        """What a client needs: the components hosted and the most rows a request may hold. Not the reward model's
        path or the judge's model (they told anyone who could connect where the files are and whose API is paid)."""
        return {"op": OP_PING, "rid": rid, "components": self.components, "max_items": self.limits.max_items}

    def _admit(self, op: str, msg: dict[str, Any], envelope: tuple[bytes, ...], key: tuple[str, bytes]) -> None:
        """Queue a scoring request (a retry of one in progress joins it), or raise why it is refused."""
        if key in self._in_progress:  # only this thread touches it: a worker's finished job is popped here too
            self._in_progress[key].envelopes.append(envelope)
            self._count("retries_joined")
            return
        if (op == OP_RM_SCORE and self.reward_model is None) or (op == OP_JUDGE and self.judge is None):
            what = "reward model" if op == OP_RM_SCORE else "judge"
            raise p.ProtocolError(E_NOT_HOSTED, f"this service hosts no {what}; it hosts: {', '.join(self.components)}")
        if op == OP_RM_SCORE:
            rows = check_rows(msg, "pairs", ("prompt", "response"), self.limits)
        else:
            rows = check_rows(msg, "items", ("prompt", "response", "ground_truth"), self.limits)
        if self._stopping.is_set():
            raise p.ProtocolError(p.E_OVERLOADED, "the service is stopping", retry_after_ms=self.cfg.retry_after_ms)
        if len(self._in_progress) >= self.cfg.max_pending:
            raise p.ProtocolError(
                p.E_OVERLOADED, f"{len(self._in_progress)} requests in progress, the limit", retry_after_ms=self.cfg.retry_after_ms
            )
        job = Job(op, msg["rid"], rows, [envelope], key)
        self._in_progress[key] = job
        (self._rm_queue if op == OP_RM_SCORE else self._judge_queue).put(job)

    def _send_finished(self, sock: zmq.Socket) -> None:
        while True:
            try:
                job, reply = self._finished.get_nowait()
            except queue.Empty:
                return
            self._in_progress.pop(job.key, None)
            self._count(f"answered/{job.op}")
            self._send(sock, job.envelopes, reply)

    def _send(self, sock: zmq.Socket, envelopes: list[tuple[bytes, ...]], reply: dict[str, Any]) -> None:
        data = p.encode(reply)
        for envelope in envelopes:
            try:
                send_frames(sock, [*envelope, data])
            except zmq.ZMQError:  # the client is gone (it retried on a new socket) or is not reading: it will retry
                self._count("dropped/replies")

    # --- the workers' side ------------------------------------------------------------------------
    def _finish(self, job: Job, fields: dict[str, Any]) -> None:
        self._finished.put((job, {"op": job.op, "rid": job.rid, **fields}))
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_write, b"x")
            except BlockingIOError:  # the pipe is full: the loop wakes anyway
                pass

    def _fail(self, job: Job, code: str, message: str) -> None:
        self._count(f"errors/{code}")
        self._finish(job, {"error": {"code": code, "message": message}})

    def _expired(self, scoring: Scoring) -> bool:
        if time.monotonic() - scoring.job.received <= self.cfg.queue_timeout_s:
            return False
        if scoring.give_up():
            self._fail(scoring.job, p.E_TIMEOUT, f"waited more than queue_timeout_s ({self.cfg.queue_timeout_s:g} s) to be scored")
        return True

    def _reward_model_loop(self) -> None:
        """The reward model's batches of at most batch_size pairs, shared round-robin among the `rm_score` requests."""
        round_robin(self._rm_queue, lambda: self.cfg.batch_size, self.cfg.batch_wait_ms / 1000, self._score_shares, self._expired)

    def _score_shares(self, shares: list[tuple[Scoring, int, int]]) -> None:
        """Score each request's share of pairs in one call; a failure is retried per request, and fails only the
        request whose pairs the model cannot take (its remaining pairs are not scored)."""
        rows = [pair for scoring, start, n in shares for pair in scoring.job.rows[start : start + n]]
        try:
            scores = self.reward_model.score([(prompt, response) for prompt, response in rows])
        except Exception as e:  # noqa: BLE001 - one request's pair the model cannot take fails that request alone
            if len(shares) > 1:
                for share in shares:
                    self._score_shares([share])
                return
            scoring = shares[0][0]
            log.warning("the reward model failed on a request of %d pairs: %s: %s", len(scoring.job.rows), type(e).__name__, e)
            if scoring.give_up():
                self._fail(scoring.job, E_SCORING_FAILED, f"the reward model failed: {type(e).__name__}: {e}")
            return
        self._count("rm/batches")
        self._count("rm/pairs", len(scores))
        for (scoring, start, _), part in zip(shares, split(scores, [n for _, _, n in shares])):
            if scoring.record(start, part):
                self._send_scores(scoring.job, scoring.results)

    def _send_scores(self, job: Job, scores: list[float]) -> None:
        sent, errors = checked_scores(scores, self.cfg.max_abs_reward)
        refused = [e for e in errors if e]
        if refused:
            self._count("rm/refused_scores", len(refused))
            log.warning(
                "the reward model gave %d of %d scores that cannot be rewards, sent as nil; first: %s",
                len(refused),
                len(scores),
                refused[0],
            )
        self._finish(job, {"scores": sent, "errors": errors})

    def _judge_loop(self) -> None:
        """The judge's calls, one item each, started as calls come free, shared round-robin among the `judge` requests."""
        round_robin(self._judge_queue, self._judge_room, 0.0, self._start_judge_calls, self._expired)

    def _judge_room(self) -> int:
        with self._judge_lock:
            return self._judge_slots - self._judge_in_flight

    def _start_judge_calls(self, shares: list[tuple[Scoring, int, int]]) -> None:
        for scoring, start, n in shares:
            for i in range(start, start + n):
                with self._judge_lock:
                    self._judge_in_flight += 1
                self._judge_pool.submit(self._judge_call, scoring, i)

    def _judge_call(self, scoring: Scoring, i: int) -> None:
        """Judge the request's item i; the request's reply goes out with its last verdict."""
        try:
            (verdict,) = self.judge.judge_many([scoring.job.rows[i]])
            self._count("judge/items")
            if scoring.record(i, [checked_verdict(verdict, "the reward service")]):
                self._finish(scoring.job, {"verdicts": [verdict_to_wire(v) for v in scoring.results]})
        except Exception as e:  # noqa: BLE001 - a call that dies without an answer would leave its driver waiting
            log.exception("the judge failed on an item of a request of %d items", len(scoring.job.rows))
            if scoring.give_up():
                self._fail(scoring.job, E_SCORING_FAILED, f"the judge failed: {type(e).__name__}: {e}")
        finally:
            with self._judge_lock:
                self._judge_in_flight -= 1
            self._judge_queue.put(SLOT_FREED)
