"""The broker's figures for people and scrapers: a rate window, Prometheus text.

Prometheus text is rendered from the same dict `ppoz status --json` prints, so
the two never disagree. The HTTP endpoint is a small thread serving the last
snapshot the broker's loop handed it (once a second): a scrape never touches
the loop's state.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from common import protocol as p
from common.learner_figures import Latest
from common.stats import LatencyWindow

log = logging.getLogger(__name__)

# Every counter of a `status` reply's `counters` map, present from 0 (docs/protocol.md, section 3, says the same to clients).
COUNTERS: dict[str, str] = {
    "broker/requests": "messages on the client socket, well framed or not (dropped/malformed_frames counts the others)",
    "broker/attached": "sessions created by attach (a resumed or retried attach creates none)",
    "broker/detached": "sessions ended by detach",
    "broker/steps": "step, rag_step and generate results recorded as pending steps",
    "broker/feedbacks": "feedbacks recorded as transitions",
    "broker/orphan_steps": "pending steps dropped because a new step came before their feedback",
    "broker/feedback_without_step": "feedbacks refused for want of a pending step",
    "broker/replayed": "step, rag_step, generate and feedback requests answered from their kept reply (a retried rid)",
    "broker/joined_retries": "retried steps (step, rag_step, generate) that joined their step still being scored",
    "broker/ask_wait": "ask replies with status wait",
    "broker/steps_held": "steps that came while the stream backlog was over its limit, and waited in the queue for the learner",
    "broker/steps_held_out": "held steps sent to an actor with the backlog still over its limit, after step_hold_share of their deadline",
    "broker/segments_closed": "segments written to the stream",
    "broker/commits": "write batches sent to Redis",
    "sessions/expired": "sessions ended by session_ttl_s of silence",
    "jobs/requeued": "jobs given back to the queue after their actor died, hung or left",
    "jobs/late_results": "results dropped because their job was already answered (timeout, superseded, detached) or unknown",
    "actors/dead": "actors taken as dead (silent for heartbeat_liveness intervals)",
    "actors/hung": "actors taken as hung (a job held actor_job_timeout_ms without progress, or past its deadline)",
    "dropped/malformed_frames": "client messages not well framed, dropped without a reply",
    "dropped/unroutable_replies": "replies whose client was gone or not reading",
    "dropped/malformed_actor_frames": "actor messages not of two frames",
    "dropped/bad_actor_messages": "actor messages that could not be read or named an unknown op",
    "dropped/unroutable_actor_messages": "messages to actors that could not be delivered",
    "errors/storage": "times Redis was found failing or gone (each answers what was unacknowledged with internal)",
    "errors/bad_actor_result": "actor results that broke the rules (answered internal)",
    **{f"errors/{code}": f"error replies with code {code}" for code in p.ERROR_CODES},
}


def new_counters() -> collections.Counter[str]:
    """The broker's counters, every documented key at 0, so a client sees each one from the first `status`."""
    return collections.Counter({name: 0 for name in COUNTERS})


LATENCY_KEYS = ("n", "p50_ms", "p99_ms", "max_ms")


def latency_summary(window: LatencyWindow, window_s: float) -> dict[str, float]:
    """`added_latency` of a status reply: always n, p50_ms, p99_ms and max_ms (0.0 each when n is 0)."""
    summary = window.summary(window_s)
    return {"n": summary.get("n", 0), **{key: float(summary.get(key, 0.0)) for key in LATENCY_KEYS[1:]}}


class RateWindow:
    """Events per second over the last `window_s` seconds, from samples of a growing counter."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, total: int) -> None:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def _name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(status: dict[str, Any]) -> str:
    """Render a broker status dict in the Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP ppoz_{name} {help_text}")
        lines.append(f"# TYPE ppoz_{name} {kind}")
        for labels, value in samples:
            tag = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"ppoz_{name}{{{tag}}} {float(value)!r}" if tag else f"ppoz_{name} {float(value)!r}")

    metric("up_seconds", "gauge", "seconds since the broker started", [({}, status["uptime_s"])])
    metric("sessions", "gauge", "attached client sessions", [({}, status["sessions"])])
    metric("pending_steps", "gauge", "sessions with a step waiting for its feedback", [({}, status["pending_steps"])])
    metric("queued_jobs", "gauge", "steps waiting for an actor", [({}, status["queued_jobs"])])
    metric("jobs_in_flight", "gauge", "steps queued or being scored", [({}, status["jobs"])])
    metric("stream_backlog", "gauge", "closed segments in the Redis stream, read or not", [({}, status["stream_length"])])
    metric("stream_read", "gauge", "of them, read by a learner and kept until its checkpoint holds them", [({}, status["stream_read"])])
    transitions = "the transitions of the segments no learner has read yet (what back-pressure limits)"
    metric("stream_backlog_transitions", "gauge", transitions, [({}, status["stream_transitions"])])
    metric("storage_ok", "gauge", "1 while Redis accepts writes", [({}, 1.0 if status["storage_ok"] else 0.0)])
    metric("steps_per_second", "gauge", "steps answered per second over the last 10 s", [({}, status.get("steps_per_s", 0.0))])
    actors = status["actors"]
    metric("actors", "gauge", "connected actors", [({}, len(actors))])
    metric("actor_inflight", "gauge", "steps an actor holds", [({"actor": a["name"]}, a["inflight"]) for a in actors])
    metric("actor_credits", "gauge", "steps an actor may hold at once", [({"actor": a["name"]}, a["credits"]) for a in actors])
    metric("actor_policy_version", "gauge", "policy version an actor serves", [({"actor": a["name"]}, a["policy_version"]) for a in actors])
    metric("actor_served_total", "counter", "steps an actor answered", [({"actor": a["name"]}, a["served"]) for a in actors])
    metric(
        "events_total",
        "counter",
        "broker counters by name (requests, errors, segments, ...)",
        [({"name": k}, v) for k, v in sorted(status["counters"].items())],
    )
    latency = status.get("added_latency") or {}
    metric(
        "added_latency_ms",
        "gauge",
        "latency the broker added to step and feedback replies, by quantile (none while n is 0)",
        [({"quantile": q}, latency[key]) for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")) if latency.get("n")],
    )
    learner = status.get("learner") or {}
    if learner:
        metric("learner_policy_version", "gauge", "newest policy version the learner published", [({}, learner.get(Latest.VERSION, 0))])
        metric("learner_updates_total", "counter", "PPO updates done", [({}, learner.get(Latest.UPDATES, 0))])
        metric(
            "learner_metric",
            "gauge",
            "the last update's figures (losses, KL, return, ...)",
            [({"name": _name(k)}, v) for k, v in sorted(learner.items()) if "/" in k],
        )
    return "\n".join(lines) + "\n"


class MetricsServer:
    """GET /metrics on `host:port` from the last snapshot given to `update()` (a thread of its own)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"metrics address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:9101")
        self._text = "# no figures yet\n"
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                with server._lock:
                    data = server._text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(format, *args)

        self.httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5}, name="metrics", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> MetricsServer:
        self.thread.start()
        log.info("Prometheus metrics on http://%s:%d/metrics", self.httpd.server_address[0], self.port)
        return self

    def update(self, status: dict[str, Any]) -> None:
        text = prometheus_text(status)
        with self._lock:
            self._text = text

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
