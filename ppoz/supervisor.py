"""Start, watch and stop a set of child processes: the mechanism behind `ppoz up`.

Every component is an ordinary `ppoz` process (the same command a farm runs on
its own machine), started with its output piped through a reader thread that
prefixes each line with the component's name and keeps the last few lines. A
component that exits on its own is reported by name with those lines, then
restarted (with a growing pause, at most `max_restarts` times) or, if
configured so or out of restarts, the whole set is stopped. Stopping sends
SIGTERM in reverse start order (clients first, the broker last, so nothing
is left waiting on a peer that is already gone), waits up to a deadline, then
SIGKILLs what is left. Children also die with the supervisor (PDEATHSIG).

A supervisor given a `record` file keeps in it every child it runs (name, pid, start time), so that the
next one started on the same files can find children of a supervisor that was killed -9, which the
kernel sent SIGTERM but which may still be stopping, and wait for them (`stop_previous`) before it
starts anything that would share their ports or their Redis files.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from common.processes import EXIT_STOPPED_ON_INPUT, die_with_parent

log = logging.getLogger(__name__)

RESTART = "restart"
STOP = "stop"


@dataclass
class Component:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restartable: bool = True  # False: an exit (code 0 or not) is final and never restarts it
    process: subprocess.Popen | None = None
    restarts: int = 0
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    reader: threading.Thread | None = None
    next_start: float = 0.0  # a pending restart happens at this time.monotonic()
    finished: bool = False  # exited with code 0 on its own: its work is done

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    def __init__(
        self,
        on_failure: str = RESTART,
        max_restarts: int = 5,
        stop_timeout_s: float = 30.0,
        log_lines: int = 20,
        output: IO[str] | None = None,
        record: Path | None = None,
    ) -> None:
        if on_failure not in (RESTART, STOP):
            raise ValueError(f"on_failure={on_failure!r}: must be {RESTART!r} or {STOP!r}")
        self.on_failure = on_failure
        self.max_restarts = max_restarts
        self.stop_timeout_s = stop_timeout_s
        self.log_lines = log_lines
        self.output = output or sys.stdout
        self.components: list[Component] = []
        self.stop_event = threading.Event()
        self.failed: str | None = None  # the component whose death stopped everything
        self.record = record  # where every child is kept (ChildRecord), for the next supervisor on these files
        self.adopted: list[ChildRecord] = []  # children started by others for this stack (the embedded Redis)
        self._print_lock = threading.Lock()
        self._width = 8

    # --- starting -------------------------------------------------------------------------
    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None, restartable: bool = True) -> Component:
        if any(c.name == name for c in self.components):
            raise ValueError(f"two components named {name!r}")
        c = Component(name, argv, env or {}, restartable, last_lines=deque(maxlen=self.log_lines))
        self.components.append(c)
        self._width = max(self._width, len(name))
        return c

    def start(self, component: Component) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **component.env}
        component.process = subprocess.Popen(
            component.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            bufsize=1,
            errors="replace",
            preexec_fn=die_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only, which stops them in order
        )
        component.finished = False
        component.last_lines.clear()  # a death is reported with its own process's lines, not an earlier run's
        component.reader = threading.Thread(
            target=self._pump, args=(component, component.process.stdout), name=f"log-{component.name}", daemon=True
        )
        component.reader.start()
        log.info("started %s (pid %d)", component.name, component.process.pid)
        self._write_record()

    def adopt(self, name: str, pid: int) -> None:
        """Keep a child someone else started for this stack (the embedded Redis) in the record too."""
        child = ChildRecord.of(name, pid)
        if child is not None:
            self.adopted.append(child)
            self._write_record()

    def _write_record(self) -> None:
        if self.record is None:
            return
        children = [*self.adopted, *(ChildRecord.of(c.name, c.pid) for c in self.components if c.running() and c.pid is not None)]
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(c) for c in children if c is not None]))
        tmp.replace(self.record)

    def start_all(self, wait_between: Callable[[Component], None] | None = None) -> None:
        """Start the components in order; `wait_between(c)` may wait until `c` is ready for the next."""
        for c in self.components:
            if self.stop_event.is_set():
                return
            self.start(c)
            if wait_between is not None:
                wait_between(c)

    def _pump(self, component: Component, stream: IO[str] | None) -> None:
        if stream is None:
            return
        for line in stream:
            line = line.rstrip("\n")
            component.last_lines.append(line)
            with self._print_lock:
                print(f"{component.name:>{self._width}} | {line}", file=self.output, flush=True)
        stream.close()

    # --- watching -------------------------------------------------------------------------
    def watch(self, poll_s: float = 0.2, until: Callable[[], bool] | None = None) -> int:
        """Supervise until stopped (or `until()` is true); then stop everything. 0 on a clean stop, 1 after a failure."""
        while not self.stop_event.is_set() and not (until is not None and until()):
            self.check()
            self.stop_event.wait(poll_s)
        self.stop_all()
        return 1 if self.failed else 0

    def check(self) -> None:
        """One supervision pass: notice exits, schedule and perform restarts."""
        now = time.monotonic()
        for c in self.components:
            if c.process is None or c.finished:
                continue
            code = c.process.poll()
            if code is None:
                continue
            if c.next_start == 0.0:
                self._exited(c, code, now)
            elif now >= c.next_start and not self.stop_event.is_set():
                c.next_start = 0.0
                c.restarts += 1
                log.warning("restarting %s (restart %d of %d)", c.name, c.restarts, self.max_restarts)
                self.start(c)

    def _exited(self, c: Component, code: int, now: float) -> None:
        if c.reader is not None:
            c.reader.join(2)  # so its last lines are in hand
        if code == 0:
            log.info("%s finished (exit code 0)", c.name)
            c.finished = True
            return
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        tail = "\n".join(f"    {line}" for line in c.last_lines) or "    (no output)"
        log.error("%s died (%s); its last lines:\n%s", c.name, how, tail)
        stopped_on_input = code == EXIT_STOPPED_ON_INPUT
        if not c.restartable or stopped_on_input or self.on_failure == STOP or c.restarts >= self.max_restarts:
            reason = (
                "it is not restartable"
                if not c.restartable
                else f"it stopped on its input (exit code {code}): a restart would meet the same input"
                if stopped_on_input
                else ("on_failure is stop" if self.on_failure == STOP else f"it was restarted {c.restarts} times already")
            )
            log.error("stopping everything: %s died and %s", c.name, reason)
            self.failed = c.name
            self.stop_event.set()
            c.finished = True
            return
        c.next_start = now + min(2.0**c.restarts, 30.0)  # a crash loop must not spin

    # --- stopping -------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask `watch` to stop everything (safe from a signal handler or another thread)."""
        self.stop_event.set()

    def stop_all(self) -> None:
        """SIGTERM in reverse start order, each waited for up to stop_timeout_s; SIGKILL past it."""
        self.stop_event.set()
        for c in reversed(self.components):
            process = c.process
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGTERM; killing it", c.name, self.stop_timeout_s)
                process.kill()
                process.wait(5)
            log.info("stopped %s (exit code %s)", c.name, process.returncode)
        for c in self.components:
            if c.reader is not None:
                c.reader.join(2)


