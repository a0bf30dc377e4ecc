"""The actor's connection to the broker's back end.

A DEALER socket owned by one background I/O thread, so heartbeats never wait
behind a model forward (the Paranoid Pirate rule): the thread announces the
actor with its credits, answers and sends heartbeats, reconnects when the
broker goes silent, and moves jobs and results between the socket and the
compute side. The compute side only calls `get_jobs` and `send_results`.

No send here ever blocks (issue 41). A DEALER whose broker refused its CURVE
handshake has no connection to queue on, and one whose broker stopped reading
has a full queue; a blocking send would then hang the I/O thread for ever: no
reconnect, and a process that SIGTERM cannot end. So every message to the
broker goes through an outbox sent with zmq.NOBLOCK: the ready message first,
then results, in order. What the socket does not take yet stays there (logged
once, counted in `held`) until it does, or until a reconnect or the broker's
`disconnect` drops it (counted in `dropped_results`): the broker requeues the
jobs of an actor it lost, so their results are no longer wanted. Heartbeats
go only when the outbox is empty and are dropped when the socket refuses them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from common import protocol as p
from common.security import ClientKeys
from common.shared_settings import PolicyStamp

if TYPE_CHECKING:
    from actor_node.responses import Generated

log = logging.getLogger(__name__)


class BrokerLink:
    """Jobs in, results out; liveness handled in the background."""

    def __init__(
        self,
        endpoint: str,
        name: str = "",
        credits: int = 8,
        heartbeat_ms: int = 1000,
        liveness: int = 3,
        context: zmq.Context | None = None,
        curve: ClientKeys | None = None,
        progress: Callable[[], int] | None = None,
    ) -> None:
        if credits <= 0:
            raise ValueError(f"`credits` must be positive, got {credits}")
        self.endpoint = endpoint
        self.name = name or f"actor-{uuid.uuid4().hex[:8]}"
        self.credits = credits
        self.heartbeat = heartbeat_ms / 1000
        self.liveness = liveness
        self.policy_version = -1
        self.progress = progress  # read by the I/O thread: how much the compute thread has done, for each heartbeat
        self.ctx = context or zmq.Context.instance()
        self.curve = curve  # CURVE keys towards the broker (common/security.py), set on every new socket
        self.jobs: queue.Queue[dict[str, Any]] = queue.Queue()
        self.reconnects = 0
        self.dropped_results = 0  # results never sent: their jobs were the broker's to requeue (a reconnect, a disconnect)
        self.held = 0  # results waiting in the outbox for the socket to take them
        self.broker_heartbeat = self.heartbeat  # learned from the broker's heartbeats
        self._results_addr = f"inproc://actor-results-{uuid.uuid4().hex}"
        self._results_in = self.ctx.socket(zmq.PULL)
        self._results_in.bind(self._results_addr)
        self._results_out = self.ctx.socket(zmq.PUSH)
        self._results_out.connect(self._results_addr)
        self._send_lock = threading.Lock()  # several compute threads may send results
        self._outbox: deque[tuple[bytes, int]] = deque()  # I/O thread only: (message, results in it), oldest first
        self._refused = False  # the socket refused the outbox's head (logged once until it takes it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._io_loop, name=f"{self.name}-io", daemon=True)

    def start(self) -> BrokerLink:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Say goodbye to the broker and stop the I/O thread."""
        self._stop.set()
        self._thread.join(timeout)
        with self._send_lock:
            self._results_out.close(linger=0)

    # --- compute side ------------------------------------------------------------------------
    def get_jobs(self, max_jobs: int, timeout: float) -> list[dict[str, Any]]:
        """Wait up to `timeout` s for one job, then take up to `max_jobs` that are waiting."""
        try:
            jobs = [self.jobs.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(jobs) < max_jobs:
            try:
                jobs.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        return jobs

    def send_results(self, results: list[dict[str, Any]]) -> None:
        """Send the results of some jobs in one message; build each with `result` or `error`."""
        body = p.header(p.OP_RESULT)
        body["results"] = results
        frames = [len(results).to_bytes(4, "little"), p.encode(body)]
        with self._send_lock:
            # The I/O thread reads this pipe on every turn and never blocks, so the pipe takes the results
            # within a turn; it stays full only once that thread has stopped, where a blocking send would hang.
            while True:
                try:
                    self._results_out.send_multipart(frames, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
                if self._stop.is_set() or not self._thread.is_alive():
                    log.warning("%s: the link is closed; %d results not sent (the broker requeues their jobs)", self.name, len(results))
                    self.dropped_results += len(results)
                    return
                self._results_out.poll(100, zmq.POLLOUT)

    @staticmethod
    def result(
        job: int, action: int, logprob: float, probs: list[float], policy_version: int, stamp: PolicyStamp | None = None
    ) -> dict[str, Any]:
        result = {"job": job, "action": action, "logprob": logprob, "probs": probs, "policy_version": policy_version}
        if stamp is not None:
            result["policy"] = stamp.to_wire()
        return result

    @staticmethod
    def generated(job: int, answer: Generated, policy_version: int, stamp: PolicyStamp | None = None) -> dict[str, Any]:
        """The result of a generate job: the response, its tokens and their behaviour log-probabilities."""
        result = {
            "job": job,
            "text": answer.text,
            "prompt_ids": answer.prompt_ids,
            "response_ids": answer.response_ids,
            "logprobs": answer.logprobs,
            "finish_reason": answer.finish_reason,
            "top_p": answer.top_p,
            "policy_version": policy_version,  # its oldest token's
            "token_versions": answer.token_versions,
        }
        if stamp is not None:
            result["policy"] = stamp.to_wire()
        return result

    @staticmethod
    def error(job: int, code: str, message: str) -> dict[str, Any]:
        return {"job": job, "error": {"code": code, "message": message}}

    # --- I/O thread ----------------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        """A fresh DEALER with the ready message first in the outbox; sent by the loop, never blocking."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only on a connection that is up: what we say means something to this broker connection alone, so
        # while there is none our messages wait in the outbox, where they are counted and dropped at a reconnect,
        # rather than in libzmq's queue, which close() would discard unseen.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.endpoint)
        self._announce("a reconnect")
        return sock

    def _announce(self, why: str) -> None:
        """Put the ready message alone in the outbox: unsent results go, their jobs are the broker's to requeue."""
        dropped = sum(n for _, n in self._outbox)
        if dropped:
            log.warning("%s: dropping %d results the broker did not take before %s; it requeues their jobs", self.name, dropped, why)
            self.dropped_results += dropped
        self._outbox.clear()
        self._outbox.append((p.encode(self._ready()), 0))
        self.held = 0
        self._refused = False

    def _flush(self, sock: zmq.Socket, quiet: bool = False) -> int:
        """Send from the outbox, oldest first, until it is empty or the socket refuses; how many went."""
        sent = 0
        while self._outbox:
            data, n = self._outbox[0]
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                if not self._refused and not quiet:
                    log.warning(
                        "%s: the broker's socket takes no more messages (no connection to queue on: a refused handshake?"
                        " or the broker stopped reading); %s until it does, or until a reconnect",
                        self.name,
                        f"holding {self.held} results" if self.held else "the ready message waits",
                    )
                    self._refused = True
                return sent
            self._outbox.popleft()
            self.held -= n
            sent += 1
        if self._refused:
            log.info("%s: the broker's socket takes messages again; the held results are sent", self.name)
            self._refused = False
        return sent

    def _ready(self) -> dict[str, Any]:
        body = p.header(p.OP_READY)
        body.update(name=self.name, credits=self.credits, policy_version=self.policy_version, heartbeat_ms=int(self.heartbeat * 1000))
        return body

    def _io_loop(self) -> None:
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(self._results_in, zmq.POLLIN)
        last_heard = last_sent = time.monotonic()
        try:
            while not self._stop.is_set():
                # POLLOUT while the outbox waits: woken as soon as the socket takes messages again.
                poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0))
                events = dict(poller.poll(int(self.heartbeat * 1000 / 4)))
                now = time.monotonic()
                if sock in events:
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_heard = now
                        self._on_broker_message(data)
                if self._results_in in events:
                    while True:
                        try:
                            count, data = self._results_in.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        n = int.from_bytes(count, "little")
                        self._outbox.append((data, n))
                        self.held += n
                if self._outbox and self._flush(sock):
                    last_sent = now
                if not self._outbox and now - last_sent >= self.heartbeat:
                    body = p.header(p.OP_HEARTBEAT)
                    body["policy_version"] = self.policy_version
                    if self.progress is not None:
                        body["progress"] = self.progress()
                    try:
                        sock.send(p.encode(body), zmq.NOBLOCK)  # a heartbeat the socket refuses is not worth keeping
                    except zmq.Again:
                        pass
                    last_sent = now
                if now - last_heard > max(self.heartbeat, self.broker_heartbeat) * self.liveness:
                    # The broker is gone or restarted: start over on a fresh socket. The jobs
                    # we hold are the broker's to requeue, so drop ours.
                    log.warning("%s: broker silent for %.1f s, reconnecting", self.name, now - last_heard)
                    self._drop_jobs()
                    poller.unregister(sock)
                    sock.close(linger=0)
                    sock = self._connect()
                    self.reconnects += 1
                    last_heard = last_sent = now
            self._flush(sock, quiet=True)  # results the broker can still record, then goodbye: it requeues the jobs we hold
            unsent = sum(n for _, n in self._outbox)
            if unsent:
                log.warning("%s: stopping with %d results the broker did not take; it requeues their jobs", self.name, unsent)
                self.dropped_results += unsent
            try:
                sock.send(p.encode(p.header(p.OP_DISCONNECT)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # not taken: the broker finds us silent instead
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.error("%s: I/O thread failed: %s", self.name, e)
        finally:
            sock.close(linger=100)  # at most 0.1 s for what is queued to leave: never a hang at exit
            self._results_in.close(linger=0)

    def _on_broker_message(self, data: bytes) -> None:
        try:
            msg = p.decode(data)
        except p.ProtocolError as e:
            log.warning("%s: undecodable message from the broker: %s", self.name, e)
            return
        op = msg.get("op")
        if op == p.OP_SCORE:
            for job in msg.get("jobs") or []:
                self.jobs.put(job)
        elif op == p.OP_DISCONNECT:
            # The broker forgot us (it restarted, or took us for hung): our jobs are
            # requeued there, so drop them (and unsent results) and announce ourselves again.
            log.info("%s: broker asked us to announce again", self.name)
            self._drop_jobs()
            self._announce("the broker's disconnect")
        elif op == p.OP_HEARTBEAT and isinstance(msg.get("heartbeat_ms"), int) and msg["heartbeat_ms"] > 0:
            self.broker_heartbeat = msg["heartbeat_ms"] / 1000

    def _drop_jobs(self) -> None:
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                return
