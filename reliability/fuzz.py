"""Fuzz the broker's client front end (ZeroMQ) and the PPOAPI HTTP gateway with hostile input.

    python -m reliability.fuzz --broker tcp://127.0.0.1:5555 [--gateway http://127.0.0.1:8000] \
        --messages 100000 --seed 0 [--pid BROKER_PID] [--json]

The invariants checked are the ones broker/server.py guarantees (on_client_frames):

- A request is *well framed* when the DEALER sends one frame (the body) or two
  frames whose first is empty, and the body is at most the socket's MAXMSGSIZE
  (4 * max_message_bytes + 64 KiB; bigger ones make libzmq drop the peer). The
  broker answers every well-framed request with exactly one reply: bodies it
  cannot decode, or over max_message_bytes, get an error with `rid: nil`. So per
  socket, replies received == well-framed requests sent, and every request
  whose valid rid the broker could read gets a reply carrying that rid.
- Anything else (3+ frames, or a non-empty first frame) gets no reply at all.
- A well-behaved client (attach, step, feedback in a loop) running during the
  fuzz sees no error and makes progress.
- The gateway answers every HTTP request with a JSON object and a 200, 4xx or 5xx status.
- The broker's resident memory (given its pid) grows by less than a bound.

Generation is seeded: the same seed sends the same messages in the same order.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import msgpack
import zmq

from common import protocol as p

from common.redis_server import connect
from reliability.ledger import settle_ledger
from reliability.output import print_report, run_as_script

log = logging.getLogger(__name__)

LIMITS = p.Limits()
OBS = {"prompt": "Screen: MainActivity. History: none.", "question": "Which action should I choose next? I shall choose No. ",
       "action": ["0: TouchEvent(view=Shop)", "1: TouchEvent(view=Cart)", "2: KeyEvent(BACK)"]}  # fmt: skip
FUZZ_TASK = "fuzz-t"  # the one task id the fuzz's messages name
FIELDS_BY_OP = {
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
WRONG_VALUES: list[Any] = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, math.nan, math.inf, -math.inf,
                           "", "x" * 300, "émoji🙂", "\x00", b"", b"\xff\xfe", [], [1, "a", None], {}, {"a": {"b": []}},
                           {1: 2}, ["x"] * 300]  # fmt: skip
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


@dataclass
class Report:
    messages: int = 0
    seconds: float = 0.0
    sent_by_kind: dict[str, int] = field(default_factory=dict)
    well_framed: int = 0
    replies: int = 0
    replies_by_code: dict[str, int] = field(default_factory=dict)
    unanswered: int = 0  # well-framed requests without a reply: must be 0
    unmatched_rids: int = 0  # readable rids never echoed: must be 0
    unmatched_examples: list[str] = field(default_factory=list)
    bad_replies: list[str] = field(default_factory=list)  # replies that are not a well-formed PPOZ map: must be empty
    extra_replies: int = 0  # replies beyond the well-framed requests (to ill-framed ones): must be 0
    http_sent: int = 0
    http_by_status: dict[str, int] = field(default_factory=dict)
    http_failures: list[str] = field(default_factory=list)  # no response, or not JSON: must be empty
    rss_before_kb: int | None = None
    rss_after_kb: int | None = None
    rss_peak_kb: int | None = None
    rss_growth_limit_kb: int = 200 * 1024
    client_steps: int = 0
    client_errors: list[str] = field(default_factory=list)  # must be empty
    broker_alive: bool = True
    acknowledged_feedbacks: int = 0  # feedback replies with status ok: the well-behaved client's, and any fuzz message's
    ledger: str = ""  # reliability/ledger.py, when a Redis to read it from was given
    ledger_balanced: bool | None = None  # None: not checked

    def failures(self) -> list[str]:
        """The invariants that failed, each in a line; empty when the run passed."""
        out = []
        if self.unanswered:
            out.append(f"{self.unanswered} well-framed requests got no reply")
        if self.unmatched_rids:
            out.append(f"{self.unmatched_rids} readable rids were never echoed")
        if self.extra_replies:
            out.append(f"{self.extra_replies} replies to ill-framed requests")
        if self.bad_replies:
            out.append(f"{len(self.bad_replies)} malformed replies, first: {self.bad_replies[0]}")
        if self.http_failures:
            out.append(f"{len(self.http_failures)} HTTP requests without a JSON answer, first: {self.http_failures[0]}")
        if self.client_errors:
            out.append(f"the well-behaved client saw {len(self.client_errors)} errors, first: {self.client_errors[0]}")
        if self.client_steps == 0:
            out.append("the well-behaved client made no progress")
        if self.ledger_balanced is False:
            out.append(f"the ledger did not balance: {self.ledger}")
        if not self.broker_alive:
            out.append("the broker did not answer ping after the fuzz")
        if self.rss_before_kb is not None and self.rss_after_kb is not None:
            if self.rss_after_kb - self.rss_before_kb > self.rss_growth_limit_kb:
                out.append(f"broker RSS grew by {self.rss_after_kb - self.rss_before_kb} kB (limit {self.rss_growth_limit_kb})")
        return out


# --- Message generators (pure: a seeded Random in, a Case out) ---------------------------------
def _request(op: str, rid: Any, **fields: Any) -> dict[str, Any]:
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
    body = _pack(_request(op, f"r{i}", **FIELDS_BY_OP[op]))
    return _framed(rng, "truncated_msgpack", body[: rng.randrange(0, len(body))])


def gen_wrong_type(rng: random.Random, i: int) -> Case:
    """A valid request of some op with one field (header or body, nested obs fields too) of a wrong type."""
    op = rng.choice(sorted(FIELDS_BY_OP))
    msg = _request(op, f"r{i}", **json.loads(json.dumps(FIELDS_BY_OP[op])))
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
        body = _pack(_request(p.OP_STEP, rid, task_id=FUZZ_TASK, obs={**OBS, "prompt": "p" * n, "question": ""}))
    elif choice == 1:
        n = LIMITS.max_action_chars + rng.choice([-1, 0, 1, 100_000])
        body = _pack(_request(p.OP_STEP, rid, task_id=FUZZ_TASK, obs={**OBS, "action": ["a" * n]}))
    elif choice == 2:
        n = rng.choice([64, 65, 10_000])
        return _framed(rng, "huge_string", _pack(_request(p.OP_PING, "r" * n)), "r" * n if n <= p.MAX_RID_BYTES else None)
    elif choice == 3:
        n = LIMITS.max_message_bytes + rng.choice([-100, 0, 1, 100_000])
        body = _pack(_request(p.OP_PING, rid, pad="z" * max(0, n - 40)))  # either side of the limit
    else:
        body = _pack(_request(p.OP_ATTACH, rid, task_id="t" * rng.choice([128, 129, 1_000_000])))
    return _framed(rng, "huge_string", body, rid if len(body) <= LIMITS.max_message_bytes else None)


def gen_oversize(rng: random.Random, i: int) -> Case:
    """Over the socket's MAXMSGSIZE: libzmq drops the connection; the broker must survive it."""
    body = _pack(_request(p.OP_PING, f"r{i}", pad="z" * (4 * LIMITS.max_message_bytes + 70_000)))
    return Case("oversize", [b"", body], None, oversize=True)