@dataclass(frozen=True)
class ChildRecord:
    """One child as the record keeps it: its start time tells it from a later process that got the same pid."""

    name: str
    pid: int
    started: str  # field 22 of /proc/<pid>/stat: clock ticks after boot

    @classmethod
    def of(cls, name: str, pid: int) -> ChildRecord | None:
        started = _start_time(pid)
        return cls(name, pid, started) if started is not None else None

    def running(self) -> bool:
        """Still this process, and not a zombie (a child of a dead parent is reaped at once by init)."""
        return _start_time(self.pid) == self.started


def _start_time(pid: int) -> str | None:
    """A live process's start time (None if it is gone, a zombie, or there is no /proc to ask)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": field 3 (the state) on
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def stop_previous(record: Path, timeout_s: float) -> list[str]:
    """Children that a supervisor killed -9 left in `record`: each still running is sent SIGTERM (the kernel sent
    them one when it died, PDEATHSIG), given `timeout_s` to stop, then SIGKILLed, as that supervisor's
    `stop_all` would have done. Only processes the record names with their start time are touched. Returns
    what was found running, named ("learner (pid 1234)")."""
    try:
        children = [ChildRecord(**c) for c in json.loads(record.read_text())]
    except (OSError, ValueError, TypeError):
        return []
    running = [c for c in children if c.running()]
    if not running:
        return []
    named = [f"{c.name} (pid {c.pid})" for c in running]
    log.warning("the previous run's %s still run; stopping them first (SIGTERM, SIGKILL after %.0f s)", ", ".join(named), timeout_s)
    for c in running:
        _signal(c, signal.SIGTERM)
    end = time.monotonic() + timeout_s
    while running and time.monotonic() < end:
        time.sleep(0.1)
        running = [c for c in running if c.running()]
    for c in running:
        log.warning("the previous run's %s (pid %d) did not stop within %.0f s of SIGTERM; killing it", c.name, c.pid, timeout_s)
        _signal(c, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while running and time.monotonic() < end:
        time.sleep(0.05)
        running = [c for c in running if c.running()]
    if running:
        raise StackBusy(f"the previous run's {', '.join(f'{c.name} (pid {c.pid})' for c in running)} would not stop; stop it first")
    return named


class StackBusy(RuntimeError):
    """Another live process holds what this stack needs: its run directory's lock, or one of its ports."""


def hold_lock(path: Path) -> IO[str]:
    """An exclusive lock on `path` for as long as the returned file stays open (the kernel lets go of it when this
    process dies, kill -9 included); StackBusy naming the holder's pid if another live process holds it."""
    import fcntl

    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StackBusy(f"{path} is locked by process {holder}, which still runs on these files; stop it first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _signal(child: ChildRecord, signum: int) -> None:
    if child.running():  # checked again just before: the pid still belongs to the process recorded
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


def _signal_name(number: int) -> str:
    """SIGKILL for 9; real-time signals (SIGRTMIN+1 ...) have no name in `signal.Signals`: "signal 35"."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
