"""A blocking client: one DEALER socket, deadlines, and the protocol's retry rule.

The retry rule (docs/protocol.md): a request keeps its rid across attempts.
If no reply arrives within `attempt_timeout`, the socket is replaced (so a
dead connection's queue is dropped) and the same request is sent again; on
`overloaded`, `timeout` or `internal` the client waits (`retry_after_ms` when
given) and sends it again; the broker answers a repeated rid with the first
reply and applies it once. Past the request's deadline the client raises
RequestTimeout. One Client is for one thread.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from client.errors import PPOZError, RequestTimeout, from_reply
from common import protocol as p

RETRIED_CODES = frozenset({p.E_OVERLOADED, p.E_TIMEOUT, p.E_INTERNAL})


class Client:
    def __init__(
        self,
        endpoint: str,
        deadline: float = 60.0,
        attempt_timeout: float = 10.0,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.attempts = 0  # sends, retries included (for tests and diagnostics)

    def _socket(self) -> zmq.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.endpoint)
        return self.sock

    def _reset(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def close(self) -> None:
        self._reset()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, op: str, rid: str | None = None, deadline: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply map; raise the error's exception class."""
        body = p.header(op, rid or uuid.uuid4().hex)
        body.update(fields)
        data = p.encode(body)
        end = time.monotonic() + (deadline if deadline is not None else self.deadline)
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"timeout: no reply to {op} within {deadline or self.deadline:.1f} s")
            sock = self._socket()
            sock.send_multipart([b"", data])
            self.attempts += 1
            reply = self._await(sock, body["rid"], min(remaining, self.attempt_timeout))
            if reply is None:
                self._reset()  # a lost connection: start over on a fresh socket
                continue
            if "error" not in reply:
                return reply
            error = from_reply(reply)
            if error.code not in RETRIED_CODES:
                raise error
            wait = reply.get("retry_after_ms", 100) / 1000
            if time.monotonic() + wait >= end:
                raise error
            time.sleep(wait)

    def _await(self, sock: zmq.Socket, rid: Any, timeout: float) -> dict[str, Any] | None:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(left * 1000):
                return None
            frames = sock.recv_multipart()
            try:
                reply = p.decode(frames[-1])
            except p.ProtocolError:
                continue
            if reply.get("rid") == rid:
                return reply
            # a reply to an earlier attempt that we already gave up on
        return None

    # --- the operations --------------------------------------------------------------------
    def attach(self, task_id: str | None = None) -> str:
        fields = {"task_id": task_id} if task_id else {}
        return self.request(p.OP_ATTACH, **fields)["task_id"]

    def detach(self, task_id: str) -> dict[str, Any]:
        return self.request(p.OP_DETACH, task_id=task_id)

    def ask(self, task_id: str) -> dict[str, Any]:
        """`{"status": "ok"}` or `{"status": "wait", "retry_after_ms": ...}`."""
        return self.request(p.OP_ASK, task_id=task_id)

    def step(self, task_id: str, obs: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        """The reply map: action, logprob, probs, policy_version."""
        return self.request(p.OP_STEP, rid=rid, task_id=task_id, obs=obs)

    def rag_step(self, task_id: str, obs: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        return self.request(p.OP_RAG_STEP, rid=rid, task_id=task_id, obs=obs)

    def feedback(
        self, task_id: str, reward: float, done: bool = False, truncated: bool = False, rid: str | None = None
    ) -> dict[str, Any]:
        return self.request(p.OP_FEEDBACK, rid=rid, task_id=task_id, reward=reward, done=done, truncated=truncated)

    def status(self) -> dict[str, Any]:
        return self.request(p.OP_STATUS)

    def ping(self) -> dict[str, Any]:
        return self.request(p.OP_PING)


__all__ = ["Client", "PPOZError"]
