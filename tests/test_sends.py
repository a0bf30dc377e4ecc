"""No ZeroMQ send in product code can block for ever (issue 41; docs/testing.md, "Sends that cannot block").

A send on a DEALER with no connection to queue on (its broker refused the CURVE handshake) or with a full queue
(its peer stopped reading) waits for ever unless told otherwise: the thread hangs, and with it reconnects, shutdown
and the context's termination. So every call named like a ZeroMQ send (`.send`, `.send_multipart`, `.send_string`,
`.send_json`, `.send_pyobj`, `.send_serialized`, `send_frames`) in the product packages must be one of:

- non-blocking: `zmq.NOBLOCK` (or `zmq.DONTWAIT`) among its arguments;
- bounded: the function it is in sets `zmq.SNDTIMEO` before it;
- common/zmqio.py's `send_frames`, which never blocks (checked below on a socket with no peer);
- listed in LISTED with the reason it cannot block, or is not ZeroMQ at all.

A listed call that no longer exists fails too, so the list stays true. `python -m tests.test_sends` prints every
send with how it is bounded.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator

import pytest
import zmq

from common.zmqio import send_frames
from tests.test_layering import LAYERS, ROOT

SEND_METHODS = {"send", "send_multipart", "send_string", "send_json", "send_pyobj", "send_serialized"}
NON_BLOCKING_FLAGS = {"NOBLOCK", "DONTWAIT"}

# (file, the call's callee as written) -> why it cannot block for ever
LISTED = {
    ("client/aio.py", "sock.send_multipart"): "awaited inside asyncio.wait_for(..., the attempt's timeout) (AsyncClient._attempt);"
    " a timed-out attempt closes the socket (linger 0), which drops the cancelled send (tests/client/test_refused_send.py)",
    ("common/sd_notify.py", "self.send"): "Notifier.send: a datagram to systemd on a non-blocking UNIX socket, not ZeroMQ",
    ("broker/outbox.py", "self.committer.send"): "a Redis command on the broker's Redis connection (socket timeout), not ZeroMQ",
    ("tools/bench/broker.py", "self.send"): "the bench client's own method, which sends with send_frames",
    ("tools/bench/weights_hosts.py", "conn.send"): "a plain TCP socket (the bridge's own rate, measured beside ZeroMQ), not ZeroMQ",
}


def sends() -> list[tuple[str, int, str, str]]:
    """(file, line, callee, how it is bounded or "") for every send-like call in the product packages, in file order."""
    return sorted(_sends())


def _sends() -> Iterator[tuple[str, int, str, str]]:
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), rel)
            for function in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
                for call in _own_calls(function):
                    callee = ast.unparse(call.func)
                    if _is_send(call):
                        yield rel, call.lineno, callee, _bound(rel, function, call, callee)


def _own_calls(scope: ast.AST) -> Iterator[ast.Call]:
    """The calls in `scope`, not those of the functions defined inside it (they are scopes of their own)."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and scope is not child:
            if isinstance(child, ast.ClassDef):
                yield from _own_calls(child)  # a class body's statements run in the enclosing scope
            continue
        if isinstance(child, ast.Call):
            yield child
        yield from _own_calls(child)


def _is_send(call: ast.Call) -> bool:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr in SEND_METHODS
    return isinstance(call.func, ast.Name) and call.func.id == "send_frames"


def _bound(rel: str, function: ast.AST, call: ast.Call, callee: str) -> str:
    args = [*call.args, *(k.value for k in call.keywords)]
    if any(isinstance(n, ast.Attribute) and n.attr in NON_BLOCKING_FLAGS for a in args for n in ast.walk(a)):
        return "zmq.NOBLOCK"
    if callee == "send_frames":
        return "send_frames (zmq.NOBLOCK)"
    if any(
        isinstance(c, ast.Call)
        and isinstance(c.func, ast.Attribute)
        and c.func.attr == "setsockopt"
        and c.lineno < call.lineno
        and any(isinstance(n, ast.Attribute) and n.attr == "SNDTIMEO" for n in ast.walk(c))
        for c in _own_calls(function)
    ):
        return "zmq.SNDTIMEO set before it"
    reason = LISTED.get((rel, callee))
    return f"listed: {reason}" if reason else ""


def test_every_zeromq_send_in_product_code_is_bounded() -> None:
    found = sends()
    assert len(found) > 20, f"only {len(found)} sends found: is the scan still reading the product packages?"
    unbounded = [f"{rel}:{line}: {callee}(...)" for rel, line, callee, bound in found if not bound]
    assert not unbounded, (
        "ZeroMQ sends that can block for ever; pass zmq.NOBLOCK (with a retry policy), set zmq.SNDTIMEO before them,"
        " or list them in LISTED with the reason they cannot block:\n" + "\n".join(unbounded)
    )
    used = {(rel, callee) for rel, _, callee, bound in found if bound.startswith("listed")}
    assert not set(LISTED) - used, f"LISTED names sends that no longer exist: {sorted(set(LISTED) - used)}"


def test_send_frames_never_waits() -> None:
    """send_frames on a DEALER with no peer at all (nothing to queue on): zmq.Again at once, not a wait."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(zmq.Again):
            send_frames(sock, [b"", b"nobody"])
    finally:
        sock.close(linger=0)
        ctx.term()


def main() -> int:
    for rel, line, callee, bound in sends():
        print(f"{rel}:{line}: {callee}(...)  {bound or 'UNBOUNDED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
