"""An asyncio client: many requests in flight on one DEALER socket, matched to replies by rid.

Why a second client: an emulator farm driven from one event loop (or a
simulator with hundreds of tasks) wants many requests outstanding at once
without a thread each. The protocol allows it: one DEALER socket may carry
requests for many tasks, and every reply carries its request's rid
(docs/protocol.md, section 1).

Design: one reader task per socket receives every reply and resolves the
futures waiting for its rid; each request registers a future, sends, and awaits
it with the attempt timeout. The retry rule is client/retry.py's, the same one
the blocking client follows. An attempt that gets no reply replaces the socket,
as the rule says; every other request in flight on the old socket is then
sent again at once, with its own rid, on the new one (the broker answers a
repeated rid with its first reply and applies it once, so this is safe).
A reply with `rid: nil` (a request whose rid the broker could not read) is the
answer of the one request in flight when only one is; with several it matches
none and is logged (docs/protocol.md, section 4). Every rid is checked before
it is sent (client/retry.py), so this client never causes one.

Use an AsyncClient from one event loop (the one it was first used in); it is
not thread-safe. `close()` is final: in-flight requests fail with RuntimeError.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
import zmq.asyncio

import client.operations as operations
from client.retry import RetryRule, answers, generate_fields
from common import protocol as p
from common.reconnecting import open_dealer
from common.security import KeySource

log = logging.getLogger(__name__)


class AsyncClient(operations.ClientBase):
    """Asyncio PPOZ client with the blocking Client's operations, as coroutines.

    `deadline`: default overall time per request (s); `attempt_timeout`: longest
    wait for one attempt's reply (s); `context`: a zmq.asyncio.Context, or a
    blocking zmq.Context to share (its asyncio shadow is used), default the
    process-wide asyncio context. `curve_secret_key`, `curve_server_key`: CURVE
    keys, as for client.sync.Client (docs/security.md).
    """

    def __init__(
        self,
        endpoint: str,
        deadline: float = 60.0,
        attempt_timeout: float = 10.0,
        context: zmq.asyncio.Context | zmq.Context | None = None,
        curve_secret_key: KeySource | None = None,
        curve_server_key: KeySource | None = None,
    ) -> None:
        super().__init__(endpoint, deadline, attempt_timeout, curve_secret_key, curve_server_key)
        if context is None:
            self.ctx: zmq.asyncio.Context = zmq.asyncio.Context.instance()
        elif isinstance(context, zmq.asyncio.Context):
            self.ctx = context
        else:
            self.ctx = zmq.asyncio.Context(context)  # a shadow: same io threads, asyncio sockets, not owned
        self.attempts = 0  # sends, retries and resends included (for tests and diagnostics)
        self.requests = 0  # requests made; attempts - requests counts the resends (and attempts cut short before sending)
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiters: dict[Any, list[asyncio.Future[dict[str, Any] | None]]] = {}
        self._closed = False

    # --- the socket and its reader ---------------------------------------------------------
    def _open(self) -> zmq.asyncio.Socket:
        """The current socket, opened (with its reader task) if there is none."""
        if self._closed:
            raise RuntimeError(f"this AsyncClient ({self.endpoint}) is closed")
        if self._sock is None:
            sock = open_dealer(self.ctx, self.endpoint, self.curve)
            self._sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read(sock), name=f"ppoz-reader {self.endpoint}")
        return self._sock

    def _drop(self, sock: zmq.asyncio.Socket, error: BaseException | None = None) -> None:
        """Close `sock` if it is still the current one; its waiters resend (or fail with `error`)."""
        if sock is not self._sock:
            return  # another request has already replaced it
        self._sock = None
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        sock.close(linger=0)
        for futures in self._waiters.values():
            for future in futures:
                if not future.done():
                    if error is None:
                        future.set_result(None)  # "send again on the new socket"
                    else:
                        future.set_exception(error)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        """Give each reply to the requests waiting for its rid; drop the rest."""
        try:
            while True:
                frames = await sock.recv_multipart()
                self._dispatch(frames)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the socket failed under us (its context terminated, say)
            log.warning("reading replies from %s failed: %s", self.endpoint, e)
            self._drop(sock, e)

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            reply = p.decode(frames[-1])
        except p.ProtocolError as e:
            log.warning("ignoring an undecodable reply from %s: %s", self.endpoint, e)
            return
        rid = reply.get("rid")
        if rid is None and len(self._waiters) == 1:  # the broker could not read a rid: the one request in flight is its cause
            rid = next(iter(self._waiters))
        futures = self._waiters.get(rid) if isinstance(rid, (str, bytes)) else None
        if not futures or not answers(reply, rid, alone=True):
            if reply.get("rid") is None:  # never from a request of this client (each rid is checked before sending)
                log.warning(
                    "a reply with rid nil from %s matches none of %d requests in flight: %s",
                    self.endpoint,
                    len(self._waiters),
                    reply.get("error"),
                )
            else:
                log.debug("ignoring a reply nobody waits for (rid %r): a late answer to an earlier attempt", rid)
            return
        for future in futures:
            if not future.done():
                future.set_result(reply)

    def _forget(self, rid: Any, future: asyncio.Future[dict[str, Any] | None]) -> None:
        futures = self._waiters.get(rid)
        if futures is not None and future in futures:
            futures.remove(future)
            if not futures:
                del self._waiters[rid]

    # --- requests ----------------------------------------------------------------------------
    async def request(self, op: str, rid: str | None = None, deadline: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply map; raise the error's exception class (client/errors.py)."""
        rule = self.retry_rule(op, rid, fields, deadline)
        self.requests += 1
        while True:
            reply = await self._attempt(rule, rule.next_attempt())
            if reply is None:
                continue  # no reply, or the socket was replaced under it: next_attempt() says if time is left
            wait = rule.wait_before_retry(reply)
            if wait is None:
                return reply
            await asyncio.sleep(wait)

    async def _attempt(self, rule: RetryRule, timeout: float) -> dict[str, Any] | None:
        """Send once and wait up to `timeout` for the reply; None if none came (the socket is then replaced)."""
        sock = self._open()
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(rule.rid, []).append(future)  # before sending: the reply may come at once
        try:
            self.attempts += 1
            return await asyncio.wait_for(self._send_and_wait(sock, rule.data, future), timeout)
        except asyncio.TimeoutError:
            self._drop(sock)  # a lost connection: this and every request in flight on it go again on a fresh socket
            return None
        finally:
            self._forget(rule.rid, future)

    @staticmethod
    async def _send_and_wait(sock: zmq.asyncio.Socket, data: bytes, future: asyncio.Future[dict[str, Any] | None]) -> dict[str, Any] | None:
        try:
            await sock.send_multipart([b"", data])
        except asyncio.CancelledError:
            # Closing a socket cancels its pending sends: another request replaced it
            # while this send waited (at the high-water mark), so send again on the new one.
            if sock.closed:
                return None
            raise
        return await future

    # --- life cycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Close the socket and stop the reader; requests still waiting fail with RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        sock, reader = self._sock, self._reader
        if sock is not None:
            self._drop(sock, RuntimeError(f"this AsyncClient ({self.endpoint}) was closed while the request waited"))
        if reader is not None:
            await asyncio.wait([reader])  # let the cancelled reader finish (never raises, even if it failed)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the operations (as client.sync.Client's; what each sends: client/operations.py) -------
    async def _send(self, call: operations.Call) -> dict[str, Any]:
        """Make the request `call` describes; as `request`."""
        return await self.request(call.op, rid=call.rid, deadline=call.deadline, **call.fields)

    async def attach(self, task_id: str | None = None) -> str:
        """Create a session (or resume `task_id`); return its task id."""
        return (await self._send(operations.attach(task_id)))["task_id"]

    async def detach(self, task_id: str) -> dict[str, Any]:
        """Close the task's open segment and forget the session."""
        return await self._send(operations.detach(task_id))

    async def ask(self, task_id: str) -> dict[str, Any]:
        """`{"status": "ok"}` or `{"status": "wait", "retry_after_ms": ...}`."""
        return await self._send(operations.ask(task_id))

    async def wait_turn(self, task_id: str, deadline: float | None = None) -> None:
        """As Client.wait_turn: ask until `ok`, sleeping the suggested `retry_after_ms`; RequestTimeout past `deadline`."""
        end = self.turn_end(deadline)
        while (pause := operations.turn_pause(await self.ask(task_id), end)) is not None:
            await asyncio.sleep(pause)

    async def step(self, task_id: str, obs: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        """The reply map: action, logprob, probs, policy_version."""
        return await self._send(operations.step(task_id, obs, rid))

    async def rag_step(self, task_id: str, obs: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        """As step, for retrieval-augmented observations."""
        return await self._send(operations.rag_step(task_id, obs, rid))

    async def generate(
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
        return await self._send(operations.Call(p.OP_GENERATE, fields, rid, deadline))

    async def feedback(
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
        return await self._send(operations.feedback(task_id, reward, done, truncated, rid, next_obs, sample))

    async def status(self) -> dict[str, Any]:
        """The broker's figures (sessions, queue, actors, latency, counters)."""
        return await self._send(operations.status())

    async def ping(self) -> dict[str, Any]:
        """`{"status": "ok", "time_ms": ...}`: the broker is there and answering."""
        return await self._send(operations.ping())


__all__ = ["AsyncClient"]
