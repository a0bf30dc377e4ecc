"""A blocking client: one DEALER socket, deadlines, and the protocol's retry rule.

The retry rule (docs/protocol.md, section 5; written once in client/retry.py):
a request keeps its rid across attempts. If no reply arrives within
`attempt_timeout`, the socket is replaced (common/reconnecting.py: a dead connection's queue is
dropped) and the same request is sent again; on `overloaded`, `timeout` or
`internal` the client waits (`retry_after_ms` when given) and sends it again;
the broker answers a repeated rid with the first reply and applies it once.
Past the request's deadline the client raises RequestTimeout.

A ZeroMQ socket must not be used by two threads at once, so a Client holds a
lock around each attempt: threads may share one Client safely, but their
requests then go one at a time. For requests in parallel give each thread its
own Client, or use client.aio.AsyncClient, which has many in flight on one socket.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import zmq

import client.operations as operations
from client.errors import PPOZError
from client.retry import RETRIED_CODES, answers, generate_fields
from common import protocol as p
from common.reconnecting import ReconnectingDealer
from common.security import KeySource


class Client(operations.ClientBase):
    """Blocking PPOZ client. `deadline`: default overall time per request; `attempt_timeout`: per send.

    `curve_server_key` (the broker's public key: a NAME.key file or the Z85 key)
    turns CURVE on; `curve_secret_key` is this client's key pair (a NAME.key_secret
    file or the Z85 secret key), whose public key must be in the broker's allow-list
    (docs/security.md). Missing or bad keys raise KeyFileError (a ValueError) here."""

    def __init__(
        self,
        endpoint: str,
        deadline: float = 60.0,
        attempt_timeout: float = 10.0,
        context: zmq.Context | None = None,
        curve_secret_key: KeySource | None = None,
        curve_server_key: KeySource | None = None,
    ) -> None:
        super().__init__(endpoint, deadline, attempt_timeout, curve_secret_key, curve_server_key)
        self.ctx = context or zmq.Context.instance()
        self.link = ReconnectingDealer(endpoint, self.ctx, self.curve)  # the socket, replaced after a silent attempt
        # Held for one attempt (send and wait), not across a retry's sleep, so other
        # threads' requests go between the attempts of a retried one.
        self._lock = threading.Lock()

    @property
    def attempts(self) -> int:
        """Sends, retries included (for tests and diagnostics)."""
        return self.link.sends

    def _socket(self) -> zmq.Socket:
        return self.link.socket()

    def close(self) -> None:
        """Close the socket (after a request another thread has in progress). A later request opens a new one."""
        with self._lock:
            self.link.reset()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, op: str, rid: str | None = None, deadline: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply map; raise the error's exception class.

        `deadline` (seconds, default the client's) bounds the whole request:
        attempts, retry waits, and the time spent waiting for other threads' requests.
        """
        rule = self.retry_rule(op, rid, fields, deadline)
        # One request at a time is in flight on the socket (an attempt that got no reply replaces it), so a reply
        # with `rid: nil` can only be this request's: the broker could not read it.
        answered = functools.partial(answers, rid=rule.rid, alone=True)
        while True:
            # Wait for other threads' attempts on the socket, but never past this request's deadline.
            if not self._lock.acquire(timeout=max(rule.remaining(), 0.0)):
                raise rule.expired()
            try:
                end = time.monotonic() + rule.next_attempt()  # the send and the wait for the reply share the attempt's time
                reply = self.link.attempt(rule.data, end, answered)  # None: a lost connection, on a fresh socket next
            finally:
                self._lock.release()
            if reply is None:
                continue
            wait = rule.wait_before_retry(reply)
            if wait is None:
                return reply
            time.sleep(wait)

    # --- the operations (what each sends: client/operations.py) ----------------------------
    def _send(self, call: operations.Call) -> dict[str, Any]:
        """Make the request `call` describes; as `request`."""
        return self.request(call.op, rid=call.rid, deadline=call.deadline, **call.fields)

    def attach(self, task_id: str | None = None) -> str:
        """Create a session (or resume `task_id`); return its task id."""
        return self._send(operations.attach(task_id))["task_id"]

    def detach(self, task_id: str) -> dict[str, Any]:
        """Close the task's open segment and forget the session."""
        return self._send(operations.detach(task_id))

    def ask(self, task_id: str) -> dict[str, Any]:
        """`{"status": "ok"}` or `{"status": "wait", "retry_after_ms": ...}`."""
        return self._send(operations.ask(task_id))

    def wait_turn(self, task_id: str, deadline: float | None = None) -> None:
        """Ask until the broker says `ok` (back-pressure: it says `wait` while the learner is behind), sleeping the
        `retry_after_ms` it suggests; RequestTimeout after `deadline` seconds (default: the client's)."""
        end = self.turn_end(deadline)
        while (pause := operations.turn_pause(self.ask(task_id), end)) is not None:
            time.sleep(pause)

    def step(self, task_id: str, obs: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        """The reply map: action, logprob, probs, policy_version."""
        return self._send(operations.step(task_id, obs, rid))

    def rag_step(self, task_id: str, obs: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        """As step, for retrieval-augmented observations."""
        return self._send(operations.rag_step(task_id, obs, rid))

    def generate(
        self,
        task_id: str,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        seed: int | None = None,
        rid: str | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """A response to `prompt` (a str) or chat `messages`, written by the policy; the reply map: text,
        n_tokens, finish_reason (eos, stop or length), logprob, policy_version. Its reward goes in with
        `feedback`, as a step's. temperature 0 is greedy decoding. `deadline` (seconds, default the client's)
        bounds the request here and, sent as `deadline_ms`, at the broker (which caps it at its generate_timeout_ms)."""
        deadline = self.request_deadline(deadline)  # sent as `deadline_ms`: the broker stops when the caller does
        fields = generate_fields(task_id, prompt, messages, max_new_tokens, temperature, top_p, stop, seed, deadline, top_k)
        return self._send(operations.Call(p.OP_GENERATE, fields, rid, deadline))

    def feedback(
        self,
        task_id: str,
        reward: float,
        done: bool = False,
        truncated: bool = False,
        rid: str | None = None,
        next_obs: dict[str, Any] | None = None,
        sample: str | None = None,
    ) -> dict[str, Any]:
        """The reward of the pending step; `next_obs` (with `truncated`) is the state to bootstrap from. `sample`:
        an id for this sample, which the broker marks stored with the transition and stores once (docs/protocol.md)."""
        return self._send(operations.feedback(task_id, reward, done, truncated, rid, next_obs, sample))

    def status(self) -> dict[str, Any]:
        """The broker's figures (sessions, queue, actors, latency, counters)."""
        return self._send(operations.status())

    def ping(self) -> dict[str, Any]:
        """`{"status": "ok", "time_ms": ...}`: the broker is there and answering."""
        return self._send(operations.ping())


__all__ = ["Client", "PPOZError", "RETRIED_CODES"]
