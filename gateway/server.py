"""The gateway's HTTP server: a thread per connection, a bounded pool of PPOZ clients.

Why threads: each HTTP request waits on the broker for as long as a step takes,
and many emulators step at once; a thread per connection (stdlib
ThreadingHTTPServer) waits without holding anyone else up, and the model work
happens on the actors, never here. The pool bounds the ZeroMQ sockets (one per
request in flight, reused) and so the load the gateway can put on the broker:
a request that finds no free slot before its deadline gets 503.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import zmq

from client import Client, PPOZError
from common import protocol as p
from common.sd_notify import Notifier
from gateway import ppoapi
from gateway.config import GatewayConfig

log = logging.getLogger(__name__)


class ClientPool:
    """At most `size` PPOZ clients, created on demand and reused."""

    def __init__(self, cfg: GatewayConfig, context: zmq.Context) -> None:
        self.cfg = cfg
        self.context = context
        self.free: queue.LifoQueue[Client] = queue.LifoQueue()
        self.slots = threading.BoundedSemaphore(cfg.max_inflight)
        self.all: list[Client] = []
        self.lock = threading.Lock()

    def request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        deadline = self.cfg.request_deadline_s
        if op == p.OP_GENERATE:  # a response takes as many forwards as it has tokens: its own deadline
            asked = fields.get("deadline_ms")
            if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
                deadline = asked / 1000
            else:
                deadline = self.cfg.generate_deadline_s
        end = time.monotonic() + deadline
        if not self.slots.acquire(timeout=deadline):
            raise ppoapi.HTTPError(503, p.E_OVERLOADED, f"the gateway has {self.cfg.max_inflight} requests in flight; try again")
        try:
            try:
                client = self.free.get_nowait()
            except queue.Empty:
                client = Client(
                    self.cfg.broker,
                    deadline=self.cfg.request_deadline_s,
                    attempt_timeout=self.cfg.attempt_timeout_s,
                    context=self.context,
                    curve_secret_key=self.cfg.curve_secret_key or None,
                    curve_server_key=self.cfg.curve_server_key or None,
                )
                with self.lock:
                    self.all.append(client)
            try:
                return client.request(op, deadline=max(0.001, end - time.monotonic()), **fields)
            finally:
                self.free.put(client)
        finally:
            self.slots.release()

    def close(self) -> None:
        with self.lock:
            for client in self.all:
                client.close()
            self.all.clear()


class Gateway:
    """The HTTP server; `start()` binds (port 0 picks a free one), `serve()` runs until `stop()`."""

    def __init__(self, cfg: GatewayConfig, context: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.context = context or zmq.Context.instance()
        self.pool = ClientPool(cfg, self.context)
        self.httpd: ThreadingHTTPServer | None = None
        self.counters: dict[str, int] = {}
        self.counter_lock = threading.Lock()
        self.notifier = Notifier()

    def start(self) -> Gateway:
        gateway = self

        class Handler(PPOAPIHandler):
            owner = gateway

        class Server(ThreadingHTTPServer):
            daemon_threads = False  # server_close() waits for requests in progress: SIGTERM drains

            def service_actions(self) -> None:  # once per turn of serve_forever's loop
                gateway.notifier.watchdog()
                gateway.notifier.status(gateway.status_line())

        self.httpd = Server((self.cfg.host, self.cfg.port), Handler)
        log.info("gateway ready: PPOAPI HTTP on http://%s:%d, forwarding to %s", self.cfg.host, self.port, self.cfg.broker)
        self.notifier.ready(f"PPOAPI HTTP on {self.cfg.host}:{self.port}, forwarding to {self.cfg.broker}")
        return self

    def status_line(self) -> str:
        with self.counter_lock:
            ok = sum(n for k, n in self.counters.items() if k.startswith("ok/"))
            errors = sum(n for k, n in self.counters.items() if k.startswith("errors/"))
        return f"{ok} requests forwarded, {errors} errors"

    @property
    def port(self) -> int:
        if self.httpd is None:
            raise RuntimeError("the gateway is not started")
        return self.httpd.server_address[1]

    def serve(self) -> None:
        httpd = self.httpd or self.start().httpd
        if httpd is None:
            raise RuntimeError("the gateway could not start")
        httpd.serve_forever(poll_interval=0.2)
        httpd.server_close()
        self.pool.close()

    def stop(self) -> None:
        """Stop accepting; requests in progress finish on their own threads (safe from a signal handler via a thread)."""
        if self.httpd is not None:
            self.notifier.stopping("finishing the requests in progress")
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()

    def count(self, key: str) -> None:
        with self.counter_lock:
            self.counters[key] = self.counters.get(key, 0) + 1

    def handle(self, method: str, target: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """One HTTP request -> (status, JSON body)."""
        url = urlsplit(target)
        try:
            forward = ppoapi.translate(method, url.path.rstrip("/") or "/", url.query, body, self.cfg.max_abs_reward)
            try:
                reply = self.pool.request(forward.op, forward.fields)
            except (OverflowError, TypeError, ValueError) as e:  # msgpack cannot carry it (an int over 64 bits, say)
                raise ppoapi.HTTPError(400, p.E_BAD_REQUEST, f"the request cannot be encoded for the broker: {e}") from e
            except PPOZError as e:
                raise ppoapi.failure(e.reply or {"error": {"code": e.code or p.E_INTERNAL, "message": str(e)}}) from e
        except ppoapi.HTTPError as e:
            self.count(f"errors/{e.code}")
            return e.status, e.body()
        self.count(f"ok/{forward.op}")
        return 200, ppoapi.success(forward.op, reply)


class PPOAPIHandler(BaseHTTPRequestHandler):
    owner: Gateway
    protocol_version = "HTTP/1.1"  # keep-alive for clients that reuse connections
    timeout = 15  # an idle keep-alive connection is closed after this, so a drain never waits on one for long
    server_version = "ppoz-gateway"

    def _serve(self) -> None:
        """Every method: the routes decide (405 on a known path, 404 elsewhere), never http.server's HTML 501."""
        method = self.command
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._send(
                400, {"error": f"Content-Length {self.headers.get('Content-Length')!r} is not a number", "code": p.E_BAD_REQUEST}
            )
        if length < 0 or length > self.owner.cfg.max_body_bytes:
            self.close_connection = True  # the body is not read; the connection cannot be reused
            return self._send(
                413, {"error": f"the body is {length} bytes; at most {self.owner.cfg.max_body_bytes} are accepted", "code": p.E_TOO_LARGE}
            )
        body = self.rfile.read(length) if length else b""
        status, payload = self.owner.handle(method, self.path, body)
        self._send(status, payload)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 503 and "retry_after_ms" in payload:
            self.send_header("Retry-After", str(max(1, round(payload["retry_after_ms"] / 1000))))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # the module's logger, not stderr
        log.debug("%s %s", self.address_string(), format % args)
