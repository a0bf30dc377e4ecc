"""Kill the broker process (SIGKILL) while clients run; restart it; nothing acknowledged is lost."""

from __future__ import annotations

import threading

import pytest

from client import Client
from common.segments import Segment
from tests.helpers import OBS, wait_for
from tests.processes import BrokerProcess


@pytest.mark.slow
def test_broker_killed_and_restarted_loses_nothing(redis_url, redis_client, key_prefix, start_actor):
    broker = BrokerProcess(redis_url, key_prefix, "--heartbeat-ms", "100", "--segment-len", "4")
    endpoint = broker.frontend
    try:
        start_actor(broker.backend)
        # `ppoz broker` (no torch) starts in about 1 s alone, then the actor thread registers on 0.1 s heartbeats: x10.
        # A status attempt is answered in ms once the broker is up; 1 s attempts only resend sooner while it starts.
        probe = Client(endpoint, deadline=20, attempt_timeout=1)
        wait_for(lambda: probe.status()["actors"], timeout=20, what="the actor to register")

        acknowledged = [0] * 4
        errors: list[BaseException] = []
        stop = threading.Event()

        def emulator(i: int) -> None:
            # 0.5 s attempts resend a request the killed broker lost (a retry costs nothing: rids make it idempotent); the
            # 30 s deadline covers the restart, about 1 s alone (x30)
            with Client(endpoint, deadline=30, attempt_timeout=0.5) as c:
                task = c.attach(task_id=f"emu-{i}")
                n = 0
                try:
                    while not stop.is_set():
                        c.step(task, {**OBS, "prompt": f"emu {i} step {n}"})
                        c.feedback(task, reward=float(n))
                        acknowledged[i] += 1
                        n += 1
                except BaseException as e:  # reported by the main thread
                    errors.append(e)

        threads = [threading.Thread(target=emulator, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(acknowledged) >= 40, timeout=30, what="40 acknowledged feedbacks")  # 0.5-1 s alone; x30
        broker.kill()
        killed_at = sum(acknowledged)
        broker.restart()
        # the restart (about 1 s alone), the reconnects, then 40 feedbacks as above: 2-3 s alone; x20
        wait_for(lambda: sum(acknowledged) >= killed_at + 40, timeout=60, what="40 more feedbacks after the restart")
        stop.set()
        for t in threads:
            t.join(30)  # each ends after the request in hand: ms alone, its 30 s deadline at most
        assert not errors, errors

        status = probe.status()
        assert status["sessions"] == 4  # recovered from Redis, not re-created
        segments = [Segment.from_entry(f) for _, f in redis_client.xrange(f"{key_prefix}:segments")]
        stored = sum(len(s.transitions) for s in segments)
        stored += sum(redis_client.llen(f"{key_prefix}:seg:emu-{i}") for i in range(4))
        assert stored == sum(acknowledged), "transitions in Redis must equal the feedbacks acknowledged"
        # Each emulator's rewards count 0, 1, 2, ...: nothing lost, nothing doubled, in order.
        for i in range(4):
            rewards = [t.reward for s in segments if s.task_id == f"emu-{i}" for t in s.transitions]
            rewards += [decode_open(x)["reward"] for x in redis_client.lrange(f"{key_prefix}:seg:emu-{i}", 0, -1)]
            assert rewards == [float(n) for n in range(acknowledged[i])]
        assert len({s.seg_id for s in segments}) == len(segments)
        probe.close()
    finally:
        broker.stop(10)  # `ppoz broker` drains and exits on SIGTERM in under 1 s alone (x10); SIGKILLed past it


def decode_open(data: bytes) -> dict:
    import msgpack

    return msgpack.unpackb(data)
