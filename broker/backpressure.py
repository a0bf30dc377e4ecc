"""Back-pressure: whether a client may step now, and the asks and steps held until it may.

An `ask` is answered `ok`, or `wait` with the reason and a retry_after_ms:
draining, no actor, the step queue full (for this client: broker/scheduling.py),
or the segment stream's backlog over its limit. Under that last, with
`ask_hold_ms` set, the broker holds the ask instead (a long poll) and
`release_asks` answers it once the learner has read the backlog down, or when
it has been held `ask_hold_ms`. broker/client_ops.py receives the asks.

Many clients never ask (PPOAPI's Kea builds call attach, step and feedback only).
Their steps meet the backlog in the queue instead: while it is over its limit, a
step waits there, not sent to an actor, until the learner has read it down, or
for at most `step_hold_share` of its deadline (`hold_over`), so that it is still
answered in time (broker/actor_ops.py's dispatch). Without this a farm that steps
faster than the learner trains filled the stream with steps the learner then
dropped as older than its lag bound: 89% of them with 4 Kea emulators (issue 55).
"""

from __future__ import annotations

from typing import Any

from broker.actors import Job
from broker.state import BrokerState
from common import protocol as p

ASK_RECHECK_S = 0.01  # while asks or steps are held: how often the stream's length is re-read from Redis


def hold_over(job: Job, now: float, share: float) -> bool:
    """Whether a job held for the stream backlog has waited `share` of its deadline (`step_hold_share`), and goes to an
    actor even though the backlog is still over its limit (so that its client is answered in time)."""
    return job.abandoned or now >= job.created + share * (job.deadline - job.created)


class Backpressure(BrokerState):
    """Who may step now, and the answers to held asks."""

    def _answer_ask(self, envelope: tuple[bytes, ...], rid: Any, task_id: str, reason: str) -> None:
        """`ok`, or `wait` for `reason`: retry_after_ms 1 for a held ask let go over the backlog (ask again at once: a long
        poll), the configured retry_after_ms for any other reason."""
        body = p.header(p.OP_ASK, rid)
        body.update(task_id=task_id, status="ok")
        if reason:
            retry = 1 if reason == "stream_backlog" and self.cfg.ask_hold_ms else self.cfg.retry_after_ms
            body.update(status="wait", retry_after_ms=retry, reason=reason)
            self.metrics["broker/ask_wait"] += 1
        self.reply(envelope, body)

    def release_asks(self, closing: bool = False) -> None:
        """Answer the held asks: all `ok` once the stream backlog is under its limit (re-read every ASK_RECHECK_S
        while any is held, so clients resume within moments of the learner's read instead of a retry_after_ms
        sleep); `wait` to those held ask_hold_ms, with retry_after_ms 1 (ask again at once: a long poll), or with
        the usual retry_after_ms once another reason holds (draining, no actor, ...) or the broker is closing."""
        if not self.held_asks:
            return
        reason = "draining" if closing else "storage" if not self.storage_ok else self._backpressure(None)
        while self.held_asks:
            task_id, (envelope, rid, until) = next(iter(self.held_asks.items()))
            if reason == "stream_backlog" and until > self.now:
                return  # the oldest is not due yet, nor is any younger one
            del self.held_asks[task_id]
            self._answer_ask(envelope, rid, task_id, reason)

    def _backpressure(self, client: bytes | None) -> str:
        """Why a client may not step now ("" if it may); `client` None: why nobody may (the queue full in all)."""
        if self.draining:
            return "draining"
        if not self.registry.actors:
            return "no_actor"
        if (len(self.queue) >= self.cfg.max_queue) if client is None else not self.queue.admits(client, self.cfg.max_queue):
            return "queue_full"
        if self.over_backlog:
            return "stream_backlog"
        return ""

    def recheck_backlog(self) -> None:
        """While asks or steps wait for the stream backlog, re-read it every ASK_RECHECK_S, so that they go on within
        moments of the learner's read."""
        if (self.held_asks or self.holding_steps) and self.now - self._stream_read_at >= ASK_RECHECK_S:
            self._refresh_stream_state()
