"""The supervisor behind `ppoz up`: named output, crash reports, restarts with a pause, stopping in reverse order."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.processes import EXIT_STOPPED_ON_INPUT
from ppoz.supervisor import Component, Supervisor
from tests.helpers import wait_for

LOGGER = "ppoz.supervisor"
# SIGTERM's default action ends it; its 30 s outlast every test that uses it (each ends it within a few seconds)
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(30)\n"
# Counts its runs in the file argv[1] and says which run it is, then dies as argv[2] says.
CRASHER = """\
import os, signal, sys, time
from pathlib import Path
runs = Path(sys.argv[1])
run = len(runs.read_text().splitlines()) if runs.exists() else 0
with runs.open("a") as f:
    f.write(f"{time.monotonic()}\\n")
print(f"run {run}")
print("boom on stderr", file=sys.stderr)
how = sys.argv[2]
if how.startswith("signal "):
    os.kill(os.getpid(), int(how.split()[1]))
    time.sleep(10)
sys.exit(int(how))
"""
# Appends its name to argv[2] on SIGTERM, then exits 0 after a short pause (or not at all, if argv[3] is "stubborn").
TERMINABLE = """\
import signal, sys, time
name, path, stubborn = sys.argv[1], sys.argv[2], sys.argv[3] == "stubborn"
def on_term(signum, frame):
    with open(path, "a") as f:
        f.write(name + "\\n")
    if not stubborn:
        time.sleep(0.2)  # still running: the next one must wait for this one's exit
        with open(path, "a") as f:
            f.write(name + " exited\\n")
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
end = time.monotonic() + 20  # even a stubborn one goes by itself in the end (the tests SIGKILL it after 1 s of grace)
while time.monotonic() < end:
    time.sleep(0.05)
"""


class Lines:
    """A thread-safe text output that the supervisor's reader threads print to."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def lines(self) -> list[str]:
        with self._lock:
            return "".join(self._parts).splitlines()


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


@pytest.fixture
def make_supervisor() -> Iterator[Callable[..., tuple[Supervisor, Lines]]]:
    """Supervisors writing to their own Lines; whatever they still run is stopped at teardown."""
    made: list[Supervisor] = []

    def make(**kwargs: object) -> tuple[Supervisor, Lines]:
        out = Lines()
        # stop_timeout_s: these children end on SIGTERM in ms, or 0.2 s later (TERMINABLE); x10
        sup = Supervisor(output=out, **{"stop_timeout_s": 2.0, **kwargs})  # type: ignore[arg-type]
        made.append(sup)
        return sup, out

    yield make
    for sup in made:
        sup.stop_all()


def watch(sup: Supervisor, until: Callable[[], bool] | None = None, limit_s: float = 20.0) -> int:
    """sup.watch() with a fast poll, bounded in time so that a supervisor that never stops fails the test instead.
    `limit_s`: what the tests watch (python -c children starting in 50 ms, a crash, a restart after its 1 s back-off)
    takes 2 s at most alone; x10."""
    end = time.monotonic() + limit_s
    code = sup.watch(poll_s=0.05, until=lambda: time.monotonic() > end or (until is not None and until()))
    assert time.monotonic() < end, "watch() ran until the test's time limit"
    return code


def died_records(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.ERROR and r.getMessage().startswith(f"{name} died (")
    ]


# -- output ----------------------------------------------------------------------------------------------------------


