"""common.daemon_pool: calls at once, results in order, errors after every call is done, and a process that is done
exits while a call is still blocked (a ThreadPoolExecutor's held `ppoz train` up to its requests' deadline)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from common.daemon_pool import DaemonPool
from tests.helpers import PROCESS_START_S


def test_calls_run_at_once_and_come_back_in_order():
    pool = DaemonPool(3, "test")
    inside = threading.Barrier(3)

    def call(x: int) -> int:
        inside.wait(timeout=30)  # all three are in at once, or this raises BrokenBarrierError
        return x * x

    assert pool.map(call, [3, 1, 2]) == [9, 1, 4]
    pool.shutdown()


def test_the_first_error_is_raised_once_every_call_is_done():
    pool = DaemonPool(2, "test")
    done: list[int] = []

    def call(x: int) -> int:
        if x == 0:
            raise KeyError("first")
        time.sleep(0.3)
        done.append(x)
        return x

    with pytest.raises(KeyError, match="first"):
        pool.map(call, [0, 1])
    assert done == [1]  # the slow call had finished before the error was raised


def test_a_process_that_is_done_exits_with_a_call_still_blocked():
    code = (
        "import threading; from common.daemon_pool import DaemonPool; pool = DaemonPool(2, 'blocked'); "
        "never = [threading.Event()] * 2; threading.Thread(target=pool.map, args=(lambda e: e.wait(), never), daemon=True).start(); "
        "print('done', flush=True)"
    )
    # the calls never end: a pool whose threads the interpreter joins at exit (ThreadPoolExecutor's) runs past the timeout
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROCESS_START_S)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
