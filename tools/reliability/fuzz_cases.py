"""The fuzz's messages: seeded generators of hostile requests to the broker (ZeroMQ) and the gateway (HTTP).

Pure: a seeded `random.Random` in, a `Case` (frames, and what the broker must answer) or an `HTTPCase` out,
so the same seed sends the same messages in the same order. tools/reliability/fuzz.py sends them and checks the answers.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from common import protocol as p

LIMITS = p.Limits()
OBS = {
    "prompt": "Screen: MainActivity. History: none.",
    "question": "Which action should I choose next? I shall choose No. ",
    "action": ["0: TouchEvent(view=Shop)", "1: TouchEvent(view=Cart)", "2: KeyEvent(BACK)"],
}
FUZZ_TASK = "fuzz-t"  # the one task id the fuzz's messages name
FIELDS_BY_OP: dict[str, dict[str, Any]] = {
    p.OP_ATTACH: {"task_id": FUZZ_TASK},
    p.OP_DETACH: {"task_id": FUZZ_TASK},
    p.OP_ASK: {"task_id": FUZZ_TASK},
    p.OP_STEP: {"task_id": FUZZ_TASK, "obs": OBS, "deadline_ms": 1000},
    p.OP_RAG_STEP: {"task_id": FUZZ_TASK, "obs": OBS},
    p.OP_FEEDBACK: {"task_id": FUZZ_TASK, "reward": 1.0, "done": False, "truncated": True, "next_obs": OBS},
    p.OP_STATUS: {"window_s": 10.0},
    p.OP_PING: {},
}
# Values of every wire type, and some awkward ones of the right type.
WRONG_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x" * 300,
    "émoji🙂",
    "\x00",
    b"",
    b"\xff\xfe",
    [],
    [1, "a", None],
    {},
    {"a": {"b": []}},
    {1: 2},
    ["x"] * 300,
]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\xc0\xaf"]


@dataclass
class Case:
    """One message to send: its kind (for the report), its frames, and whether the broker must answer it."""

    kind: str
    frames: list[bytes]
    rid: Any = None  # the rid the broker can read from it, when it must echo one
    oversize: bool = False  # over MAXMSGSIZE: libzmq drops the peer, so it goes on a socket of its own

    @property
    def well_framed(self) -> bool:
        one_body = len(self.frames) == 1 or (len(self.frames) == 2 and self.frames[0] == b"")
        return one_body and not self.oversize


@dataclass
class HTTPCase:
    kind: str
    raw: bytes  # the whole request as sent on the connection (then the write side is shut)


# --- Message generators (pure: a seeded Random in, a Case out) ---------------------------------
def request_body(op: str, rid: Any, **fields: Any) -> dict[str, Any]:
    return {**p.header(op, rid), **fields}


def _pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _framed(rng: random.Random, kind: str, body: bytes, rid: Any = None) -> Case:
    """The body as a DEALER sends it: with the empty delimiter or alone, both are well framed."""
    frames = [b"", body] if rng.random() < 0.5 else [body]
    return Case(kind, frames, rid)


def gen_random_bytes(rng: random.Random, i: int) -> Case:
    return _framed(rng, "random_bytes", rng.randbytes(rng.choice([0, 1, 2, 7, 64, 1000, 20_000])))


def gen_truncated(rng: random.Random, i: int) -> Case:
    op = rng.choice(sorted(FIELDS_BY_OP))
    body = _pack(request_body(op, f"r{i}", **FIELDS_BY_OP[op]))
    return _framed(rng, "truncated_msgpack", body[: rng.randrange(0, len(body))])


def gen_wrong_type(rng: random.Random, i: int) -> Case:
    """A valid request of some op with one field (header or body, nested obs fields too) of a wrong type."""
    op = rng.choice(sorted(FIELDS_BY_OP))
    msg = request_body(op, f"r{i}", **json.loads(json.dumps(FIELDS_BY_OP[op])))
    names = [*msg, "obs.prompt", "obs.question", "obs.action", "obs.action[0]"] if "obs" in msg else list(msg)
    name = rng.choice(names)
    value = rng.choice(WRONG_VALUES)
    if name.startswith("obs."):
        sub = name[4:]
        if sub == "action[0]":
            msg["obs"]["action"][0] = value
        else:
            msg["obs"][sub] = value
    else:
        msg[name] = value
    rid = msg.get("rid")
    return _framed(rng, "wrong_type", _pack(msg), rid if _readable_rid(msg) else None)


def gen_not_a_map(rng: random.Random, i: int) -> Case:
    return _framed(rng, "not_a_map", _pack(rng.choice([[1, 2], "ppoz", 1, None, 1.5, b"x", {1: "int key"}, {b"bin": 1}])))


def gen_huge_string(rng: random.Random, i: int) -> Case:
    """Prompts, actions and rids around their limits, and bodies around max_message_bytes."""
    rid = f"r{i}"
    choice = rng.randrange(5)
    if choice == 0:
        n = LIMITS.max_prompt_chars + rng.choice([-1, 0, 1, 1000])
        body = _pack(request_body(p.OP_STEP, rid, task_id=FUZZ_TASK, obs={**OBS, "prompt": "p" * n, "question": ""}))
    elif choice == 1:
        n = LIMITS.max_action_chars + rng.choice([-1, 0, 1, 100_000])
        body = _pack(request_body(p.OP_STEP, rid, task_id=FUZZ_TASK, obs={**OBS, "action": ["a" * n]}))
    elif choice == 2:
        n = rng.choice([64, 65, 10_000])
        return _framed(rng, "huge_string", _pack(request_body(p.OP_PING, "r" * n)), "r" * n if n <= p.MAX_RID_BYTES else None)
    elif choice == 3:
        n = LIMITS.max_message_bytes + rng.choice([-100, 0, 1, 100_000])
        body = _pack(request_body(p.OP_PING, rid, pad="z" * max(0, n - 40)))  # either side of the limit
    else:
        body = _pack(request_body(p.OP_ATTACH, rid, task_id="t" * rng.choice([128, 129, 1_000_000])))
    return _framed(rng, "huge_string", body, rid if len(body) <= LIMITS.max_message_bytes else None)


def gen_oversize(rng: random.Random, i: int) -> Case:
    """Over the socket's MAXMSGSIZE: libzmq drops the connection; the broker must survive it."""
    body = _pack(request_body(p.OP_PING, f"r{i}", pad="z" * (4 * LIMITS.max_message_bytes + 70_000)))
    return Case("oversize", [b"", body], None, oversize=True)