def test_every_output_line_carries_its_component_name(
    make_supervisor: Callable[..., tuple[Supervisor, Lines]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    sup, out = make_supervisor()
    web = sup.add("web", python("import sys\nprint('hello')\nprint('on stderr', file=sys.stderr)\nprint('bye')"))
    long = sup.add("a-much-longer-name", python("for i in range(3): print(f'line {i}')"))
    sup.start_all()
    assert watch(sup, until=lambda: web.finished and long.finished) == 0
    lines = out.lines()
    assert [line for line in lines if line.startswith("               web | ")] == [
        "               web | hello",
        "               web | on stderr",
        "               web | bye",
    ]
    assert [line for line in lines if line.startswith("a-much-longer-name | ")] == [f"a-much-longer-name | line {i}" for i in range(3)]
    assert len(lines) == 6  # nothing unprefixed
    assert sup.failed is None and (web.restarts, long.restarts) == (0, 0)
    assert {"web finished (exit code 0)", "a-much-longer-name finished (exit code 0)"} <= {r.getMessage() for r in caplog.records}


def test_a_short_name_is_padded_to_eight(make_supervisor: Callable[..., tuple[Supervisor, Lines]]) -> None:
    sup, out = make_supervisor()
    c = sup.add("db", python("print('x')"))
    sup.start_all()
    watch(sup, until=lambda: c.finished)
    assert out.lines() == ["      db | x"]


# -- exits -----------------------------------------------------------------------------------------------------------


def test_exit_0_is_finished_and_not_restarted(
    make_supervisor: Callable[..., tuple[Supervisor, Lines]], caplog: pytest.LogCaptureFixture
) -> None:
    sup, out = make_supervisor(max_restarts=3)
    done = sup.add("done", python("print('all done')"))
    sleeper = sup.add("sleeper", python(SLEEPER))
    sup.start_all()
    started = time.monotonic()
    # past the 1 s a restart would wait: a look for a restart that must not come (load can only make it pass wrongly)
    assert watch(sup, until=lambda: time.monotonic() > started + 1.5) == 0
    assert done.finished and done.restarts == 0 and sup.failed is None
    assert [line for line in out.lines() if "all done" in line] == ["    done | all done"]
    assert not died_records(caplog, "done")
    assert sleeper.process is not None and sleeper.process.returncode == -signal.SIGTERM  # watch() stopped it at the end


def test_crash_is_reported_and_restarted_until_out_of_restarts(
    make_supervisor: Callable[..., tuple[Supervisor, Lines]], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    runs = tmp_path / "runs"
    sup, out = make_supervisor(max_restarts=1)
    sleeper = sup.add("sleeper", python(SLEEPER))
    crasher = sup.add("crasher", python(CRASHER, str(runs), "4"))
    sup.start_all()
    assert watch(sup) == 1
    assert sup.failed == "crasher" and crasher.restarts == 1
    assert sleeper.process is not None and sleeper.process.returncode == -signal.SIGTERM  # everything was stopped

    starts = [float(t) for t in runs.read_text().split()]
    assert len(starts) == 2 and starts[1] - starts[0] >= 0.9  # the first restart waits 2**0 s (load only lengthens it)
    reports = died_records(caplog, "crasher")
    assert reports == [f"crasher died (exit code 4); its last lines:\n    run {run}\n    boom on stderr" for run in (0, 1)]
    assert "stopping everything: crasher died and it was restarted 1 times already" in [r.getMessage() for r in caplog.records]
    assert [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()] == ["restarting crasher (restart 1 of 1)"]
    assert [line for line in out.lines() if line.startswith(" crasher | ")] == [
        " crasher | run 0",
        " crasher | boom on stderr",
        " crasher | run 1",
        " crasher | boom on stderr",
    ]


@pytest.mark.parametrize(
    ("on_failure", "restartable", "how", "said", "reason"),
    [
        ("stop", True, "1", "exit code 1", "on_failure is stop"),
        ("restart", False, f"signal {int(signal.SIGKILL)}", "killed by SIGKILL", "it is not restartable"),
        ("stop", True, f"signal {int(signal.SIGRTMIN) + 1}", f"killed by signal {int(signal.SIGRTMIN) + 1}", "on_failure is stop"),
        # a learner that stopped on non-finite updates in a row: a restart would only meet the same input
        (
            "restart",
            True,
            str(EXIT_STOPPED_ON_INPUT),
            "exit code 3",
            "it stopped on its input (exit code 3): a restart would meet the same input",
        ),
    ],
)
def test_first_death_stops_everything_when_configured_so(
    make_supervisor: Callable[..., tuple[Supervisor, Lines]],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    on_failure: str,
    restartable: bool,
    how: str,
    said: str,
    reason: str,
) -> None:
    sup, _ = make_supervisor(on_failure=on_failure, max_restarts=5)
    first = sup.add("first", python(SLEEPER))
    victim = sup.add("victim", python(CRASHER, str(tmp_path / "runs"), how), restartable=restartable)
    last = sup.add("last", python(SLEEPER))
    sup.start_all()
    assert watch(sup) == 1
    assert sup.failed == "victim" and victim.restarts == 0
    assert died_records(caplog, "victim") == [f"victim died ({said}); its last lines:\n    run 0\n    boom on stderr"]
    assert f"stopping everything: victim died and {reason}" in [r.getMessage() for r in caplog.records]
    assert not first.running() and not last.running()
    assert len((tmp_path / "runs").read_text().split()) == 1


# -- stopping --------------------------------------------------------------------------------------------------------


def test_stop_all_goes_in_reverse_order_and_kills_what_ignores_sigterm(
    make_supervisor: Callable[..., tuple[Supervisor, Lines]], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    order = tmp_path / "order"
    sup, out = make_supervisor(stop_timeout_s=1.0)
    components: list[Component] = [
        sup.add(name, python(TERMINABLE, name, str(order), "stubborn" if name == "a" else "polite")) for name in "abc"
    ]
    sup.start_all()
    wait_for(lambda: sum(line.endswith(" | ready") for line in out.lines()) == 3, what="three children ready")
    started = time.monotonic()
    sup.stop_all()
    elapsed = time.monotonic() - started
    assert order.read_text().splitlines() == ["c", "c exited", "b", "b exited", "a"]  # each waited for before the next
    a, b, c = components
    assert (c.process.returncode, b.process.returncode, a.process.returncode) == (0, 0, -signal.SIGKILL)  # type: ignore[union-attr]
    # a's full second of grace, then SIGKILL: 1.4 s alone, and 4.6 s for a loaded machine, far short of the 20 s after
    # which the stubborn child goes by itself
    assert 1.0 <= elapsed < 6.0, elapsed
    assert "a did not stop within 1 s of SIGTERM; killing it" in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sup.stop_event.is_set()


def test_stop_from_another_thread_ends_watch(make_supervisor: Callable[..., tuple[Supervisor, Lines]]) -> None:
    sup, _ = make_supervisor()
    sleeper = sup.add("sleeper", python(SLEEPER))
    sup.start_all()
    timer = threading.Timer(0.3, sup.stop)
    timer.start()
    assert watch(sup) == 0 and sup.failed is None
    timer.join(10)  # its 0.3 s are over by now; x30
    assert sleeper.process is not None and sleeper.process.returncode == -signal.SIGTERM


# -- configuration ---------------------------------------------------------------------------------------------------


def test_invalid_on_failure_is_refused() -> None:
    with pytest.raises(ValueError, match="'ignore'"):
        Supervisor(on_failure="ignore")


def test_duplicate_names_are_refused(make_supervisor: Callable[..., tuple[Supervisor, Lines]]) -> None:
    sup, _ = make_supervisor()
    sup.add("broker", python("pass"))
    with pytest.raises(ValueError, match="'broker'"):
        sup.add("broker", python("pass"))
    assert [c.name for c in sup.components] == ["broker"]


# -- after a supervisor killed -9 ------------------------------------------------------------------------------------
def test_the_next_supervisor_stops_what_a_killed_one_left_running_and_nothing_else(
    make_supervisor: Callable[..., tuple[Supervisor, Lines]], tmp_path: Path
) -> None:
    """`ppoz train` killed -9 leaves its components stopping (the kernel sent them SIGTERM) or stuck; the next one on
    the same output directory reads their record and stops them before it binds their ports (issue 28)."""
    import json
    import os

    from ppoz.supervisor import stop_previous

    record = tmp_path / "stack.json"
    order = tmp_path / "order"
    sup, out = make_supervisor(record=record)  # as the killed supervisor would have run them
    for name in ("polite", "stubborn"):
        sup.add(name, python(TERMINABLE, name, str(order), name))
    sup.start_all()
    wait_for(lambda: sum(line.endswith(" | ready") for line in out.lines()) == 2, what="two children ready")
    kept = json.loads(record.read_text())
    assert [(c["name"], c["pid"]) for c in kept] == [(c.name, c.pid) for c in sup.components]
    started = time.monotonic()
    assert stop_previous(record, timeout_s=1.0) == [f"{c.name} (pid {c.pid})" for c in sup.components]
    assert 1.0 <= time.monotonic() - started < 6.0  # the stubborn one's second of grace, then SIGKILL (as above)
    assert [c.process.wait(5) for c in sup.components] == [0, -signal.SIGKILL]  # type: ignore[union-attr]  # ended: ms
    assert stop_previous(record, timeout_s=1.0) == []  # nothing left
    # a pid the record names but with another start time is another process now (pids are reused): never signalled
    record.write_text(json.dumps([{"name": "learner", "pid": os.getpid(), "started": "1"}]))
    assert stop_previous(record, timeout_s=0.1) == []


def test_one_stack_per_run_directory(tmp_path: Path) -> None:
    import os

    from ppoz.supervisor import StackBusy, hold_lock

    held = hold_lock(tmp_path / "stack.lock")
    with pytest.raises(StackBusy, match=f"locked by process {os.getpid()}, which still runs"):
        hold_lock(tmp_path / "stack.lock")
    held.close()  # as at exit, kill -9 included: the kernel lets go of it
    hold_lock(tmp_path / "stack.lock").close()
