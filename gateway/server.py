"""The gateway's HTTP server: a thread per connection, a bounded pool of PPOZ clients.

Why threads: each HTTP request waits on the broker for as long as a step takes,
and many emulators step at once; a thread per connection (stdlib
ThreadingHTTPServer) waits without holding anyone else up, and the model work
happens on the actors, never here. The pool bounds the ZeroMQ sockets (one per
request in flight, reused) and so the load the gateway can put on the broker:
a request that finds no free slot before its deadline gets 503.

On a shared machine or network (docs/security.md), before anything is forwarded:
- at most `max_connections` connections hold a thread; one more gets 503 and is closed;
- each request's line, headers and body must arrive within `read_deadline_s` of the
  connection's turn starting (`ReadDeadlines`), so a client sending a byte every few
  seconds (slowloris) is cut off instead of holding a thread for ever;
- the Host header must name an allowed host (a web page reaching 127.0.0.1 through a
  DNS name of its own is refused), an Origin header an allowed origin (a web page's
  requests carry one; emulators send none), a body must be `application/json` (a
  page may send `text/plain` without asking the browser's permission first), and a
  configured bearer token must be given.
Why the standard library and not a server package: these four checks and two bounds
are about sixty lines here, and the gateway's clients are emulators on the farm's own
network or a TLS proxy in front of it; an ASGI stack would add its dependencies for
nothing else the gateway needs.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import socket
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
            deadline = self.cfg.generate_deadline_s
            asked = fields.get("deadline_ms")
            if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:  # else the broker names what is wrong
                # Capped as the broker caps it (at generate_timeout_ms): 1e13 ms overflowed the waits' time_t (a 400), and
                # the broker is asked to stop when the gateway does. Compared as ints: 10**400 / 1000 is no float.
                capped = min(asked, max(1, int(self.cfg.generate_deadline_s * 1000)))
                fields = {**fields, "deadline_ms": capped}
                deadline = capped / 1000
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


class ReadDeadlines:
    """Connections that must finish sending a request by a deadline; one thread shuts down those that do not.

    A socket timeout bounds each read, not a request: a client sending a byte every few seconds passes every
    read. One watcher for all connections instead of a timer thread per request."""

    TICK_S = 0.1

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.cut = 0  # connections shut down past their deadline

    def start(self) -> None:
        threading.Thread(target=self._watch, name="gateway-read-deadlines", daemon=True).start()

    def expect(self, conn: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[conn] = time.monotonic() + seconds

    def done(self, conn: socket.socket) -> None:
        with self._lock:
            self._due.pop(conn, None)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [conn for conn, due in self._due.items() if due <= now]
                for conn in late:
                    del self._due[conn]
            for conn in late:
                self.cut += 1
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # its handler's read returns at once; the handler closes it
                except OSError:
                    pass


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
        self.hosts = cfg.hosts()
        self.origins = frozenset(o.lower() for o in cfg.allowed_origins)
        self.token = cfg.token()
        self.deadlines = ReadDeadlines()
        self.connections = threading.BoundedSemaphore(cfg.max_connections)

    def start(self) -> Gateway:
        gateway = self

        class Handler(PPOAPIHandler):
            owner = gateway
            timeout = gateway.cfg.read_deadline_s  # each read; ReadDeadlines bounds the whole request

        class Server(ThreadingHTTPServer):
            daemon_threads = False  # server_close() waits for requests in progress: SIGTERM drains
            # socketserver listens with a backlog of 5: a burst of emulators connecting at once overflowed it, and the
            # connections past it hung in the kernel until retried. The kernel caps this at net.core.somaxconn.
            request_queue_size = 1024

            def service_actions(self) -> None:  # once per turn of serve_forever's loop
                gateway.notifier.watchdog()
                gateway.notifier.status(gateway.status_line())

            def process_request(self, request: Any, client_address: Any) -> None:
                """A thread for the connection if one of `max_connections` is free; else 503 and close, at once."""
                if not gateway.connections.acquire(blocking=False):
                    gateway.count("errors/too_many_connections")
                    _refuse_connection(request, gateway.cfg.max_connections)
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    gateway.connections.release()
                    raise

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:  # each request's deadline is cleared by its handler (handle_one_request)
                    gateway.connections.release()

        self.httpd = Server((self.cfg.host, self.cfg.port), Handler)
        self.deadlines.start()
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
        self.deadlines.close()
        self.pool.close()

    def stop(self) -> None:
        """Stop accepting; requests in progress finish on their own threads (safe from a signal handler via a thread)."""
        if self.httpd is not None:
            self.notifier.stopping("finishing the requests in progress")
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()

    def count(self, key: str) -> None:
        with self.counter_lock:
            self.counters[key] = self.counters.get(key, 0) + 1

    def refusal(self, headers: Any) -> tuple[int, dict[str, Any]] | None:
        """Why a request is refused before anything else is looked at (who may ask), or None."""
        host = _host_name(headers.get("Host"))
        if host is None or host not in self.hosts:
            allowed = ", ".join(sorted(self.hosts))
            return 403, _error(f"Host {headers.get('Host')!r} is not one of this gateway's names ({allowed}: [gateway] allowed_hosts)")
        origin = headers.get("Origin")
        if origin is not None and origin.lower() not in self.origins:
            return 403, _error(
                f"Origin {origin!r} is not allowed: web pages cannot drive the gateway ([gateway] allowed_origins lets one in)"
            )
        if self.token is not None:
            given = headers.get("Authorization") or ""
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
                return 401, _error("a bearer token is required (Authorization: Bearer TOKEN; [gateway] token_file)", p.E_BAD_REQUEST)
        return None

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
    server_version = "ppoz-gateway"

    def handle_one_request(self) -> None:
        """One request, its line, headers and body read within read_deadline_s (idle time before it counted)."""
        self.owner.deadlines.expect(self.connection, self.owner.cfg.read_deadline_s)
        try:
            super().handle_one_request()
        except OSError:  # shut down past its deadline, or the client went away
            self.close_connection = True
        finally:
            self.owner.deadlines.done(self.connection)

    def _serve(self) -> None:
        """Every method: the routes decide (405 on a known path, 404 elsewhere), never http.server's HTML 501."""
        method = self.command
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._send(
                400, {"error": f"Content-Length {self.headers.get('Content-Length')!r} is not a number", "code": p.E_BAD_REQUEST}
            )
        refused = self.owner.refusal(self.headers)
        if refused is not None:
            self.owner.count(f"errors/refused_{refused[0]}")
            self.close_connection = True  # its body (if any) is not read
            return self._send(*refused)
        if length < 0 or length > self.owner.cfg.max_body_bytes:
            self.close_connection = True  # the body is not read; the connection cannot be reused
            return self._send(
                413, {"error": f"the body is {length} bytes; at most {self.owner.cfg.max_body_bytes} are accepted", "code": p.E_TOO_LARGE}
            )
        kind = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if length and kind != "application/json":  # a web page may send text/plain without asking the browser first
            self.owner.count("errors/refused_415")
            self.close_connection = True
            return self._send(415, _error(f"the body must be JSON sent as Content-Type: application/json, got {kind or 'none'!r}"))
        body = self.rfile.read(length) if length else b""
        if len(body) < length:  # the client stopped sending (or was cut off past the read deadline: then this send fails)
            self.close_connection = True
            return self._send(400, _error(f"the body ended after {len(body)} of the {length} bytes its Content-Length announced"))
        self.owner.deadlines.done(self.connection)  # read whole: the broker's wait has its own deadlines
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
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # the module's logger, not stderr
        log.debug("%s %s", self.address_string(), format % args)


def _error(message: str, code: str = p.E_BAD_REQUEST) -> dict[str, Any]:
    return {"error": message, "code": code}


def _host_name(value: str | None) -> str | None:
    """The name in a Host header, lower-case, without its port ("[::1]:8000" -> "::1"); None: none or malformed."""
    if not value:
        return None
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, _ = value[1:].partition("]")
        return name if bracket else None
    name, _, port = value.partition(":")
    return name if name and (not port or port.isdigit()) else None


def _refuse_connection(request: Any, limit: int) -> None:
    """503 on a connection no thread will read: written at once, without blocking the accepting thread for long."""
    data = json.dumps(_error(f"the gateway serves {limit} connections at once ([gateway] max_connections); try again", p.E_OVERLOADED))
    head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    try:
        request.settimeout(0.5)
        request.sendall((head + "Retry-After: 1\r\nConnection: close\r\n\r\n" + data).encode())
    except OSError:
        pass