def gen_many_candidates(rng: random.Random, i: int) -> Case:
    n = rng.choice([LIMITS.max_actions, LIMITS.max_actions + 1, 100_000])
    body = _pack(
        request_body(
            rng.choice([p.OP_STEP, p.OP_RAG_STEP]), f"r{i}", task_id=FUZZ_TASK, obs={"prompt": "p", "action": [f"{k}" for k in range(n)]}
        )
    )
    return _framed(rng, "many_candidates", body, f"r{i}")


def gen_deep_nesting(rng: random.Random, i: int) -> Case:
    """A request whose obs (or whole body) is arrays/maps nested 1000+ deep."""
    depth = rng.choice([1000, 1025, 5000, 100_000])
    nest = (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k") * depth + b"\xc0"
    if rng.random() < 0.3:
        return _framed(rng, "deep_nesting", nest)
    head = _pack(request_body(p.OP_STEP, f"r{i}", task_id=FUZZ_TASK))  # a fixmap of 5 entries: add a sixth
    body = bytes([head[0] + 1]) + head[1:] + _pack("obs") + nest
    return _framed(rng, "deep_nesting", body)


def gen_bad_utf8(rng: random.Random, i: int) -> Case:
    """A str with invalid UTF-8 bytes (same length, so the framing stays valid), or bin where str is expected."""
    rid = f"r{i}"
    if rng.random() < 0.4:
        name = rng.choice(["op", "proto", "task_id"])
        msg = request_body(p.OP_ASK, rid, task_id=FUZZ_TASK)
        msg[name] = msg[name].encode()  # bin where a str belongs
        return _framed(rng, "bin_for_str", _pack(msg), rid)
    bad = rng.choice(BAD_UTF8)
    marker = "\x01" * len(bad)
    where = rng.choice(["op", "rid", "task_id", "prompt", "action", "key"])
    fields: dict[str, Any] = {"task_id": FUZZ_TASK, "obs": {**OBS}}
    msg = request_body(p.OP_STEP, rid, **fields)
    if where == "op":
        msg["op"] = marker
    elif where == "rid":
        msg["rid"] = marker
    elif where == "task_id":
        msg["task_id"] = marker
    elif where == "prompt":
        msg["obs"]["prompt"] = marker
    elif where == "action":
        msg["obs"]["action"] = [marker]
    else:
        msg[marker] = 1
    body = _pack(msg).replace(marker.encode(), bad, 1)
    return _framed(rng, "bad_utf8", body)


def gen_bad_version(rng: random.Random, i: int) -> Case:
    msg = request_body(p.OP_PING, f"r{i}")
    if rng.random() < 0.5:
        msg["v"] = rng.choice([0, 2, -1, 2**40, "1", 1.0, True, None, [1]])
    else:
        msg["proto"] = rng.choice(["PPOZ", "", "ppoz2", None, 1, "ppo"])
    if rng.random() < 0.2:
        del msg[rng.choice(["v", "proto"])]
    return _framed(rng, "bad_version", _pack(msg), f"r{i}")


def gen_unknown_op(rng: random.Random, i: int) -> Case:
    op = rng.choice(["", "STEP", "step ", "ready", "result", "score", "heartbeat", "disconnect", "x" * 1000, "\u00e9tape", "__init__"])
    return _framed(rng, "unknown_op", _pack(request_body(op, f"r{i}", task_id=FUZZ_TASK)), f"r{i}")


def gen_valid(rng: random.Random, i: int) -> Case:
    """Well-formed requests (ping, status, and ops on a task that does not exist) among the noise."""
    op = rng.choice([p.OP_PING, p.OP_STATUS, p.OP_ASK, p.OP_STEP, p.OP_FEEDBACK, p.OP_DETACH])
    rid: Any = f"r{i}" if rng.random() < 0.7 else f"r{i}".encode()
    return _framed(rng, "valid", _pack(request_body(op, rid, **FIELDS_BY_OP[op])), rid)


def gen_bad_frames(rng: random.Random, i: int) -> Case:
    """Wrong frame counts and empty frames. Some are still well framed ([b""], [b"", b""]): those must get a reply."""
    body = _pack(request_body(p.OP_PING, f"r{i}"))
    frames = rng.choice(
        [
            [b""],
            [b"", b""],
            [b"", body, body],
            [body, body],
            [b"x", body],
            [b"", b"", body],
            [b"", body, b"", body, b""],
            [body, b"", b"", b"", b""],
            [b""] * 5,
        ]
    )
    case = Case("bad_frames", list(frames))
    return case


GENERATORS: list[tuple[Callable[[random.Random, int], Case], float]] = [
    (gen_random_bytes, 12),
    (gen_truncated, 12),
    (gen_wrong_type, 25),
    (gen_not_a_map, 4),
    (gen_huge_string, 0.3),
    (gen_many_candidates, 0.3),
    (gen_deep_nesting, 3),
    (gen_bad_utf8, 10),
    (gen_bad_version, 8),
    (gen_unknown_op, 6),
    (gen_valid, 12),
    (gen_bad_frames, 8),
]


def _readable_rid(msg: Any) -> bool:
    """Whether the broker can read an rid to echo: the body decoded to a map with a valid rid."""
    if not isinstance(msg, dict):
        return False
    rid = msg.get("rid")
    return isinstance(rid, (str, bytes)) and 0 < len(rid) <= p.MAX_RID_BYTES


def _broker_reads_rid(body: bytes) -> bool:
    if len(body) > LIMITS.max_message_bytes:
        return False
    try:
        return _readable_rid(p.decode(body))
    except p.ProtocolError:
        return False


def cases(seed: int) -> Callable[[int], Case]:
    """The i-th case of the seeded sequence (a closure over one Random, so call it with i = 0, 1, 2, ...)."""
    rng = random.Random(seed)
    gens, weights = zip(*GENERATORS)

    def case(i: int) -> Case:
        gen = rng.choices(gens, weights)[0]
        c = gen(rng, i)
        if c.rid is not None and not _broker_reads_rid(c.frames[-1]):
            # Too large, or not decodable (an int map key...): the broker still echoes an rid it can read
            # at the top level (protocol.read_header); the fuzz checks the rid only where it decodes.
            c.rid = None
        return c

    return case


# --- HTTP cases ------------------------------------------------------------------------------------
HOST_PLACEHOLDER = "gateway.invalid"  # replaced by the gateway's own host:port when sent (it refuses other Host names)


def http_request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST_PLACEHOLDER}", "Connection: close"]
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if length is not None or body:
        hdrs["Content-Length"] = str(len(body) if length is None else length)
    lines += [f"{k}: {v}" for k, v in hdrs.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def http_case(rng: random.Random, i: int) -> HTTPCase:
    path = rng.choice(["/step", "/rag_step", "/feedback", "/attach", "/ask", "/detach"])
    choice = rng.randrange(10)
    if choice == 0:
        body = rng.choice([b"{", b"{'a': 1}", b"\xff\xfe", b"[1,2]", b"null", b'"s"', b'{"task_id": }', rng.randbytes(50)])
        return HTTPCase("http_bad_json", http_request("POST", path, body))
    if choice == 1:
        body = json.dumps({"task_id": FUZZ_TASK, "obs": OBS}).encode()
        return HTTPCase("http_bad_length", http_request("POST", path, body, length=rng.choice([-1, 0, 3, len(body) + 20, 10**12])))
    if choice == 2:
        return HTTPCase(
            "http_bad_length", http_request("POST", path, b"{}", headers={"Content-Length": rng.choice(["abc", "1e3", " ", "0x10"])})
        )
    if choice == 3:
        kind = rng.randrange(3)
        if kind == 0:
            body = json.dumps({"task_id": FUZZ_TASK, "obs": {"prompt": "p" * 2_000_000, "action": ["a"]}}).encode()
        elif kind == 1:
            body = json.dumps({"task_id": FUZZ_TASK, "obs": {"prompt": "p", "action": [str(k) for k in range(100_000)]}}).encode()
        else:
            return HTTPCase("http_huge_body", http_request("POST", path, b"{", length=9 * 1024 * 1024))
        return HTTPCase("http_huge_body", http_request("POST", "/step", body))
    if choice == 4:
        method = rng.choice(["GET", "PUT", "DELETE", "POST", "PATCH"])
        return HTTPCase(
            "http_unknown_route" if method in ("GET", "POST") else "http_unknown_method",
            http_request(method, rng.choice(["/", "/steps", "/health/x", "/%ff", "/step?x=%zz", "/" + "a" * 2000, "/attach"])),
        )
    if choice == 5:
        depth = rng.choice([100, 1000, 100_000])
        body = b'{"task_id": "' + FUZZ_TASK.encode() + b'", "obs": ' + b"[" * depth + b"]" * depth + b"}"
        return HTTPCase("http_deep_json", http_request("POST", "/step", body))
    # wrong types, in the body (step/feedback) or the query string (ask/detach)
    value = rng.choice([None, True, 1, 1.5, "", "x" * 300, [], {}, [1], {"a": 1}, 10**30, -(10**30), "NaN", float("nan"), "bad id!"])
    if path in ("/ask", "/detach", "/attach") and rng.random() < 0.5:
        return HTTPCase("http_wrong_type", http_request("POST", f"{path}?task_id={rng.choice(['', 'x' * 200, '%00', 'a%20b', '%ff'])}"))
    data: dict[str, Any] = {"task_id": FUZZ_TASK, "obs": dict(OBS), "reward": 1.0, "done": False}
    name = rng.choice(["task_id", "obs", "reward", "done", "truncated", "next_obs", "obs.prompt", "obs.action", "obs.question"])
    if name.startswith("obs."):
        data["obs"][name[4:]] = value
    else:
        data[name] = value
    huge_int = isinstance(value, int) and abs(value) >= 2**64  # past msgpack's int64/uint64
    return HTTPCase("http_huge_int" if huge_int else "http_wrong_type", http_request("POST", path, json.dumps(data).encode()))