def gen_many_candidates(rng: random.Random, i: int) -> Case:
    n = rng.choice([LIMITS.max_actions, LIMITS.max_actions + 1, 100_000])
    body = _pack(_request(rng.choice([p.OP_STEP, p.OP_RAG_STEP]), f"r{i}", task_id=FUZZ_TASK,
                          obs={"prompt": "p", "action": [f"{k}" for k in range(n)]}))  # fmt: skip
    return _framed(rng, "many_candidates", body, f"r{i}")


def gen_deep_nesting(rng: random.Random, i: int) -> Case:
    """A request whose obs (or whole body) is arrays/maps nested 1000+ deep."""
    depth = rng.choice([1000, 1025, 5000, 100_000])
    nest = (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k") * depth + b"\xc0"
    if rng.random() < 0.3:
        return _framed(rng, "deep_nesting", nest)
    head = _pack(_request(p.OP_STEP, f"r{i}", task_id=FUZZ_TASK))  # a fixmap of 5 entries: add a sixth
    body = bytes([head[0] + 1]) + head[1:] + _pack("obs") + nest
    return _framed(rng, "deep_nesting", body)


def gen_bad_utf8(rng: random.Random, i: int) -> Case:
    """A str with invalid UTF-8 bytes (same length, so the framing stays valid), or bin where str is expected."""
    rid = f"r{i}"
    if rng.random() < 0.4:
        name = rng.choice(["op", "proto", "task_id"])
        msg = _request(p.OP_ASK, rid, task_id=FUZZ_TASK)
        msg[name] = msg[name].encode()  # bin where a str belongs
        return _framed(rng, "bin_for_str", _pack(msg), rid)
    bad = rng.choice(BAD_UTF8)
    marker = "\x01" * len(bad)
    where = rng.choice(["op", "rid", "task_id", "prompt", "action", "key"])
    fields: dict[str, Any] = {"task_id": FUZZ_TASK, "obs": {**OBS}}
    msg = _request(p.OP_STEP, rid, **fields)
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
    msg = _request(p.OP_PING, f"r{i}")
    if rng.random() < 0.5:
        msg["v"] = rng.choice([0, 2, -1, 2**40, "1", 1.0, True, None, [1]])
    else:
        msg["proto"] = rng.choice(["PPOZ", "", "ppoz2", None, 1, "ppo"])
    if rng.random() < 0.2:
        del msg[rng.choice(["v", "proto"])]
    return _framed(rng, "bad_version", _pack(msg), f"r{i}")


def gen_unknown_op(rng: random.Random, i: int) -> Case:
    op = rng.choice(["", "STEP", "step ", "ready", "result", "score", "heartbeat", "disconnect", "x" * 1000, "\u00e9tape", "__init__"])
    return _framed(rng, "unknown_op", _pack(_request(op, f"r{i}", task_id=FUZZ_TASK)), f"r{i}")


def gen_valid(rng: random.Random, i: int) -> Case:
    """Well-formed requests (ping, status, and ops on a task that does not exist) among the noise."""
    op = rng.choice([p.OP_PING, p.OP_STATUS, p.OP_ASK, p.OP_STEP, p.OP_FEEDBACK, p.OP_DETACH])
    rid: Any = f"r{i}" if rng.random() < 0.7 else f"r{i}".encode()
    return _framed(rng, "valid", _pack(_request(op, rid, **FIELDS_BY_OP[op])), rid)


def gen_bad_frames(rng: random.Random, i: int) -> Case:
    """Wrong frame counts and empty frames. Some are still well framed ([b""], [b"", b""]): those must get a reply."""
    body = _pack(_request(p.OP_PING, f"r{i}"))
    frames = rng.choice([[b""], [b"", b""], [b"", body, body], [body, body], [b"x", body],
                         [b"", b"", body], [b"", body, b"", body, b""], [body, b"", b"", b"", b""], [b""] * 5])  # fmt: skip
    case = Case("bad_frames", list(frames))
    return case


GENERATORS: list[tuple[Callable[[random.Random, int], Case], float]] = [
    (gen_random_bytes, 12), (gen_truncated, 12), (gen_wrong_type, 25), (gen_not_a_map, 4), (gen_huge_string, 0.3),
    (gen_many_candidates, 0.3), (gen_deep_nesting, 3), (gen_bad_utf8, 10), (gen_bad_version, 8), (gen_unknown_op, 6),
    (gen_valid, 12), (gen_bad_frames, 8),
]  # fmt: skip


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
            c.rid = None  # too large, or not decodable (an int map key...): answered with `rid: nil`
        return c

    return case


# --- HTTP cases ------------------------------------------------------------------------------------
def _http(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Connection: close"]
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if length is not None or body:
        hdrs["Content-Length"] = str(len(body) if length is None else length)
    lines += [f"{k}: {v}" for k, v in hdrs.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def http_case(rng: random.Random, i: int) -> HTTPCase:
    path = rng.choice(["/step", "/rag_step", "/feedback", "/attach", "/ask", "/detach"])
    choice = rng.randrange(10)
    if choice == 0:
        body = rng.choice([b"{", b"{'a': 1}", b"\xff\xfe", b"[1,2]", b"null", b"\"s\"", b"{\"task_id\": }", rng.randbytes(50)])
        return HTTPCase("http_bad_json", _http("POST", path, body))
    if choice == 1:
        body = json.dumps({"task_id": FUZZ_TASK, "obs": OBS}).encode()
        return HTTPCase("http_bad_length", _http("POST", path, body, length=rng.choice([-1, 0, 3, len(body) + 20, 10**12])))
    if choice == 2:
        return HTTPCase("http_bad_length", _http("POST", path, b"{}", headers={"Content-Length": rng.choice(["abc", "1e3", " ", "0x10"])}))
    if choice == 3:
        kind = rng.randrange(3)
        if kind == 0:
            body = json.dumps({"task_id": FUZZ_TASK, "obs": {"prompt": "p" * 2_000_000, "action": ["a"]}}).encode()
        elif kind == 1:
            body = json.dumps({"task_id": FUZZ_TASK, "obs": {"prompt": "p", "action": [str(k) for k in range(100_000)]}}).encode()
        else:
            return HTTPCase("http_huge_body", _http("POST", path, b"{", length=9 * 1024 * 1024))
        return HTTPCase("http_huge_body", _http("POST", "/step", body))
    if choice == 4:
        method = rng.choice(["GET", "PUT", "DELETE", "POST", "PATCH"])
        return HTTPCase("http_unknown_route" if method in ("GET", "POST") else "http_unknown_method", _http(method,
                                                    rng.choice(["/", "/steps", "/health/x", "/%ff", "/step?x=%zz", "/" + "a" * 2000, "/attach"])))  # fmt: skip
    if choice == 5:
        depth = rng.choice([100, 1000, 100_000])
        body = b'{"task_id": "' + FUZZ_TASK.encode() + b'", "obs": ' + b"[" * depth + b"]" * depth + b"}"
        return HTTPCase("http_deep_json", _http("POST", "/step", body))
    # wrong types, in the body (step/feedback) or the query string (ask/detach)
    value = rng.choice([None, True, 1, 1.5, "", "x" * 300, [], {}, [1], {"a": 1}, 10**30, -(10**30), "NaN", float("nan"), "bad id!"])
    if path in ("/ask", "/detach", "/attach") and rng.random() < 0.5:
        return HTTPCase("http_wrong_type", _http("POST", f"{path}?task_id={rng.choice(['', 'x' * 200, '%00', 'a%20b', '%ff'])}"))
    data: dict[str, Any] = {"task_id": FUZZ_TASK, "obs": dict(OBS), "reward": 1.0, "done": False}
    name = rng.choice(["task_id", "obs", "reward", "done", "truncated", "next_obs", "obs.prompt", "obs.action", "obs.question"])
    if name.startswith("obs."):
        data["obs"][name[4:]] = value
    else:
        data[name] = value
    huge_int = isinstance(value, int) and abs(value) >= 2**64  # past msgpack's int64/uint64
    return HTTPCase("http_huge_int" if huge_int else "http_wrong_type", _http("POST", path, json.dumps(data).encode()))


def send_http(base: str, case: HTTPCase, timeout: float = 30.0) -> tuple[int | None, str]:
    """Send the raw request, shut the write side, read to EOF; (status, problem) with problem "" when the answer is JSON."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=timeout) as s:
        try:
            s.sendall(case.raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer (413) and close before reading a huge body
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    data = b"".join(chunks)
    if not data:
        return None, "no response (connection closed)"
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        payload = json.loads(body)
    except (ValueError, IndexError) as e:
        return None, f"unparsable response ({e}): {data[:200]!r}"
    if not isinstance(payload, dict):
        return status, f"status {status} with a non-object body"
    if not (status == 200 or 400 <= status < 600):
        return status, f"status {status}"
    return status, ""


# --- The well-behaved client ------------------------------------------------------------------------
class WellBehavedClient(threading.Thread):
    """attach, then step/feedback in a loop (done every 4 steps, then attach again), counting errors."""

    def __init__(self, endpoint: str, context: zmq.Context) -> None:
        super().__init__(name="well-behaved-client", daemon=True)
        self.endpoint = endpoint
        self.context = context
        self.stop_event = threading.Event()
        self.steps = 0
        self.feedbacks = 0  # acknowledged
        self.errors: list[str] = []

    def run(self) -> None:
        from client import Client

        client = Client(self.endpoint, deadline=30.0, attempt_timeout=5.0, context=self.context)
        try:
            task_id = None
            while not self.stop_event.is_set():
                try:
                    task_id = task_id or client.attach()
                    reply = client.step(task_id, OBS)
                    if not 0 <= reply["action"] < len(OBS["action"]):
                        self.errors.append(f"action {reply['action']} out of range")
                    self.steps += 1
                    done = self.steps % 4 == 0
                    client.feedback(task_id, 1.0, done=done)
                    self.feedbacks += 1
                    if done:
                        client.detach(task_id)
                        task_id = None
                except Exception as e:  # noqa: BLE001 - every error is a finding
                    self.errors.append(f"{type(e).__name__}: {e}")
                    task_id = None
                    time.sleep(0.1)
            if task_id is not None:  # closes the open segment: every acknowledged feedback reaches the stream
                client.detach(task_id)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"detach: {type(e).__name__}: {e}")
        finally:
            client.close()


# --- The run -----------------------------------------------------------------------------------------
def rss_kb(pid: int, key: str = "VmRSS") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _check_reply(frames: list[bytes], report: Report, echoed: Counter) -> None:
    try:
        body = msgpack.unpackb(frames[-1], raw=False)
    except Exception as e:  # noqa: BLE001
        report.bad_replies.append(f"undecodable reply {frames[-1][:80]!r}: {e}")
        return
    if not isinstance(body, dict) or body.get("proto") != p.PROTOCOL_ID or body.get("v") != p.PROTOCOL_VERSION:
        report.bad_replies.append(f"reply without the PPOZ header: {str(body)[:200]}")
        return
    if len(frames) > 2 or (len(frames) == 2 and frames[0] != b""):
        report.bad_replies.append(f"reply of {len(frames)} frames")
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else "ok"
    if code not in p.ERROR_CODES and code != "ok":
        report.bad_replies.append(f"unknown error code {code!r}")
    report.replies_by_code[str(code)] = report.replies_by_code.get(str(code), 0) + 1
    if code == "ok" and body.get("op") == p.OP_FEEDBACK:
        report.acknowledged_feedbacks += 1
    if body.get("rid") is not None:
        echoed[body["rid"]] += 1


def run(frontend: str, n_messages: int, seed: int = 0, gateway_url: str | None = None, http_share: float = 0.1,
        pid: int | None = None, sockets: int = 4, batch: int = 200, flood_every: int = 20, flood_size: int = 2000,
        reply_timeout: float = 30.0, context: zmq.Context | None = None) -> Report:  # fmt: skip
    """Send n_messages hostile messages (http_share of them over HTTP when gateway_url is given) and check the invariants."""
    ctx = context or zmq.Context()
    report = Report(messages=n_messages)
    report.rss_before_kb = rss_kb(pid) if pid else None
    rng_http = random.Random(seed + 1)
    next_case = cases(seed)
    n_http = int(n_messages * http_share) if gateway_url else 0
    n_zmq = n_messages - n_http
    sent_kinds: Counter = Counter()
    http_status: Counter = Counter()
    expected_rids: Counter = Counter()
    echoed: Counter = Counter()
    rid_kinds: dict[Any, str] = {}
    socks = []
    for _ in range(sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(frontend)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    client = WellBehavedClient(frontend, ctx)
    client.start()
    http_done = threading.Event()
    http_feedbacks = [0]  # 200s to POST /feedback

    def http_loop() -> None:
        for i in range(n_http):
            case = http_case(rng_http, i)
            sent_kinds[case.kind] += 1
            try:
                status, problem = send_http(gateway_url or "", case)
            except OSError as e:
                status, problem = None, f"{type(e).__name__}: {e}"
            http_status[str(status)] += 1
            if status == 200 and case.raw.startswith(b"POST /feedback"):
                http_feedbacks[0] += 1
            if problem:
                report.http_failures.append(f"{case.kind} {case.raw[:120]!r}: {problem}")
        http_done.set()

    http_thread = threading.Thread(target=http_loop, name="fuzz-http", daemon=True)
    started = time.monotonic()
    http_thread.start()
    try:
        i = 0
        n_batch = 0
        while i < n_zmq:
            n_batch += 1
            size = flood_size if n_batch % flood_every == 0 else batch  # a flood: one socket, many messages, no reads
            expected = [0] * len(socks)
            received = [0] * len(socks)
            targets = [0] if size == flood_size else range(len(socks))
            for k in targets:
                for _ in range(min(size // len(targets), n_zmq - i)):
                    case = next_case(i)
                    i += 1
                    sent_kinds[case.kind] += 1
                    if case.oversize:
                        _send_oversize(ctx, frontend, case)
                        continue
                    socks[k].send_multipart(case.frames, copy=len(case.frames[-1]) < 65536)
                    if case.well_framed:
                        expected[k] += 1
                        report.well_framed += 1
                        if case.rid is not None:
                            expected_rids[case.rid] += 1
                            rid_kinds[case.rid] = f"{case.kind} {case.frames[-1][:150]!r}"
            end = time.monotonic() + reply_timeout
            # Replies to ill-framed requests would show up as received > expected; wait a little for them.
            while time.monotonic() < end and received != expected:
                for sock, _ in poller.poll(max(1, int(1000 * min(1.0, end - time.monotonic())))):
                    k = socks.index(sock)
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        received[k] += 1
                        _check_reply(frames, report, echoed)
            report.replies += sum(received)
            report.unanswered += sum(max(0, e - r) for e, r in zip(expected, received))
            report.extra_replies += sum(max(0, r - e) for e, r in zip(expected, received))
        http_thread.join()
        # A last look for late replies (to ill-framed requests, which would be a finding).
        for sock, _ in poller.poll(200):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                report.extra_replies += 1
        report.seconds = round(time.monotonic() - started, 1)
        missing = [rid for rid, n in expected_rids.items() if echoed[rid] < n]
        report.unmatched_rids = sum(expected_rids[rid] - echoed[rid] for rid in missing)
        report.unmatched_examples = [f"{rid!r}: {rid_kinds.get(rid)}" for rid in missing[:10]]
        report.broker_alive = _ping(ctx, frontend)
        if report.broker_alive:
            _detach_fuzz_task(ctx, frontend)
    finally:
        client.stop_event.set()
        client.join(60)
        for s in socks:
            s.close(linger=0)
        if context is None:
            ctx.term()
    report.client_steps = client.steps
    report.acknowledged_feedbacks += client.feedbacks + http_feedbacks[0]
    report.client_errors = client.errors
    report.sent_by_kind = dict(sorted(sent_kinds.items()))
    report.http_sent = n_http
    report.http_by_status = dict(sorted(http_status.items()))
    if pid:
        report.rss_after_kb = rss_kb(pid)
        report.rss_peak_kb = rss_kb(pid, "VmHWM")
    return report


def _send_oversize(ctx: zmq.Context, frontend: str, case: Case) -> None:
    """On a socket of its own: libzmq drops this peer, which must not cost the others their replies."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 2000)
    try:
        s.connect(frontend)
        s.send_multipart(case.frames)
    finally:
        s.close()


def _detach_fuzz_task(ctx: zmq.Context, frontend: str) -> None:
    """The fuzz's valid messages may have attached FUZZ_TASK and given it feedbacks: close its open segment,
    as every client's, so the ledger can balance."""
    from client import Client, UnknownTask

    client = Client(frontend, deadline=10.0, context=ctx)
    try:
        client.detach(FUZZ_TASK)
    except UnknownTask:
        pass
    finally:
        client.close()


def _ping(ctx: zmq.Context, frontend: str, timeout: float = 10.0) -> bool:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(frontend)
        s.send_multipart([b"", p.encode(_request(p.OP_PING, "fuzz-final-ping"))])
        if not s.poll(int(timeout * 1000)):
            return False
        reply = p.decode(s.recv_multipart()[-1])
        return reply.get("status") == "ok" and reply.get("rid") == "fuzz-final-ping"
    finally:
        s.close(linger=0)


def format_report(report: Report) -> str:
    lines = [f"{report.messages} messages in {report.seconds} s ({report.http_sent} over HTTP)"]
    lines.append("sent: " + ", ".join(f"{k}={v}" for k, v in report.sent_by_kind.items()))
    lines.append(f"well framed: {report.well_framed}, replies: {report.replies}, unanswered: {report.unanswered}, "
                 f"unmatched rids: {report.unmatched_rids}, extra replies: {report.extra_replies}")  # fmt: skip
    lines.append("replies by code: " + ", ".join(f"{k}={v}" for k, v in sorted(report.replies_by_code.items())))
    if report.http_sent:
        lines.append("HTTP by status: " + ", ".join(f"{k}={v}" for k, v in report.http_by_status.items()))
    if report.rss_before_kb is not None:
        lines.append(f"broker RSS: {report.rss_before_kb} kB before, {report.rss_after_kb} kB after, peak {report.rss_peak_kb} kB")
    lines.append(f"well-behaved client: {report.client_steps} steps, {len(report.client_errors)} errors; "
                 f"feedbacks acknowledged: {report.acknowledged_feedbacks}")  # fmt: skip
    if report.ledger_balanced is not None:
        lines.append(f"ledger: {report.ledger} ({'balanced' if report.ledger_balanced else 'NOT balanced'})")
    failures = report.failures()
    lines += [f"FAIL: {f}" for f in failures] or ["PASS"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", default="tcp://127.0.0.1:5555", help="the broker's client endpoint (default: tcp://127.0.0.1:5555)")
    parser.add_argument("--gateway", default="", help="the gateway's base URL (http://host:port); empty: no HTTP fuzz")
    parser.add_argument("--messages", type=int, default=100_000, help="adversarial messages to send (default: 100000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-share", type=float, default=0.1, help="share of the messages sent over HTTP (default: 0.1)")
    parser.add_argument("--pid", type=int, default=0, help="the broker's process id, to report its resident memory")
    parser.add_argument("--rss-limit-mb", type=int, default=200, help="largest accepted growth of the broker's RSS (default: 200)")
    parser.add_argument("--redis-url", default="", help="the broker's Redis: after the run, wait for the learner and check the ledger "
                        "(docs/reliability.md); empty: no ledger")  # fmt: skip
    parser.add_argument("--key-prefix", default="ppoz", help="the broker's and learner's key prefix (default: ppoz)")
    parser.add_argument("--settle-s", type=float, default=300.0, help="give up on the ledger once it has not moved (the learner counting, the stream shrinking) for this long (default: 300)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    if args.messages < 1 or not 0 <= args.http_share <= 1:
        raise SystemExit("fuzz: --messages must be positive and --http-share between 0 and 1")
    report = run(args.broker, args.messages, args.seed, args.gateway or None, args.http_share, pid=args.pid or None)
    report.rss_growth_limit_kb = args.rss_limit_mb * 1024
    if args.redis_url:
        client = connect(args.redis_url)
        try:
            ledger = settle_ledger(client, args.key_prefix, report.acknowledged_feedbacks, args.settle_s)
        finally:
            client.close()
        report.ledger, report.ledger_balanced = str(ledger), ledger.balanced
    return print_report(report, args.json, format_report)


if __name__ == "__main__":
    run_as_script("python -m reliability.fuzz", __doc__, add_arguments, main, logging.WARNING)
