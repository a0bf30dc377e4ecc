"""The protocol's operations as both clients send them, built once.

client.sync.Client and client.aio.AsyncClient offer the same operations with the same signatures. Each
operation's method turns its arguments into a Call here and sends it, the blocking client by waiting and the
asyncio one by awaiting; what an operation sends (its op, its fields in the order of docs/protocol.md's
examples, its rid and deadline) and what `wait_turn` does with each answer are decided here, so the two clients cannot
drift apart. The fields of `generate` and `feedback` are client/retry.py's `generate_fields` and `feedback_fields`
(the dataset driver builds a generate request too); a `generate` Call carries the request's deadline, which also
goes to the broker as `deadline_ms`, so the client puts in its default first (ClientBase.request_deadline).
Nothing here touches a socket or sleeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from client.errors import RequestTimeout
from client.retry import RetryRule, check_timeouts, feedback_fields
from common import protocol as p
from common.security import KeySource, client_keys

# The pause between asks when a `wait` answer names none.
DEFAULT_TURN_PAUSE_MS = 100


@dataclass(frozen=True)
class Call:
    """One request of an operation: its `op` and `fields`, the caller's `rid` (None: a fresh one) and
    `deadline` in seconds (None: the client's)."""

    op: str
    fields: dict[str, Any] = field(default_factory=dict)
    rid: str | None = None
    deadline: float | None = None


class ClientBase:
    """What Client and AsyncClient hold alike: the endpoint, the default `deadline` and `attempt_timeout` (seconds,
    checked here), and the CURVE keys (loaded once, set on every socket the client opens; missing or bad keys
    raise KeyFileError, a ValueError)."""

    def __init__(
        self,
        endpoint: str,
        deadline: float,
        attempt_timeout: float,
        curve_secret_key: KeySource | None,
        curve_server_key: KeySource | None,
    ) -> None:
        check_timeouts(deadline, attempt_timeout)
        self.endpoint = endpoint
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.curve = client_keys(curve_secret_key, curve_server_key)

    def request_deadline(self, deadline: float | None) -> float:
        """The seconds a request may take: the caller's `deadline`, else the client's."""
        return self.deadline if deadline is None else deadline

    def retry_rule(self, op: str, rid: str | None, fields: dict[str, Any], deadline: float | None) -> RetryRule:
        """The attempts of one request under the protocol's retry rule (client/retry.py)."""
        return RetryRule(op, rid, fields, self.request_deadline(deadline), self.attempt_timeout)

    def turn_end(self, deadline: float | None) -> float:
        """When `wait_turn` gives up (time.monotonic()): `deadline` seconds from now, default the client's."""
        return time.monotonic() + self.request_deadline(deadline)


def turn_pause(answer: dict[str, Any], end: float) -> float | None:
    """What `wait_turn` does after `answer` to an ask: None when the broker did not say `wait` (the turn is
    the caller's), else the seconds to sleep before asking again (its `retry_after_ms`); RequestTimeout when
    that sleep would end past `end` (time.monotonic())."""
    if answer.get("status") != "wait":
        return None
    pause = answer.get("retry_after_ms", DEFAULT_TURN_PAUSE_MS) / 1000
    if time.monotonic() + pause > end:
        raise RequestTimeout(f"the broker kept saying wait ({answer.get('reason', '')}) past the deadline")
    return pause


def attach(task_id: str | None) -> Call:
    """A new session, or `task_id`'s resumed (a task id is sent only when given)."""
    return Call(p.OP_ATTACH, {"task_id": task_id} if task_id else {})


def detach(task_id: str) -> Call:
    return Call(p.OP_DETACH, {"task_id": task_id})


def ask(task_id: str) -> Call:
    return Call(p.OP_ASK, {"task_id": task_id})


def step(task_id: str, obs: dict[str, Any], rid: str | None) -> Call:
    return Call(p.OP_STEP, {"task_id": task_id, "obs": obs}, rid)


def rag_step(task_id: str, obs: dict[str, Any], rid: str | None) -> Call:
    return Call(p.OP_RAG_STEP, {"task_id": task_id, "obs": obs}, rid)


def feedback(
    task_id: str,
    reward: float,
    done: bool,
    truncated: bool,
    rid: str | None,
    next_obs: dict[str, Any] | None,
    sample: str | None,
) -> Call:
    return Call(p.OP_FEEDBACK, feedback_fields(task_id, reward, done, truncated, next_obs, sample), rid)


def status() -> Call:
    return Call(p.OP_STATUS)


def ping() -> Call:
    return Call(p.OP_PING)
