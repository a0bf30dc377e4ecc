"""The blocking client shared by threads: one socket, a lock per attempt, deadlines that include waiting for it."""

from __future__ import annotations

import threading
import time

import pytest

from client import Client, RequestTimeout
from common import protocol as p
from tests.client.helpers import EchoPolicy, pick, run_threads


def test_eight_threads_share_one_client(serving, make_client, redis_client, key_prefix):
    broker, _ = serving(policy=EchoPolicy(), credits=16)
    # a second attempt fails the test: 160 requests of 8 threads in turn on one socket, 1-3 s in all alone; x10 an attempt
    client = make_client(broker.frontend, deadline=30, attempt_timeout=20)

    def emulator(i: int) -> None:
        task = client.attach(task_id=f"emu-{i}")
        for n in range(10):
            wanted = (i + n) % 32
            reply = client.step(task, pick(wanted))
            assert (reply["task_id"], reply["action"]) == (task, wanted)
            assert client.feedback(task, reward=float(n))["task_id"] == task

    assert run_threads(emulator, 8) == []
    assert client.attempts == 8 * 21, "a reply taken by the wrong thread would have forced a second attempt"
    for i in range(8):
        stored = [p.decode(x) for x in redis_client.lrange(f"{key_prefix}:seg:emu-{i}", 0, -1)]
        assert [(t["action"], t["reward"]) for t in stored] == [((i + n) % 32, float(n)) for n in range(10)]


def test_a_thread_waiting_for_the_socket_keeps_its_own_deadline(start_broker, make_client):
    broker = start_broker()  # no actor: a step holds the socket for its whole attempt
    client = make_client(broker.frontend, deadline=2, attempt_timeout=2)  # the holder's 2 s and the ping's 0.5 s are under test
    task = client.attach()
    holder = threading.Thread(target=lambda: pytest.raises(RequestTimeout, client.step, task, pick(0)), daemon=True)
    holder.start()
    time.sleep(0.2)  # not a deadline: the holder takes the socket at once
    started = time.monotonic()
    with pytest.raises(RequestTimeout):
        client.request("ping", deadline=0.5)
    # its own 0.5 s, not the holder's step, which ends 1.8 s after the ping began: the bound was 1.0 s; 1.5 s tells the
    # two apart as well and leaves a loaded machine's late wake-up room
    assert 0.4 < time.monotonic() - started < 1.5, "the ping must not wait for the step to end"
    holder.join(10)  # the holder's 2 s deadline is a timer, which load does not stretch; x5
    assert not holder.is_alive() and client.ping()["status"] == "ok"


def test_bad_timeouts_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="`attempt_timeout` must be a positive number of seconds, got 0"):
        Client("tcp://127.0.0.1:5555", attempt_timeout=0)
