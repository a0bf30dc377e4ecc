"""One reward model and/or LLM judge that every driver of a farm calls over ZeroMQ (`ppoz reward-server`).

Why a service: a driver that loads a reward model itself holds a copy per driver process, and each
driver keeps its own limit on the judge's requests. One service holds the model once, scores the
pairs of several drivers in one batch, and keeps one limit on the judge for the whole farm.

The contract (docs/train.md, "A shared reward service"). Every message is one msgpack map; a client's
DEALER socket sends [empty frame, request] and gets [empty frame, reply]:

    request                                                   reply
    {op: "ping", rid}                                         {op, rid, components, max_items}
    {op: "rm_score", rid, pairs: [[prompt, response], ...]}   {op, rid, scores: [float or nil, ...], errors: [str, ...]}  (in order)
    {op: "judge", rid, items: [[prompt, response, ground_truth], ...]}
                                                              {op, rid, verdicts: [{reward, raw_score, reply, error, cached}, ...]}
    any refused request                                       {op, rid, error: {code, message}}

`rid` is the client's request id (1 to 64 bytes), echoed in the reply. A request sent again, byte for
byte, while the first is still being scored joins it rather than being scored twice (a client that timed
out and retried, from a new socket). Only a byte-identical request joins: another client that happens to
use the same rid with other pairs or items gets its own scores, never the first one's. `components` names
what the service hosts, as CompositeReward names them (rm_score, judge_score). A verdict's `reward` is in
[0, 1], or nil with `error` saying why (the judge's reply was unreadable, its request failed): that
response gets no reward, never a 0. `ground_truth` is any msgpack value; the clients here send its text,
which is what the judge's template makes of it.

No number that cannot be a reward leaves the service: a reward model's score that is not finite or is
past `max_abs_reward` goes out as nil, its `errors` entry saying why ("" beside a score), and a verdict's
reward outside [0, 1] as nil with its `error`. The clients hold a reply to the same rules (a service of
another version may not): such a pair or item gets no reward, the others of its request do.

Error codes (`ERROR_CODES`): bad_request, unknown_op, not_hosted, too_large, overloaded (retry after
`retry_after_ms`), timeout (the request waited past `queue_timeout_s`), scoring_failed, internal.

Threads of the server: the socket's loop (reads, checks, answers `ping` at once, sends every reply);
one reward-model thread (batches the pairs of the `rm_score` requests of all drivers); one judge thread
that hands the items of `judge` requests to at most min(judge_workers, judge_concurrency) judge calls at
once, so a slow judge never holds up a reward-model request or a ping. Both share their work among the
requests in progress the same way (`_round_robin`): each request gets an equal share of every batch of
pairs, or of the judge calls that come free, in turn, so a small request is not held behind a large one
for longer than a batch or a judge call or two. The scoring itself is the RewardModel's and the Judge's
(rewards/reward_model.py, rewards/judge.py).

A request is checked against the limits before any of it is scored, tokenized or even decoded: its size
(`max_request_bytes`) and the length of its `pairs` or `items` (`max_items`, read from the array's header:
decoding 20 million empty pairs took the loop 11 s, every other request waiting, only to refuse them).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from common import protocol as p
from common.protocol import DEFAULT_MAX_ABS_REWARD, reward_problem
from common.sd_notify import Notifier
from common.security import AllowList, ClientKeys, apply_server
from common.zmqio import bound, recv_frames, send_frames, split_envelope
from rewards.config import RewardServiceConfig
from rewards.functions import RewardError, bound_reason
from rewards.judge import Verdict

log = logging.getLogger(__name__)

# --- The contract ------------------------------------------------------------------------------
OP_PING = "ping"
OP_RM_SCORE = "rm_score"
OP_JUDGE = "judge"
OPS = (OP_PING, OP_RM_SCORE, OP_JUDGE)
COMPONENT_OF_OP = {OP_RM_SCORE: "rm_score", OP_JUDGE: "judge_score"}  # CompositeReward's names
E_NOT_HOSTED = "not_hosted"
E_SCORING_FAILED = "scoring_failed"
ERROR_CODES: dict[str, str] = {
    p.E_BAD_REQUEST: "not a msgpack map, a missing field, or a field of the wrong type; the message names it",
    p.E_UNKNOWN_OP: "`op` is none of ping, rm_score, judge",
    E_NOT_HOSTED: "the service hosts no reward model (rm_score) or no judge (judge); `ping` says what it hosts",
    p.E_TOO_LARGE: "the request is over `max_request_bytes`, or has more than `max_items` pairs or items",
    p.E_OVERLOADED: "too many requests in progress, or the service is stopping; send it again after `retry_after_ms`",
    p.E_TIMEOUT: "the request waited longer than the service's `queue_timeout_s` to be scored",
    E_SCORING_FAILED: "the reward model or the judge failed on this request; the message says why",
    p.E_INTERNAL: "the service failed while handling the request; see its log",
}
RETRIED_CODES = frozenset({p.E_OVERLOADED, p.E_TIMEOUT})  # sent again by the clients; the others are final
CLIENT_CHUNK = 256  # pairs or items per request from the clients here (below the service's default max_items)
VERDICT_FIELDS = ("reward", "raw_score", "reply", "error", "cached")
ROWS_FIELDS = {OP_RM_SCORE: "pairs", OP_JUDGE: "items"}
SLOT_FREED = "slot freed"  # on the judge's queue: a judge call finished, there is room for another
# A ping is answered by the service's socket loop at once, never queued behind scoring: a short wait per
# attempt tells a service that is not there within seconds (a scoring request waits `timeout_s`, 60 s for a
# driver: 3 silent minutes at start before this).
PING_TIMEOUT_S = 1.5
PING_PAUSE_S = 1.0


def verdict_to_wire(verdict: Verdict) -> dict[str, Any]:
    return {name: getattr(verdict, name) for name in VERDICT_FIELDS}


def checked_verdict(verdict: Verdict, where: str) -> Verdict:
    """The verdict, or one without a reward when its reward is not a number in [0, 1] (judge_score's range)."""
    raw = verdict.raw_score if verdict.raw_score is None or math.isfinite(verdict.raw_score) else None
    reward = verdict.reward
    if reward is None or (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        return verdict if raw == verdict.raw_score else Verdict(reward, raw, verdict.reply, verdict.error, verdict.cached)
    return Verdict(None, raw, verdict.reply, f"{where}: the judge's reward {reward} is not a number in [0, 1]", verdict.cached)


def checked_scores(values: Sequence[Any], max_abs: float) -> tuple[list[float | None], list[str]]:
    """Reward-model scores as they may go out: one that is not finite or is past `max_abs` becomes None, with
    its error (the others: "")."""
    scores: list[float | None] = []
    errors: list[str] = []
    for value in values:
        problem = reward_problem(float(value), max_abs)
        scores.append(None if problem else float(value))
        errors.append(f"the reward model's score {problem}" if problem else "")
    return scores, errors


def verdict_from_wire(body: Any, where: str) -> Verdict:
    """A verdict as the service sent it; one that is not a map of the contract's fields is the service's fault, named."""
    if not isinstance(body, dict) or any(name not in body for name in VERDICT_FIELDS):
        raise RewardServiceError(f"{where}: a verdict must be a map of {', '.join(VERDICT_FIELDS)}, got {body!r:.120}")
    number = (int, float, type(None))
    if any(isinstance(body[name], bool) or not isinstance(body[name], number) for name in ("reward", "raw_score")):
        raise RewardServiceError(f"{where}: a verdict's reward and raw_score must be numbers or nil, got {body!r:.120}")
    reward, raw = body["reward"], body["raw_score"]
    verdict = Verdict(
        None if reward is None else float(reward),
        None if raw is None else float(raw),
        str(body["reply"]),
        str(body["error"]),
        bool(body["cached"]),
    )
    return checked_verdict(verdict, where)


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int
    max_items: int


def check_rows(body: dict[str, Any], name: str, columns: tuple[str, ...], limits: Limits) -> list[tuple[Any, ...]]:
    """`body[name]`: an array of rows [prompt, response(, ground_truth)]; prompt and response are str.
    Raises bad_request or too_large naming the field (`pairs[3][1]`, the response)."""
    shape = "[" + ", ".join(columns) + "]"
    rows = p.require(body, name, list, f"an array of {shape} arrays")
    if len(rows) > limits.max_items:
        raise p.ProtocolError(p.E_TOO_LARGE, f"`{name}` has {len(rows)} entries, the limit is {limits.max_items}")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(columns):
            got = f"an array of {len(row)}" if isinstance(row, list) else type(row).__name__
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`{name}[{i}]` must be an array {shape}, got {got}")
        for j, column in enumerate(columns[:2]):  # prompt and response; a ground truth may be any value
            if not isinstance(row[j], str):
                raise p.ProtocolError(p.E_BAD_REQUEST, f"`{name}[{i}][{j}]` ({column}) must be a str, got {type(row[j]).__name__}")
    return [tuple(row) for row in rows]


def rows_over(body: bytes, limit: int) -> tuple[str, int] | None:
    """The name and length of an array under `pairs` or `items` in a request's top-level map that is longer than
    `limit`, read from its header before anything is decoded (the other values are skipped unbuilt); None when
    there is none, or where the body cannot be read so far (decode() then says why)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(1, len(body)))
    try:
        unpacker.feed(body)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key not in ROWS_FIELDS.values():
                unpacker.skip()
                continue
            rows = unpacker.read_array_header()
            if rows > limit:
                return key, rows
            for _ in range(rows):
                unpacker.skip()
    except Exception:  # noqa: BLE001 - msgpack raises several types for hostile input; decode() names the problem
        pass
    return None


def split(values: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """`values` cut into consecutive runs of `sizes` (one batch's scores, back to the requests it joined)."""
    out, start = [], 0
    for size in sizes:
        out.append(list(values[start : start + size]))
        start += size
    return out


# --- The server ----------------------------------------------------------------------------------
@dataclass
class Scoring:
    """A request's progress: its first `done` rows are handed out to be scored; `results` in order as they come
    back (from the judge's calls, in any order: `record` and `give_up` may be called from any thread)."""

    job: Job
    done: int = 0
    failed: bool = False  # answered with an error (or timed out): nothing more of it is scored or sent
    answered: int = 0
    results: list[Any] = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.job.rows)

    @property
    def finished(self) -> bool:
        """Nothing more to hand out: every row handed out, or the request failed."""
        return self.failed or self.done == len(self.job.rows)

    def record(self, start: int, values: Sequence[Any]) -> bool:
        """Keep the results of the rows from `start`; True when they were its last (its reply is due now)."""
        with self.lock:
            if self.failed:
                return False
            self.results[start : start + len(values)] = values
            self.answered += len(values)
            return self.answered == len(self.results)

    def give_up(self) -> bool:
        """Mark it failed; True the one time that its error reply is due (not when it was answered or failed before)."""
        with self.lock:
            if self.failed or self.answered == len(self.results):
                return False
            self.failed = True
            return True


def fair_shares(active: Sequence[Scoring], batch_size: int) -> list[tuple[Scoring, int]]:
    """How many of its next pairs each request in progress gets in a batch of at most `batch_size`: equal shares in
    turn (the first in `active` first), what one leaves unused going to the others."""
    left = {id(s): len(s.job.rows) - s.done for s in active}
    taken = {id(s): 0 for s in active}
    room = batch_size
    while room > 0:
        wanting = [s for s in active if left[id(s)] > 0]
        if not wanting:
            break
        each = max(1, room // len(wanting))
        for s in wanting:
            n = min(each, left[id(s)], room)
            taken[id(s)] += n
            left[id(s)] -= n
            room -= n
            if room == 0:
                break
    return [(s, taken[id(s)]) for s in active if taken[id(s)]]


@dataclass
class Job:
    """One request being scored; `envelopes`: where its reply goes (more than one when a retry joined it)."""

    op: str
    rid: Any
    rows: list[tuple[Any, ...]]
    envelopes: list[tuple[bytes, ...]]
    key: tuple[str, bytes] = ("", b"")  # what a retry must match (`request_key`)
    received: float = field(default_factory=time.monotonic)


def request_key(op: str, body: bytes) -> tuple[str, bytes]:
    """A request's identity for joining retries: its op and a digest of its whole encoded body (rid, rows and
    all), so a retry, which sends the same bytes, joins the request in progress, and a request of another
    client that reuses the rid with other content is scored on its own (the rid alone let one client read
    another's verdict)."""
    return op, hashlib.blake2b(body, digest_size=16).digest()


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

    def _round_robin(
        self,
        jobs: queue.Queue[Job | str | None],
        room: Callable[[], int],
        wait_s: float,
        hand_out: Callable[[list[tuple[Scoring, int, int]]], None],
    ) -> None:
        """Hand out the rows of the requests in progress, as many at a time as `room()` allows, shared round-robin:
        each request gets an equal share (fair_shares) of each hand-out, what one leaves unused going to the others,
        and the first in turn moves on after each. `hand_out` gets (request, its first row, rows) for each share.
        Every request that has arrived joins each hand-out; more are waited for (`wait_s`) only while the rows
        waiting would not fill the room. Returns when `jobs` gives None; any other item than a Job only wakes it
        (`room()` may have grown).

        Both scorers run on it: the reward model's batches (room: batch_size; hand_out scores them, and returns
        when they are scored) and the judge's calls (room: the calls free; hand_out starts them). First come, first
        served, a request of 1,000 long pairs held every driver until its last pair (20 to 83 s), and one of many
        judge items held every other judge request until its last verdict."""
        active: collections.deque[Scoring] = collections.deque()

        def take(item: Job | str | None) -> bool:
            if isinstance(item, Job):
                active.append(Scoring(item))
            return item is not None

        while True:
            while not active or room() < 1:  # nothing to hand out, or no room for it
                if not take(jobs.get()):
                    return
            until = time.monotonic() + wait_s
            while True:
                waiting = sum(len(s.job.rows) - s.done for s in active)
                wait = until - time.monotonic() if waiting < room() else 0.0
                try:
                    item = jobs.get(timeout=wait) if wait > 0 else jobs.get_nowait()
                except queue.Empty:
                    break
                if not take(item):
                    return  # closing: the service answered or gave up on what was in progress (drain_timeout_s)
            for scoring in [s for s in active if s.failed or self._expired(s)]:
                active.remove(scoring)
            if not active:
                continue
            shares = [(scoring, scoring.done, n) for scoring, n in fair_shares(active, room())]
            for scoring, _, n in shares:
                scoring.done += n
            hand_out(shares)
            for scoring in [s for s in active if s.finished]:
                active.remove(scoring)
            active.rotate(-1)  # the next hand-out starts with the next request

    def _reward_model_loop(self) -> None:
        """The reward model's batches of at most batch_size pairs, shared round-robin among the `rm_score` requests."""
        self._round_robin(self._rm_queue, lambda: self.cfg.batch_size, self.cfg.batch_wait_ms / 1000, self._score_shares)

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
        self._round_robin(self._judge_queue, self._judge_room, 0.0, self._start_judge_calls)

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


def error_reply(op: Any, rid: Any, e: p.ProtocolError) -> dict[str, Any]:
    """`{op, rid, error: {code, message}}`; an rid or op that cannot be read goes back as nil."""
    return {
        "op": op if isinstance(op, str) else None,
        "rid": rid if p.readable_rid(rid) else None,
        "error": {"code": e.code, "message": e.message},
        **e.extra,
    }


# --- The clients -------------------------------------------------------------------------------------
class RewardServiceError(RewardError):
    """The reward service did not answer in time, or refused a request: the responses concerned get no reward."""


class RewardServiceClient:
    """Requests to a reward service over one DEALER socket, one at a time (a lock; the drivers' scorer is one thread).

    Each attempt waits up to `timeout_s` for its reply; one that gets none replaces the socket (whose queue
    to a dead service would otherwise be delivered to the next one) and the same request, with the same
    rid, is sent again, `retries` times, each retry logged. `overloaded` and `timeout` are sent again after
    `retry_after_ms`. Past the last attempt, or on any other error, RewardServiceError names the service and why.
    A `ping` waits at most PING_TIMEOUT_S per attempt, PING_PAUSE_S between: a service that is not there is
    told within seconds.
    `max_abs_reward`: the bound a score in a reply is held to (RemoteRewardModel)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 60.0,
        retries: int = 2,
        context: zmq.Context | None = None,
        max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
        curve: ClientKeys | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"a reward service client needs timeout_s > 0 and retries >= 0, got {timeout_s} and {retries}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_abs_reward = max_abs_reward
        self.curve = curve  # CURVE keys for every socket it opens (common/security.py); None: plain
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.attempts = 0  # sends, retries included
        self._lock = threading.Lock()

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """The service's reply to one request (without its error: that raises RewardServiceError)."""
        return self._exchange(op, fields, self.timeout_s, self.retries + 1, pause_s=0.0)

    def _exchange(self, op: str, fields: dict[str, Any], timeout_s: float, tries: int, pause_s: float) -> dict[str, Any]:
        """Send one request up to `tries` times, each waiting `timeout_s` for its reply, `pause_s` between unanswered ones."""
        rid = uuid.uuid4().hex
        data = msgpack.packb({"op": op, "rid": rid, **fields}, use_bin_type=True)
        why = ""
        with self._lock:
            for attempt in range(1, tries + 1):
                reply = self._attempt(data, rid, timeout_s)
                if reply is None:
                    why = f"no answer within {timeout_s:g} s"
                    if attempt < tries:
                        then = f"retrying in {pause_s:g} s" if pause_s else "sending it again"
                        log.warning(
                            "the reward service at %s: no answer to `%s` within %g s (try %d of %d), %s",
                            self.endpoint,
                            op,
                            timeout_s,
                            attempt,
                            tries,
                            then,
                        )
                        time.sleep(pause_s)
                    continue
                error = reply.get("error")
                if not error:
                    return reply
                code, message = (error.get("code"), error.get("message")) if isinstance(error, dict) else (None, error)
                if code not in RETRIED_CODES:
                    raise RewardServiceError(f"the reward service at {self.endpoint} refused `{op}`: {code}: {message}", reason="refused")
                why = f"{code}: {message}"
                if attempt < tries:
                    log.info(
                        "the reward service at %s answered `%s` with %s (try %d of %d); sending it again",
                        self.endpoint,
                        op,
                        why,
                        attempt,
                        tries,
                    )
                    time.sleep(min(float(reply.get("retry_after_ms") or 0) / 1000, timeout_s))
        raise RewardServiceError(
            f"the reward service at {self.endpoint} did not answer `{op}` after {tries} attempts ({why});"
            " is `ppoz reward-server` running there?",
            reason="no_answer",
        )

    def _attempt(self, data: bytes, rid: str, timeout_s: float) -> dict[str, Any] | None:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:  # before connect
                self.curve.apply(self.sock)
            self.sock.connect(self.endpoint)
        sock = self.sock
        self.attempts += 1
        try:
            sock.send_multipart([b"", data], flags=zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: nothing reads it
            self._reset()
            return None
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                reply = p.decode(sock.recv_multipart()[-1])
            except p.ProtocolError:
                continue
            # One request is in flight on this socket, so a reply with rid nil is this one's: the service could not read it.
            if reply.get("rid") in (rid, None):
                return reply
        self._reset()  # a lost connection, or a service gone: the next attempt starts on a fresh socket
        return None

    def _reset(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def ping(self) -> dict[str, Any]:
        """The service's ping reply; RewardServiceError naming `endpoint` within (retries + 1) * PING_TIMEOUT_S
        + retries * PING_PAUSE_S seconds (6.5 s for a driver's 2 retries) when nothing answers there, each retry logged."""
        return self._exchange(OP_PING, {}, min(self.timeout_s, PING_TIMEOUT_S), self.retries + 1, PING_PAUSE_S)

    def components(self) -> list[str]:
        """What the service hosts: rm_score, judge_score."""
        reply = self.ping()
        hosted = reply.get("components")
        if not isinstance(hosted, list) or not all(c in COMPONENT_OF_OP.values() for c in hosted):
            raise RewardServiceError(f"the reward service at {self.endpoint} answered ping without its components: {reply!r:.200}")
        return hosted

    def close(self) -> None:
        with self._lock:
            self._reset()


def chunks(rows: list[list[Any]]) -> list[list[list[Any]]]:
    """Rows in requests of at most CLIENT_CHUNK (a validation pass scores every record at once)."""
    return [rows[start : start + CLIENT_CHUNK] for start in range(0, len(rows), CLIENT_CHUNK)]


class RemoteRewardModel(RewardServiceClient):
    """A RewardModel's `score(pairs)` answered by the service's reward model."""

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float | RewardError]:
        """Each pair's score, or the RewardServiceError saying why it has none (the service sent nil for it, or a
        number that is not finite or is past `max_abs_reward`): that pair alone goes unrewarded. A request the
        service does not answer raises RewardServiceError for all of them."""
        out: list[float | RewardError] = []
        for chunk in chunks([[prompt, response] for prompt, response in pairs]):
            reply = self.request(OP_RM_SCORE, pairs=chunk)
            scores, errors = reply.get("scores"), reply.get("errors")
            if not isinstance(scores, list) or len(scores) != len(chunk) or not all(_score_or_nil(s) for s in scores):
                raise RewardServiceError(f"the reward service at {self.endpoint} answered rm_score without {len(chunk)} scores")
            if not isinstance(errors, list) or len(errors) != len(scores):
                errors = [""] * len(scores)  # a service from before `errors`
            out += [self._row(score, error) for score, error in zip(scores, errors)]
        return out

    def _row(self, score: Any, error: Any) -> float | RewardError:
        if score is None:
            why = str(error)[:200] if error else "no reason given"
            return RewardServiceError(f"the reward service at {self.endpoint} sent no rm_score: {why}", reason="refused_by_service")
        problem = reward_problem(float(score), self.max_abs_reward)
        if problem:
            return RewardServiceError(f"the reward service at {self.endpoint} sent rm_score {problem}", reason=bound_reason(float(score)))
        return float(score)


def _score_or_nil(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


class RemoteJudge(RewardServiceClient):
    """A Judge's `judge_many(items)` answered by the service's judge. A request the service does not answer
    leaves its items without a verdict's reward (the error says why), as a local judge's failed request does."""

    def judge(self, prompt: str, response: str, ground_truth: Any = None) -> Verdict:
        return self.judge_many([(prompt, response, ground_truth)])[0]

    def judge_many(self, items: Sequence[tuple[str, str, Any]]) -> list[Verdict]:
        out: list[Verdict] = []
        # the ground truth as its text: what the judge's template makes of it, for any type msgpack cannot carry too
        rows = [[prompt, response, None if truth is None else str(truth)] for prompt, response, truth in items]
        for chunk in chunks(rows):
            try:
                verdicts = self.request(OP_JUDGE, items=chunk).get("verdicts")
                if not isinstance(verdicts, list) or len(verdicts) != len(chunk):
                    raise RewardServiceError(f"the reward service at {self.endpoint} answered judge without {len(chunk)} verdicts")
                out += [verdict_from_wire(v, f"the reward service at {self.endpoint}") for v in verdicts]
            except RewardServiceError as e:
                out += [Verdict(None, None, "", error=str(e)) for _ in chunk]
        return out
