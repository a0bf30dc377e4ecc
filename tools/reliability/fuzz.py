"""Fuzz the broker's client front end (ZeroMQ) and the PPOAPI HTTP gateway with hostile input.

    python -m tools.reliability.fuzz --broker tcp://127.0.0.1:5555 [--gateway http://127.0.0.1:8000] \
        --messages 100000 --seed 0 [--pid BROKER_PID] [--json]

The invariants checked are the ones broker/server.py guarantees (on_client_frames):

- A request is *well framed* when the DEALER sends one frame (the body) or two
  frames whose first is empty, and the body is at most the socket's MAXMSGSIZE
  (4 * max_message_bytes + 64 KiB; bigger ones make libzmq drop the peer). The
  broker answers every well-framed request with exactly one reply: bodies it
  cannot decode, or over max_message_bytes, get an error carrying the rid when
  the body's top-level map has a readable one, else `rid: nil`. So per socket,
  replies received == well-framed requests sent, and every decodable request
  with a valid rid gets a reply carrying that rid.
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
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq

from common import protocol as p
from common.redis_server import connect
from ppoz.flags import add_broker_flag, add_json_flag, add_seed_flag
from tools.reliability.fuzz_cases import FUZZ_TASK, HOST_PLACEHOLDER, OBS, Case, HTTPCase, cases, http_case, request_body
from tools.reliability.ledger import add_settle_flag, settle_ledger
from tools.reliability.output import print_report, run_as_script

log = logging.getLogger(__name__)


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
    ledger: str = ""  # tools/reliability/ledger.py, when a Redis to read it from was given
    ledger_balanced: bool | None = None  # None: not checked

    def failures(self) -> list[str]:
        """The invariants that failed, each in a line; empty when the run passed."""
        counted = (
            (self.unanswered, "well-framed requests got no reply"),
            (self.unmatched_rids, "readable rids were never echoed"),
            (self.extra_replies, "replies to ill-framed requests"),
        )
        out = [f"{count} {what}" for count, what in counted if count]
        listed = ((self.bad_replies, "malformed replies"), (self.http_failures, "HTTP requests without a JSON answer"))
        out += [f"{len(items)} {what}, first: {items[0]}" for items, what in listed if items]
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


def send_http(base: str, case: HTTPCase, timeout: float = 30.0) -> tuple[int | None, str]:
    """Send the raw request, shut the write side, read to EOF; (status, problem) with problem "" when the answer is JSON."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=timeout) as s:
        raw = case.raw.replace(f"Host: {HOST_PLACEHOLDER}\r\n".encode(), f"Host: {url.netloc}\r\n".encode(), 1)
        try:
            s.sendall(raw)
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
def rss_kb(pid: int | str, key: str = "VmRSS") -> int | None:
    """A field of /proc/PID/status in kB (VmRSS, VmHWM, ...; pid "self" for this process); None if unreadable."""
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


def run(
    frontend: str,
    n_messages: int,
    seed: int = 0,
    gateway_url: str | None = None,
    http_share: float = 0.1,
    pid: int | None = None,
    sockets: int = 4,
    batch: int = 200,
    flood_every: int = 20,
    flood_size: int = 2000,
    reply_timeout: float = 30.0,
    context: zmq.Context | None = None,
) -> Report:
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
                    # SNDHWM 0 queues without limit, so only a socket with no connection to queue on refuses;
                    # zmq.Again then ends the run with an error instead of a hang.
                    socks[k].send_multipart(case.frames, zmq.NOBLOCK, copy=len(case.frames[-1]) < 65536)
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
        s.send_multipart(case.frames, zmq.NOBLOCK)  # a fresh DEALER queues its first message on the connection it makes
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
        try:
            s.send_multipart([b"", p.encode(request_body(p.OP_PING, "fuzz-final-ping"))], zmq.NOBLOCK)
        except zmq.Again:
            return False
        if not s.poll(int(timeout * 1000)):
            return False
        reply = p.decode(s.recv_multipart()[-1])
        return reply.get("status") == "ok" and reply.get("rid") == "fuzz-final-ping"
    finally:
        s.close(linger=0)


def format_report(report: Report) -> str:
    lines = [f"{report.messages} messages in {report.seconds} s ({report.http_sent} over HTTP)"]
    lines.append("sent: " + ", ".join(f"{k}={v}" for k, v in report.sent_by_kind.items()))
    lines.append(
        f"well framed: {report.well_framed}, replies: {report.replies}, unanswered: {report.unanswered}, "
        f"unmatched rids: {report.unmatched_rids}, extra replies: {report.extra_replies}"
    )
    lines.append("replies by code: " + ", ".join(f"{k}={v}" for k, v in sorted(report.replies_by_code.items())))
    if report.http_sent:
        lines.append("HTTP by status: " + ", ".join(f"{k}={v}" for k, v in report.http_by_status.items()))
    if report.rss_before_kb is not None:
        lines.append(f"broker RSS: {report.rss_before_kb} kB before, {report.rss_after_kb} kB after, peak {report.rss_peak_kb} kB")
    lines.append(
        f"well-behaved client: {report.client_steps} steps, {len(report.client_errors)} errors; "
        f"feedbacks acknowledged: {report.acknowledged_feedbacks}"
    )
    if report.ledger_balanced is not None:
        lines.append(f"ledger: {report.ledger} ({'balanced' if report.ledger_balanced else 'NOT balanced'})")
    failures = report.failures()
    lines += [f"FAIL: {f}" for f in failures] or ["PASS"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_broker_flag(parser)
    parser.add_argument("--gateway", default="", help="the gateway's base URL (http://host:port); empty: no HTTP fuzz")
    parser.add_argument("--messages", type=int, default=100_000, help="adversarial messages to send (default: 100000)")
    add_seed_flag(parser)
    parser.add_argument("--http-share", type=float, default=0.1, help="share of the messages sent over HTTP (default: 0.1)")
    parser.add_argument("--pid", type=int, default=0, help="the broker's process id, to report its resident memory")
    parser.add_argument("--rss-limit-mb", type=int, default=200, help="largest accepted growth of the broker's RSS (default: 200)")
    parser.add_argument(
        "--redis-url",
        default="",
        help="the broker's Redis: after the run, wait for the learner and check the ledger (docs/reliability.md); empty: no ledger",
    )
    parser.add_argument("--key-prefix", default="ppoz", help="the broker's and learner's key prefix (default: ppoz)")
    add_settle_flag(parser, 300.0)
    add_json_flag(parser, "print the report as JSON")


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
    run_as_script("python -m tools.reliability.fuzz", __doc__, add_arguments, main, logging.WARNING)
