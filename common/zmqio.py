"""Lean multipart send and receive for the hot paths.

pyzmq's `send_multipart` combines its flags through Python enums on every frame,
which costs the broker about three times the CPU of the send itself
(docs/benchmarks.md). These helpers call the socket's compiled methods with
plain int flags. Both are non-blocking: `send_frames` raises zmq.Again when the
peer's queue is full (or zmq.ZMQError EHOSTUNREACH with ROUTER_MANDATORY), and
`recv_frames` raises zmq.Again when nothing is waiting.
"""

from __future__ import annotations

import zmq
from zmq.backend import Socket as _RawSocket

_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_raw_send = _RawSocket.send
_raw_recv = _RawSocket.recv
_raw_get = _RawSocket.get


def bound(sock: zmq.Socket | None, what: str) -> zmq.Socket:
    """`sock`, once made: a socket used before its owner's start() is a programming error."""
    if sock is None:
        raise RuntimeError(f"{what} is not bound yet: start() first")
    return sock


def split_envelope(frames: list[bytes]) -> tuple[tuple[bytes, ...], bytes] | None:
    """A ROUTER's request as (envelope, body): the peer sent [empty, body] (a DEALER, or a REQ that added
    the empty frame) or [body] alone; None for any other framing. A reply goes out as [*envelope, body]."""
    if len(frames) == 3 and frames[1] == b"":
        return (frames[0], b""), frames[2]
    if len(frames) == 2:
        return (frames[0],), frames[1]
    return None


def recv_frames_and_sender(sock: zmq.Socket, curve: bool) -> tuple[list[bytes], str]:
    """`recv_frames`, and who sent the message: with CURVE the client's public key (the ZAP handler's
    User-Id, Z85), else the peer's address ("" over ipc or inproc). Unlike the routing id, both stay the
    same when a client reconnects on a new socket (the retry rule), so they can tell a retry from another
    client reusing the same rid."""
    first = _raw_recv(sock, _NOBLOCK, copy=False)
    try:
        sender = first.get("User-Id" if curve else "Peer-Address")
    except zmq.ZMQError:  # the property is not set for this transport
        sender = ""
    frames = [first.bytes]
    while _raw_get(sock, _RCVMORE):
        frames.append(_raw_recv(sock, _NOBLOCK))
    return frames, str(sender) if sender else ""


def send_frames(sock: zmq.Socket, frames: list[bytes] | tuple[bytes, ...]) -> None:
    """Send a multipart message without blocking."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _raw_send(sock, frame, _MORE_NOBLOCK if i < last else _NOBLOCK)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """Receive one whole multipart message without blocking."""
    frames = [_raw_recv(sock, _NOBLOCK)]
    while _raw_get(sock, _RCVMORE):
        frames.append(_raw_recv(sock, _NOBLOCK))
    return frames
