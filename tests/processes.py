"""What the process-level tests share: the `ppoz` command as users run it, ports for the processes a
test starts, systemd's readiness protocol, and a supervised `ppoz up`.

Ports. `free_port` is the product's (ppoz/ports.py: ports from below the ephemeral range, which the
kernel never hands out by itself, each once per run, checked free by binding it first), with a block
of its own for each pytest-xdist worker. A process that can choose its own port (a broker thread on
`tcp://127.0.0.1:*`, a learner's `--weights-bind tcp://127.0.0.1:0`) needs none: the tests let it
bind port 0 and read the port back.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from client import Client, PPOZError
from ppoz import ports
from ppoz.ports import free_port  # noqa: F401 - the tests import it from here
from ppoz.up import ppoz_command
from tests.helpers import PROCESS_STOP_S

PPOZ = ppoz_command(log_level=None)  # the command line the product starts its own processes with


def ppoz(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run `ppoz ARGS` to its end as a user runs it; its stdout and stderr captured as text. The default `timeout`
    is for a short command (a refusal, keygen, a help text): it imports torch and ends in 3-8 s alone on the 2-core
    VM; x15. A run that does real work passes its own, with its reason."""
    return subprocess.run([*PPOZ, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def start_ppoz(*args: str, log: Path, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[str]:
    """Start `ppoz ARGS`; its stderr (and stdout unless redirected) goes to the file `log` (appended to): a pipe
    nobody reads while the process runs could fill and block it. `env` is added to this process's environment."""
    out = log.open("a")
    kwargs.setdefault("stdout", out)
    return subprocess.Popen([*PPOZ, *args], stderr=out, text=True, env={**os.environ, **(env or {})}, **kwargs)


def _use_worker_share() -> None:
    """This pytest-xdist worker's block of ports (the whole span for a run without workers)."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    ports.use_share(worker, workers)


_use_worker_share()


class NotifySocket:
    """What systemd listens on (NOTIFY_SOCKET): every datagram, in order, read all the time as systemd reads them.

    Why a reader thread: the services send without blocking and drop a notification when the
    socket's queue is full (common/sd_notify.py); a test that read only between its steps let
    a gateway's watchdog pings fill the queue while it stopped a slow learner, and the
    gateway's STOPPING=1 was dropped."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)  # not a deadline: how often the reader looks at `_closed`
        self.messages: list[str] = []
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue
            except OSError:  # closed
                return

    def receive(self, until: float) -> None:
        """Let datagrams arrive until the time `until` (monotonic)."""
        time.sleep(max(0.0, until - time.monotonic()))

    def wait_for(self, prefix: str, timeout: float, since: int = 0) -> str:
        """The first message from the `since`-th on that holds a line starting with `prefix`; fails the test after `timeout` s."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for m in self.messages[since:]:
                if m.startswith(prefix) or f"\n{prefix}" in m:
                    return m
            self.receive(min(end, time.monotonic() + 0.2))
        pytest.fail(f"no {prefix!r} within {timeout} s; got {self.messages}")

    def count(self, line: str) -> int:
        return sum(line in m.split("\n") for m in self.messages)

    def settle(self, line: str, timeout: float = 10.0) -> None:
        """Until a message holding `line` has been read, or `timeout` s; no failure (for a test's teardown: it asserts
        the count after). The default: a process that has exited sent its datagrams already, and the reader takes
        them within its 0.2 s tick (ms of work): x50."""
        end = time.monotonic() + timeout
        while not self.count(line) and time.monotonic() < end:
            time.sleep(0.02)

    def close(self) -> None:
        self._closed.set()
        self._reader.join(2)  # the reader sees `_closed` within its 0.2 s socket timeout; x10 (a daemon thread)
        self.sock.close()


def start_service(args: list[str], notify: NotifySocket, watchdog_usec: int = 400_000) -> subprocess.Popen[str]:
    """`ppoz ARGS` as systemd runs a Type=notify service: NOTIFY_SOCKET and WATCHDOG_USEC set, stderr to a file of its own."""
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": str(watchdog_usec), "PYTHONUNBUFFERED": "1"}
    log = Path(notify.path).with_suffix(f".{args[0]}.{time.monotonic_ns()}.log")
    proc = start_ppoz(*args, log=log, env=env)
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen[str], timeout: float = PROCESS_STOP_S) -> tuple[int, str]:
    """SIGTERM a process started by `start_service`, wait `timeout` s (then SIGKILL); its exit code and its log."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, Path(proc.log_path).read_text()  # type: ignore[attr-defined]


class BrokerProcess:
    """`ppoz broker` as its own process on two ports from `free_port`; `restart` binds the same ones again,
    as a restarted service does (its clients and actors reconnect to the endpoints they know)."""

    def __init__(self, redis_url: str, key_prefix: str, *flags: str, log: Path | None = None) -> None:
        front, back = free_port(), free_port()
        self.frontend, self.backend = f"tcp://127.0.0.1:{front}", f"tcp://127.0.0.1:{back}"
        self.args = ["broker", "--frontend", self.frontend, "--backend", self.backend, "--redis-url", redis_url, "--key-prefix", key_prefix]
        self.args += flags
        self.log = log
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        if self.log is None:
            return subprocess.Popen([*PPOZ, *self.args], stderr=subprocess.DEVNULL, text=True)
        return start_ppoz(*self.args, log=self.log)

    def kill(self) -> None:
        """SIGKILL: no drain, no flush."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)  # the kernel ends a SIGKILLed process at once (ms); x1000

    def restart(self) -> None:
        self.proc = self._start()

    def stop(self, timeout: float = PROCESS_STOP_S) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class Up:
    """A running `ppoz up` whose merged output is collected line by line; `cwd`: its working directory."""

    def __init__(self, config: Path, *flags: str, cwd: Path | None = None) -> None:
        command = [*PPOZ, "up", "--config", str(config), *flags]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def pid(self, component: str, nth: int = 1) -> int | None:
        found = re.findall(rf"started {re.escape(component)} \(pid (\d+)\)", self.text())
        return int(found[nth - 1]) if len(found) >= nth else None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            # up stops its components one by one, in reverse start order (a broker, an actor, a learner writing its
            # checkpoint, maybe a gateway or reward service): 5-10 s alone on the 2-core VM; x9 and more. Past it,
            # TimeoutExpired fails the test; its own stop_timeout_s (30 s a component) kills a stuck one first.
            return self.proc.wait(90)
        finally:
            self.reader.join(10)  # the pipe's writer is gone: the reader reads what is left and ends (ms); x1000


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def status(front: int) -> dict[str, Any] | None:
    """The broker's status on loopback port `front`; None while nothing answers there."""
    try:
        # one probe of a poll (callers retry it under a deadline of their own): a broker on loopback answers
        # `status` in ms, so 2 s is x100; a slower answer only costs one more probe
        with Client(f"tcp://127.0.0.1:{front}", deadline=2, attempt_timeout=2) as c:
            return c.status()
    except PPOZError:
        return None
