"""One DEALER socket to one endpoint, replaced after an attempt that got no reply: the transport of the clients that
send one request at a time and retry it.

Two clients send this way: the broker's blocking client (client/sync.py, under the protocol's retry rule,
client/retry.py) and the reward service's (rewards/service/client.py, under the service's tries). They sit side by
side in the layers, so what they share is here, below both: how a socket is opened, how one attempt is sent and
answered, and when the socket is replaced. What a reply means and when to send again stays with each client.

- An attempt's send and its wait for the reply share the attempt's time (`end`). The send is bounded by
  zmq.SNDTIMEO: a DEALER with no connection to queue on (its peer refused our CURVE handshake) or with a full
  queue would otherwise wait for ever (tests/test_sends.py), and then the attempt fails as one without a reply.
- An attempt that got no reply closes the socket (linger 0) and the next one opens a fresh one: the old socket's
  queue to a dead peer would otherwise be delivered to the next peer at that address, and a late reply on it to
  an earlier attempt could be read as this one's.
- A reply that cannot be decoded, or that the caller's `answers` does not accept (a late answer to an attempt
  given up on), is passed over.

Not thread-safe: a client with several threads holds its own lock around each attempt.

How a client's DEALER is opened (`open_dealer`) is shared with the asyncio client too (client/aio.py), which
keeps many requests in flight and so has its own attempts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from common import protocol as p
from common.security import ClientKeys

SocketT = TypeVar("SocketT", bound=zmq.Socket)


def open_dealer(context: zmq.Context[SocketT], endpoint: str, curve: ClientKeys | None) -> SocketT:
    """A client's DEALER to `endpoint`, connected: linger 0 (closing it drops what it had queued), with the CURVE
    keys `curve` (None: plain) set before it connects. A blocking context gives a blocking socket, an asyncio
    one an asyncio socket."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    sock.connect(endpoint)
    return sock


class ReconnectingDealer:
    """The socket of a client with one request in flight at a time, to `endpoint`; opened when first needed, with
    the CURVE keys `curve` (None: plain) set before it connects. `wait_to_send`: a request the socket cannot
    take at once waits for it until the attempt's end (the broker's client), or fails the attempt at once (the
    reward service's client, which sends every attempt on a fresh socket and would rather try again)."""

    def __init__(self, endpoint: str, context: zmq.Context, curve: ClientKeys | None, wait_to_send: bool = True) -> None:
        self.endpoint = endpoint
        self.ctx = context
        self.curve = curve
        self.wait_to_send = wait_to_send
        self.sock: zmq.Socket | None = None
        self.sends = 0  # attempts the socket took, retries included (for tests and diagnostics)

    def socket(self) -> zmq.Socket:
        """The current socket, opened and connected if there is none."""
        if self.sock is None:
            self.sock = open_dealer(self.ctx, self.endpoint, self.curve)
        return self.sock

    def reset(self) -> None:
        """Close the socket (linger 0: what it had queued is dropped); the next attempt opens a new one."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def attempt(self, data: bytes, end: float, answers: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """Send `data` as [empty frame, data] and wait for the reply `answers` accepts, both by `end`
        (time.monotonic()); None when none came by then, or the socket would not take the request: the socket is
        then replaced."""
        sock = self.socket()
        reply = self._await(sock, end, answers) if self._send(sock, data, end) else None
        if reply is None:
            self.reset()  # a lost connection, or a peer gone: the next attempt starts on a fresh socket
        return reply

    def _send(self, sock: zmq.Socket, data: bytes, end: float) -> bool:
        """Send by `end`; False if the socket would not take it (no connection to queue on, or a full queue)."""
        sock.setsockopt(zmq.SNDTIMEO, max(int((end - time.monotonic()) * 1000), 1))
        try:
            sock.send_multipart([b"", data], flags=0 if self.wait_to_send else zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.sends += 1
        return True

    @staticmethod
    def _await(sock: zmq.Socket, end: float, answers: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                return None
            try:
                reply = p.decode(sock.recv_multipart()[-1])
            except p.ProtocolError:
                continue
            if answers(reply):
                return reply
        return None
