"""systemd's notify protocol, without libsystemd: datagrams to $NOTIFY_SOCKET.

A service started with Type=notify tells systemd READY=1 once it can do its
job, WATCHDOG=1 regularly (systemd restarts it if the pings stop for
WatchdogSec), STATUS=<text> for `systemctl status`, and STOPPING=1 when it
shuts down. Each message is one datagram of newline-separated KEY=VALUE lines
to the unix socket named in NOTIFY_SOCKET (a leading `@` names an abstract
socket). Outside systemd NOTIFY_SOCKET is unset and every call is a no-op.
The watchdog interval is WATCHDOG_USEC (for this process only, if WATCHDOG_PID
names another); pings go out at half of it, from whichever loop calls
`watchdog()`, so a hung loop stops them.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address = ("\0" + path[1:]) if path.startswith("@") else path
        self.watchdog_s = 0.0
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._sock: socket.socket | None = None
        self._warned = False
        self._last_ping = 0.0
        self._last_status = ""
        self._last_status_at = -1e9

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> bool:
        """Send one notification; False if there is no socket, its queue is full, or it failed (logged once)."""
        if not self.address:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never wait on the listener: a full queue must not stall the loop that feeds the watchdog.
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except BlockingIOError:
            log.debug("systemd's notify queue is full; dropped %r", lines)
            return False
        except OSError as e:
            if not self._warned:
                log.warning("could not notify systemd at %r: %s (further failures are not logged)", self.address, e)
                self._warned = True
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def status(self, text: str, min_interval_s: float = 2.0) -> bool:
        """STATUS=text, sent when it changed and at most every `min_interval_s` (callers may call it every turn)."""
        now = time.monotonic()
        if text == self._last_status or now - self._last_status_at < min_interval_s:
            return False
        self._last_status, self._last_status_at = text, now
        return self.send(f"STATUS={text}")

    def watchdog(self, now: float | None = None) -> bool:
        """WATCHDOG=1 if half the watchdog interval has passed since the last ping (call it from the main loop)."""
        if not self.watchdog_s or not self.address:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_ping < self.watchdog_s / 2:
            return False
        self._last_ping = now
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class NotifyListener:
    """The protocol's receiving end, for a parent that starts a component and waits until it serves (`ppoz up`).

    An abstract unix datagram socket whose name goes into the child's NOTIFY_SOCKET: the child says READY=1
    itself once it serves, so readiness needs no request to its own sockets, which under CURVE and
    allow-lists a parent without keys could not make. Later notifications (status, watchdog) queue in the
    kernel up to its limit, and past it the child's non-blocking sends drop them."""

    def __init__(self, component: str) -> None:
        self.name = f"ppoz-{os.getpid()}-{component}-{os.urandom(4).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + self.name)

    @property
    def env(self) -> dict[str, str]:
        """The child's environment entry that points its Notifier here."""
        return {"NOTIFY_SOCKET": "@" + self.name}

    def ready(self, timeout: float) -> bool:
        """Whether READY=1 came within `timeout` seconds; other notifications are read and dropped."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            if b"READY=1" in data.split(b"\n"):
                return True
        return False

    def close(self) -> None:
        self.sock.close()
