"""A drop-in for Kea's HTTP PPOClient (kea/api_interface.py) that speaks the PPOZ protocol.

Why: Kea's input policy calls `PPOClient(base_url=...)` with attach, ask,
step/rag_step, feedback and detach, and reads a few keys of the JSON replies
(`task_id` after attach, `status` after ask, `action` after a step). This class keeps those names,
arguments and reply shapes, so a Kea build moves from the PPOAPI HTTP server to
a PPOZ broker by changing one import:

    from client.ppoapi import PPOClient        # was: from kea.api_interface import PPOClient
    client = PPOClient(base_url="tcp://localhost:5555")

What differs from the HTTP client: requests have a deadline and are retried
under the protocol's rule (client/retry.py) instead of waiting forever, and an
error reply raises its client.errors.PPOZError subclass where the HTTP client
raised requests' HTTPError. Kea logs any exception and skips the step, so both
end the same way. `generate` asks the policy for a response (generation-mode PPO).
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from client.sync import Client
from common.security import KeySource

log = logging.getLogger(__name__)

HEADER_FIELDS = frozenset({"proto", "v", "op", "rid"})


def _without_header(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply as the HTTP server's JSON: the protocol header left out."""
    return {k: v for k, v in reply.items() if k not in HEADER_FIELDS}


class PPOClient:
    """Kea's PPOClient over ZeroMQ: one task at a time, its id in `task_id` (None until attach).

    `base_url`: the broker's client endpoint (tcp://host:port); `deadline`: the
    longest a call may take, retries included (s); `attempt_timeout`: the longest
    wait for one attempt's reply (s); `context`: a zmq.Context to use instead of
    the process-wide one; `curve_secret_key`, `curve_server_key`: CURVE keys, as for
    client.sync.Client (docs/security.md). Safe to share between threads (calls go one at a time).
    """

    def __init__(
        self,
        base_url: str = "tcp://localhost:5555",
        deadline: float = 60.0,
        attempt_timeout: float = 10.0,
        context: zmq.Context | None = None,
        curve_secret_key: KeySource | None = None,
        curve_server_key: KeySource | None = None,
    ) -> None:
        scheme = base_url.split("://", 1)[0].lower() if "://" in base_url else ""
        if scheme in ("http", "https"):
            raise ValueError(
                f"`base_url` must be the PPOZ broker's ZeroMQ endpoint (such as tcp://localhost:5555), got {base_url!r}: "
                "this PPOClient speaks ZeroMQ, not HTTP; keep kea.api_interface.PPOClient for an HTTP PPOAPI server"
            )
        if not scheme:
            raise ValueError(f"`base_url` must be a ZeroMQ endpoint such as tcp://localhost:5555, got {base_url!r}")
        self.base_url = base_url
        self.task_id: str | None = None
        self.client = Client(
            base_url,
            deadline=deadline,
            attempt_timeout=attempt_timeout,
            context=context,
            curve_secret_key=curve_secret_key,
            curve_server_key=curve_server_key,
        )

    def close(self) -> None:
        """Close the socket (Kea never calls it; the process exit does the same)."""
        self.client.close()

    def __enter__(self) -> PPOClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attached(self) -> str:
        if not self.task_id:
            raise ValueError("Task not attached.")
        return self.task_id

    def attach(self) -> str:
        """Start a new task; store and return its id."""
        self.task_id = self.client.attach()
        log.info("attached new task %s", self.task_id)
        return self.task_id

    def detach(self) -> None:
        """End the task (its open segment goes to the learner) and forget its id."""
        if not self.task_id:
            raise ValueError("No task_id to detach.")
        self.client.detach(self.task_id)
        log.info("detached task %s", self.task_id)
        self.task_id = None

    def ask(self) -> dict[str, Any]:
        """`{"status": "ok"}`, or `{"status": "wait", "retry_after_ms": int, "reason": str}` under back-pressure."""
        reply = self.client.ask(self._attached())
        return {k: reply[k] for k in ("status", "retry_after_ms", "reason") if k in reply}

    def step(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Choose among `obs["action"]`: `{"task_id", "status": "ok", "action": int, "logprob", "probs", "policy_version"}`."""
        return _without_header(self.client.step(self._attached(), obs))

    def rag_step(self, obs: dict[str, Any]) -> dict[str, Any]:
        """As step, for Kea's retrieval-augmented mode."""
        return _without_header(self.client.rag_step(self._attached(), obs))

    def feedback(self, reward: float, done: bool, next_obs: dict[str, Any] | None = None, *, truncated: bool = False) -> dict[str, Any]:
        """The reward of the last step: `{"status": "ok", "task_id", "segment_closed": bool}`.

        `next_obs` is sent only when it is a real observation (Kea sends `{}`);
        the broker uses it only with `truncated`, as the state to bootstrap from.
        """
        task_id = self._attached()
        # Kea's rewards and flags may be numpy scalars; the protocol wants plain float and bool.
        reply = self.client.feedback(task_id, float(reward), done=bool(done), truncated=bool(truncated), next_obs=next_obs or None)
        return _without_header(reply)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """A response written by the policy to `prompt` (or chat `messages`): `{"task_id", "status": "ok", "text",
        "n_tokens", "finish_reason", "logprob", "policy_version"}`. Its reward goes in with `feedback`, as a step's.
        `deadline` (seconds, default the client's) bounds it here and at the broker."""
        reply = self.client.generate(
            self._attached(),
            prompt,
            messages=messages,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            deadline=deadline,
        )
        return _without_header(reply)


__all__ = ["PPOClient"]
