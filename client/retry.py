"""The protocol's retry rule, written once for the blocking and the asyncio client.

docs/protocol.md (section 5) says how a client sends one request: a fresh rid,
attempts of at most `attempt_timeout` each, a new socket after an attempt that
got no reply, a wait (`retry_after_ms`, else 100 ms) and the same rid again after
`overloaded`, `timeout` or `internal`, any other error raised at once, and
RequestTimeout once the caller's deadline has passed. A reply with `rid: nil`
is the broker's answer to a request it could not read a rid from: final, never
retried (section 4). client/sync.py and
client/aio.py differ only in how they wait (a poll or an await); what they
send and what each reply means is decided here, so the two cannot drift apart.
Nothing here touches a socket or sleeps.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from client.errors import RequestTimeout, from_reply
from common import protocol as p

# Error codes that mean "nothing was applied, send the same request again".
RETRIED_CODES = frozenset({p.E_OVERLOADED, p.E_TIMEOUT, p.E_INTERNAL})
# The wait before a retry when the error reply suggests none (docs/protocol.md, rule 4).
DEFAULT_RETRY_AFTER_S = 0.1


def new_rid() -> str:
    """A request id unique across clients and restarts (32 hex characters)."""
    return uuid.uuid4().hex


def build_request(op: str, rid: Any = None, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of one request: the header (with a fresh rid unless one is given) and `fields`.

    A given rid is checked here (a str or bin of 1 to 64 bytes, a str counted in UTF-8): one the
    broker cannot read would be answered with `rid: nil`, which a client with several requests
    in flight cannot match (docs/protocol.md, section 4). ValueError names it."""
    if rid is None:
        rid = new_rid()
    try:
        p.check_rid(rid)
    except p.ProtocolError as e:
        raise ValueError(e.message) from None
    body = p.header(op, rid)
    body.update(fields or {})
    return body


def answers(reply: dict[str, Any], rid: Any, alone: bool) -> bool:
    """Whether `reply` is the answer to the request with this `rid`.

    Its own rid (str and bin kept apart), or `rid: nil` when that request is the only one
    in flight on the socket (`alone`): the broker could not read the request's rid, so its
    reply names none; with several in flight it cannot be told which one it answers."""
    got = reply.get("rid")
    if got is None:
        return alone and "error" in reply
    return type(got) is type(rid) and got == rid


def feedback_fields(
    task_id: str,
    reward: float,
    done: bool = False,
    truncated: bool = False,
    next_obs: dict[str, Any] | None = None,
    sample: str | None = None,
) -> dict[str, Any]:
    """The fields of a `feedback` request; `next_obs` goes out only when it is a non-empty observation,
    `sample` (the caller's id for this sample, stored once: docs/protocol.md) only when given.

    Older Kea clients send `next_obs: {}`, which means "none"; leaving it out says
    the same thing in fewer bytes.
    """
    fields: dict[str, Any] = {"task_id": task_id, "reward": reward, "done": done, "truncated": truncated}
    if next_obs:
        fields["next_obs"] = next_obs
    if sample is not None:
        fields["sample"] = sample
    return fields


def generate_fields(
    task_id: str,
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop: list[str] | None,
    seed: int | None,
    deadline: float | None,
    top_k: int = 0,
) -> dict[str, Any]:
    """The fields of a `generate` request: exactly one of `prompt` and `messages`, the sampling settings,
    and `deadline_ms` when the caller gave a deadline (the broker's default otherwise)."""
    if (prompt is None) == (messages is None):
        raise ValueError("generate needs exactly one of `prompt` (a str) and `messages` (a list of {role, content})")
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    if stop:
        sampling["stop"] = list(stop)
    if seed is not None:
        sampling["seed"] = seed
    if top_k:
        sampling["top_k"] = top_k
    fields: dict[str, Any] = {"task_id": task_id}
    fields.update({"prompt": prompt} if prompt is not None else {"messages": messages})
    fields["sampling"] = sampling  # after the prompt: the key order of docs/protocol.md and the conformance vectors
    if deadline is not None:
        fields["deadline_ms"] = max(1, int(deadline * 1000))
    return fields


def check_timeouts(deadline: float, attempt_timeout: float) -> None:
    """Refuse deadlines a client could never meet, naming the bad value."""
    if not (isinstance(deadline, (int, float)) and deadline > 0 and math.isfinite(deadline)):
        raise ValueError(f"`deadline` must be a positive number of seconds, got {deadline!r}")
    if not (isinstance(attempt_timeout, (int, float)) and attempt_timeout > 0 and math.isfinite(attempt_timeout)):
        raise ValueError(f"`attempt_timeout` must be a positive number of seconds, got {attempt_timeout!r}")


def retry_after(reply: dict[str, Any]) -> float:
    """Seconds to wait before resending after a retried error: the reply's `retry_after_ms`, else 100 ms."""
    ms = reply.get("retry_after_ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms >= 0:
        return ms / 1000
    return DEFAULT_RETRY_AFTER_S


class RetryRule:
    """The attempts of one request: its encoded body, its deadline, and what each reply means.

    A client drives it like this (the waiting is the client's own):

        rule = RetryRule(op, rid, fields, deadline, attempt_timeout)
        while True:
            timeout = rule.next_attempt()         # raises RequestTimeout past the deadline
            send rule.data; reply = wait for rule.rid, at most `timeout`
            if no reply: replace the socket; continue
            wait = rule.wait_before_retry(reply)  # raises the reply's error if it is final
            if wait is None: return reply
            sleep(wait)
    """

    def __init__(self, op: str, rid: Any, fields: dict[str, Any], deadline: float, attempt_timeout: float) -> None:
        self.op = op
        self.body = build_request(op, rid, fields)
        self.rid: Any = self.body["rid"]
        self.data = p.encode(self.body)  # encoded once: every attempt sends the same bytes
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.end = time.monotonic() + deadline

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.end - time.monotonic()

    def expired(self) -> RequestTimeout:
        """The exception for a request that got no usable reply within its deadline."""
        return RequestTimeout(f"timeout: no reply to {self.op} within {self.deadline:.1f} s")

    def next_attempt(self) -> float:
        """Seconds the next attempt may wait for its reply; raise RequestTimeout once the deadline has passed."""
        remaining = self.remaining()
        if remaining <= 0:
            raise self.expired()
        return min(remaining, self.attempt_timeout)

    def wait_before_retry(self, reply: dict[str, Any]) -> float | None:
        """None when `reply` is the answer; else the seconds to wait before sending the same request again.

        Raise the reply's exception (client/errors.py) when its code is not
        retried, or when waiting would end past the deadline: then the caller
        learns why the broker refused (say `overloaded`) rather than a bare timeout.
        """
        if "error" not in reply:
            return None
        error = from_reply(reply)
        if error.code not in RETRIED_CODES or reply.get("rid") is None:  # nil rid: the broker could not read it; resending cannot help
            raise error
        wait = retry_after(reply)
        if wait >= self.remaining():
            raise error
        return wait
