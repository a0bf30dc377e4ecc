"""The actor's connection to the broker's back end.

A DEALER socket owned by one background I/O thread, so heartbeats never wait
behind a model forward (the Paranoid Pirate rule): the thread announces the
actor with its credits, answers and sends heartbeats, reconnects when the
broker goes silent, and moves jobs and results between the socket and the
compute side. The compute side only calls `get_jobs` and `send_result`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import zmq

from common import protocol as p
from common.security import ClientKeys
from common.shared_settings import PolicyStamp

if TYPE_CHECKING:
    from actor_node.generation import Generated

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
    ) -> None:
        if credits <= 0:
            raise ValueError(f"`credits` must be positive, got {credits}")
        self.endpoint = endpoint
        self.name = name or f"actor-{uuid.uuid4().hex[:8]}"
        self.credits = credits
        self.heartbeat = heartbeat_ms / 1000
        self.liveness = liveness
        self.policy_version = -1
        self.ctx = context or zmq.Context.instance()
        self.curve = curve  # CURVE keys towards the broker (common/security.py), set on every new socket
        self.jobs: queue.Queue[dict[str, Any]] = queue.Queue()
        self.reconnects = 0
        self.broker_heartbeat = self.heartbeat  # learned from the broker's heartbeats
        self._results_addr = f"inproc://actor-results-{uuid.uuid4().hex}"
        self._results_in = self.ctx.socket(zmq.PULL)
        self._results_in.bind(self._results_addr)
        self._results_out = self.ctx.socket(zmq.PUSH)
        self._results_out.connect(self._results_addr)
        self._send_lock = threading.Lock()  # several compute threads may send results
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
        with self._send_lock:
            self._results_out.send(p.encode(body))

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
            "policy_version": policy_version,
        }
        if stamp is not None:
            result["policy"] = stamp.to_wire()
        return result

    @staticmethod
    def error(job: int, code: str, message: str) -> dict[str, Any]:
        return {"job": job, "error": {"code": code, "message": message}}

    # --- I/O thread ----------------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.endpoint)
        sock.send(p.encode(self._ready()))
        return sock

    def _ready(self) -> dict[str, Any]:
        body = p.header(p.OP_READY)
        body.update(name=self.name, credits=self.credits, policy_version=self.policy_version, heartbeat_ms=int(self.heartbeat * 1000))
        return body

    def _io_loop(self) -> None:
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._results_in, zmq.POLLIN)
        last_heard = last_sent = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(self.heartbeat * 1000 / 4)))
                now = time.monotonic()
                if sock in events:
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_heard = now
                        self._on_broker_message(sock, data)
                if self._results_in in events:
                    while True:
                        try:
                            data = self._results_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        sock.send(data)
                        last_sent = now
                if now - last_sent >= self.heartbeat:
                    body = p.header(p.OP_HEARTBEAT)
                    body["policy_version"] = self.policy_version
                    try:
                        # Never block on a heartbeat: a peer that refused our handshake (a CURVE key or
                        # mechanism mismatch) leaves the DEALER with no pipe, and a blocking send would
                        # hang this thread before the silence check below could reconnect.
                        sock.send(p.encode(body), zmq.NOBLOCK)
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
                    poller.register(sock, zmq.POLLIN)
                    self.reconnects += 1
                    last_heard = last_sent = now
            sock.send(p.encode(p.header(p.OP_DISCONNECT)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.error("%s: I/O thread failed: %s", self.name, e)
        finally:
            sock.close(linger=100)
            self._results_in.close(linger=0)

    def _on_broker_message(self, sock: zmq.Socket, data: bytes) -> None:
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
            # requeued there, so drop them here and announce ourselves again.
            log.info("%s: broker asked us to announce again", self.name)
            self._drop_jobs()
            sock.send(p.encode(self._ready()))
        elif op == p.OP_HEARTBEAT and isinstance(msg.get("heartbeat_ms"), int) and msg["heartbeat_ms"] > 0:
            self.broker_heartbeat = msg["heartbeat_ms"] / 1000

    def _drop_jobs(self) -> None:
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                return
