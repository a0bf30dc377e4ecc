"""The broker process: client front end, actor back end, sessions in Redis.

One thread, one loop, in the spirit of the ZeroMQ guide's Majordomo broker:

    poll both sockets (timeout: the housekeeping interval)
    drain client messages  -> on_client_*   (may stage Redis writes and replies)
    drain actor messages   -> on_actor_*    (may stage Redis writes and replies)
    housekeeping           -> deadlines, dead or hung actors, heartbeats, session expiry
    commit                 -> the turn's writes in one atomic script call, then the replies they acknowledge
    dispatch               -> queued jobs, taking turns between clients, to the least loaded actors with free credits

The parts, along the seams of that loop:
- broker/client_ops.py: the client operations, one short handler per op;
- broker/actor_ops.py: the actor operations and dispatch;
- broker/scheduling.py: the step queue, round-robin across clients;
- broker/state.py: the state both share, and what happens when Redis fails;
- broker/outbox.py, broker/store.py: the writes to Redis and the replies that wait on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
import zmq

from broker.actor_ops import ActorOps
from broker.backlog import KEEP_SEGMENTS
from broker.client_ops import ASK_RECHECK_S, ClientOps
from broker.config import BrokerConfig
from broker.metrics import MetricsServer
from common import protocol as p
from common.sd_notify import Notifier
from common.security import AllowList, apply_server
from common.zmqio import bound, recv_frames, recv_frames_and_sender

log = logging.getLogger(__name__)

DRAIN_BATCH = 512  # messages taken from one socket per loop turn, so neither side starves the other
HOUSEKEEPING_S = 0.05
SESSION_SCAN_S = 1.0
HWM = 100_000


class Broker(ClientOps, ActorOps):
    """Routes client steps to actors and records every transition in Redis."""

    def __init__(self, config: BrokerConfig, redis_client: redis.Redis, context: zmq.Context | None = None) -> None:
        super().__init__(config, redis_client)
        self.ctx = context or zmq.Context.instance()
        self.running = False
        self.notifier = Notifier()  # systemd's notify socket, when run under systemd
        self.metrics_server: MetricsServer | None = None
        self.frontend_endpoint = ""
        self.backend_endpoint = ""
        self.allow_lists: list[AllowList] = []  # CURVE: the ZAP checks of both sockets, closed with them
        self._next_status = 0.0
        self._next_housekeeping = 0.0
        self._next_session_scan = 0.0

    # --- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load sessions from Redis, create the stream, bind both sockets."""
        self.store.ensure_stream()
        self._adopt(self.store.load_sessions(self.cfg.segment_len, self.cfg.rag_history_len))
        if self.sessions:
            log.info(
                "recovered %d sessions from Redis (%d with a pending step)",
                len(self.sessions),
                sum(s.pending is not None for s in self.sessions.values()),
            )
        self._read_stream_state()
        for length in self.store.segment_lengths(KEEP_SEGMENTS):  # what a broker before this one closed
            self.tally.add(length)
        self.frontend = self._router(self.cfg.frontend, self.cfg.max_message_bytes, "clients", self.cfg.curve_allowed_clients)
        self.outbox.sock = self.frontend
        self.backend = self._router(self.cfg.backend, self.cfg.max_message_bytes, "actors", self.cfg.curve_allowed_actors)
        self.frontend_endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("broker ready: clients on %s, actors on %s", self.frontend_endpoint, self.backend_endpoint)
        if self.cfg.metrics_bind:
            self.metrics_server = MetricsServer(self.cfg.metrics_bind).start()
        self.notifier.ready(f"clients on {self.frontend_endpoint}, actors on {self.backend_endpoint}")

    def _router(self, endpoint: str, max_message_bytes: int, name: str = "", allowed: str = "") -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Tell us when a reply has nowhere to go, rather than dropping it silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        # Messages over the configured limit get a `too_large` reply; ones far over it
        # are refused by libzmq itself (the peer is disconnected) so they never fill memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes + 65536)
        if self.cfg.curve_secret_key:  # before bind: a peer's security mechanism is fixed when it connects
            self.allow_lists.append(apply_server(sock, self.cfg.curve_secret_key, allowed, f"broker {name}"))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)  # a port taken: the caller may try again, with nothing left open
            raise
        return sock

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Serve until stop() is called (or `until()` returns true)."""
        if self.frontend is None:
            self.start()
        frontend, backend = bound(self.frontend, "the client front end"), bound(self.backend, "the actor back end")
        poller = zmq.Poller()
        poller.register(frontend, zmq.POLLIN)
        poller.register(backend, zmq.POLLIN)
        redis_fd = None
        self.running = True
        drain_until = 0.0
        try:
            while self.running and not (until and until()):
                if self.draining:
                    if not drain_until:
                        drain_until = time.monotonic() + self.cfg.drain_timeout_s
                        self.notifier.stopping(f"draining {len(self.jobs)} steps in flight")
                        log.info("stopping: %d steps in flight, %d queued; new steps are refused", len(self.jobs), len(self.queue))
                    if not self.jobs or time.monotonic() > drain_until:
                        break
                    if not self.registry.actors:  # ppoz up stops its actors first: what is left can never be answered
                        log.info("stopping: %d steps left, and no actor is left to answer them", len(self.jobs))
                        break
                # Wake up for Redis's answer too, so replies leave as soon as their batch is applied.
                fd = self._redis_fd()
                if fd != redis_fd:
                    if redis_fd is not None:
                        poller.unregister(redis_fd)
                    if fd is not None:
                        poller.register(fd, zmq.POLLIN)
                    redis_fd = fd
                holding = self.held_asks or self.holding_steps
                events = dict(poller.poll(int((ASK_RECHECK_S if holding else HOUSEKEEPING_S) * 1000)))
                self.now = time.monotonic()
                if frontend in events:
                    self._drain_clients(frontend)
                if backend in events:
                    self._drain(backend, self.on_actor_frames)
                if self.now >= self._next_housekeeping:
                    self.housekeeping()
                self.recheck_backlog()
                self.release_asks()
                self.commit()
                self.dispatch()
        finally:
            self.release_asks(closing=True)
            self.flush()
            self.close()

    def _redis_fd(self) -> int | None:
        """The write connection's socket, connecting if needed; None while Redis is down."""
        if not self.storage_ok:
            return None
        try:
            return self.outbox.fileno()
        except (redis.RedisError, OSError) as e:  # went away after the last reload: refuse writes until it is back
            self._storage_lost(f"cannot connect to Redis: {e}")
            return None

    def stop(self) -> None:
        """Drain and return: refuse new steps, answer those in flight (up to drain_timeout_s), flush to Redis.

        Safe from a signal handler: it only sets a flag the loop reads."""
        self.draining = True

    def close(self) -> None:
        for sock in (self.frontend, self.backend):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        for allow_list in self.allow_lists:  # after the sockets: the last one stops the context's ZAP handler
            allow_list.close()
        self.allow_lists.clear()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def _drain_clients(self, sock: zmq.Socket) -> None:
        """As _drain, each request with its sender (an attach retried from a new socket is told from another client)."""
        curve = bool(self.cfg.curve_secret_key)
        for _ in range(DRAIN_BATCH):
            try:
                frames, sender = recv_frames_and_sender(sock, curve)
            except zmq.Again:
                return
            self.on_client_frames(frames, sender)

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            handle(frames)

    # --- housekeeping --------------------------------------------------------------------------
    def housekeeping(self) -> None:
        """Deadlines, dead and hung actors, heartbeats; session expiry once a second."""
        now = self.now
        self._next_housekeeping = now + HOUSEKEEPING_S
        for job in [j for j in self.jobs.values() if j.deadline <= now]:
            self._answer_job(
                job,
                p.error_body(
                    job.rid,
                    job.mode,
                    p.E_TIMEOUT,
                    "no answer within the deadline" + ("" if self.registry.actors else " (no actor connected)"),
                ),
            )
        self.check_actors()
        self.notifier.watchdog(now)  # from the loop itself: a hung loop stops the pings
        if now >= self._next_status:
            self._next_status = now + 1.0
            self.step_rate.add(now, self.metrics["broker/steps"])
            self.notifier.status(self.status_line(), min_interval_s=5.0)
            if self.metrics_server is not None:
                self.metrics_server.update(self.status())
        if now >= self._next_session_scan:
            self._next_session_scan = now + SESSION_SCAN_S
            if not self.storage_ok:
                self._reload()
                return
            self.expire_sessions()
            self._refresh_stream_state()
