"""Redis goes away under a running broker: no false acknowledgement, and service resumes when it is back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from broker.config import BrokerConfig
from broker.server import Broker
from client import Client
from common import protocol as p
from common.redis_server import EmbeddedRedis, connect
from common.shared_settings import StoreSettings
from tests.broker.test_broker import raw_request
from tests.helpers import OBS, actors_ready, wait_for


@dataclass
class OwnRedis:
    """A broker thread with an actor and a client, on a redis-server of the test's own that it may stop and start again."""

    data_dir: Path
    server: EmbeddedRedis
    broker: Broker
    thread: threading.Thread
    client: Client
    zmq_context: zmq.Context

    def restart_redis(self) -> None:
        """Start Redis again on the same socket path and append-only file."""
        self.server = EmbeddedRedis(appendonly=True, data_dir=self.data_dir).start()

    def raw(self, op: str, rid: str, **fields: Any) -> dict[str, Any]:
        """One request on a fresh socket; its reply (the client's retry rule left out)."""
        return raw_request(self.zmq_context, self.broker.frontend_endpoint, [b"", p.encode(p.header(op, rid) | fields)])


@pytest.fixture
def own_redis(tmp_path, start_actor, make_client, zmq_context) -> Iterator[Callable[..., OwnRedis]]:
    started: list[OwnRedis] = []

    def start(client_deadline: float = 10.0) -> OwnRedis:  # make_client's default (tests/conftest.py says why)
        server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()
        cfg = BrokerConfig(
            frontend="tcp://127.0.0.1:*",
            backend="tcp://127.0.0.1:*",
            store=StoreSettings(redis_url=server.url),
            heartbeat_ms=100,
            storage_timeout_ms=1000,
        )
        # its commands take ms; 1 s bounds how long one waits on the Redis the tests stop, which is what they test
        broker = Broker(cfg, connect(server.url, socket_timeout=1.0), zmq_context)
        broker.start()
        thread = threading.Thread(target=broker.run, daemon=True)
        thread.start()
        start_actor(broker.backend_endpoint)
        client = make_client(broker.frontend_endpoint, deadline=client_deadline)
        wait_for(lambda: actors_ready(client, 1), what="the actor")
        started.append(OwnRedis(tmp_path, server, broker, thread, client, zmq_context))
        return started[-1]

    yield start
    for s in started:
        s.broker.stop()
        s.thread.join(10)  # as RunningBroker.stop in tests/conftest.py
        s.server.stop()


@pytest.mark.slow
def test_broker_refuses_writes_while_redis_is_down_and_recovers(own_redis):
    s = own_redis()
    task = s.client.attach()
    s.client.step(task, OBS)
    s.client.feedback(task, 1.0)
    s.client.step(task, OBS)

    s.server.stop()
    reply = s.raw("feedback", "fb-down", task_id=task, reward=2.0)
    assert reply["error"]["code"] in (p.E_INTERNAL, p.E_OVERLOADED)  # never "ok" while Redis is away
    wait_for(lambda: not s.broker.storage_ok, what="the broker to notice Redis is gone")

    s.restart_redis()
    # redis-server back in 0.1 s, then the broker's once-a-second reload: 1-2 s alone; x10
    wait_for(lambda: s.broker.storage_ok, timeout=20, what="the broker to reconnect")
    # The retried feedback (same rid) is applied exactly once, on top of the data that survived.
    assert s.client.feedback(task, 2.0, rid="fb-down")["status"] == "ok"
    assert s.client.feedback(task, 2.0, rid="fb-down")["status"] == "ok"
    stored = connect(s.server.url).lrange(f"ppoz:seg:{task}", 0, -1)
    assert [p.decode(x)["reward"] for x in stored] == [1.0, 2.0]
    assert s.broker.metrics["errors/storage"] >= 1


@pytest.mark.slow
def test_a_retry_while_redis_is_still_down_is_not_answered_from_memory(own_redis):
    """The failed write's feedback was remembered in memory; its retry must wait for Redis, not get that `ok`.

    Found by the Redis-restart fault test: a retry answered from the in-memory reply cache was
    acknowledged but never stored, and the next step orphaned the step it belonged to.
    """
    s = own_redis()
    task = s.client.attach()
    s.client.step(task, OBS)
    s.server.stop()
    first = s.raw("feedback", "fb-1", task_id=task, reward=2.0)
    assert first["error"]["code"] in (p.E_INTERNAL, p.E_OVERLOADED)
    wait_for(lambda: not s.broker.storage_ok, what="the broker to notice Redis is gone")
    for _ in range(3):  # retries with the same rid while Redis is still down
        retry = s.raw("feedback", "fb-1", task_id=task, reward=2.0)
        assert retry.get("status") != "ok" and retry["error"]["code"] == p.E_OVERLOADED, retry
    ask = s.raw("ask", "a-1", task_id=task)
    assert ask["status"] == "wait" and ask["reason"] == "storage", ask

    s.restart_redis()
    wait_for(lambda: s.broker.storage_ok, timeout=20, what="the broker to reconnect")  # as above
    assert s.client.feedback(task, 2.0, rid="fb-1")["status"] == "ok"  # applied now, once
    stored = connect(s.server.url).lrange(f"ppoz:seg:{task}", 0, -1)
    assert [p.decode(x)["reward"] for x in stored] == [2.0]
    assert s.broker.metrics["broker/orphan_steps"] == 0


@pytest.mark.slow
def test_an_idle_broker_notices_redis_gone_by_its_stream_length_read_and_recovers(own_redis):
    """No request writes while Redis is away: housekeeping's read finds it, the sessions leave memory, and come back."""
    s = own_redis()
    task = s.client.attach()
    s.client.step(task, OBS)
    s.server.stop()
    # the broker's once-a-second read, which fails at once on the closed port (or after its 1 s socket timeout): 1-2 s
    # alone. The wait was the 10 s default (x5): 20 s
    wait_for(lambda: not s.broker.storage_ok, timeout=20, what="the idle broker to notice Redis is gone")
    status = s.client.status()  # answered without Redis
    assert status["storage_ok"] is False and status["sessions"] == 0 and status["counters"]["errors/storage"] == 1
    s.restart_redis()
    wait_for(lambda: s.broker.storage_ok, timeout=20, what="the broker to reconnect")  # as above
    assert s.client.status()["pending_steps"] == 1, "the session and its pending step come back from Redis"
    assert s.client.feedback(task, 1.0)["status"] == "ok"
    assert connect(s.server.url).llen(f"ppoz:seg:{task}") == 1


def test_a_redis_that_refuses_writes_but_answers_reads_gets_internal_and_nothing_is_acknowledged(own_redis):
    """A full Redis (maxmemory, noeviction): the write fails, memory is reloaded from Redis at once, storage stays up."""
    s = own_redis(client_deadline=1.0)  # its requests are answered in ms (the step by an actor thread, 10-100 ms); x10 and more
    admin = connect(s.server.url)
    try:
        task = s.client.attach()
        s.client.step(task, OBS)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        for _ in range(2):  # the write fails each time; the reply never says ok
            reply = s.raw("feedback", "fb-full", task_id=task, reward=1.0)
            assert reply["error"]["code"] == p.E_INTERNAL and reply["rid"] == "fb-full", reply
        assert s.broker.storage_ok and s.client.status()["pending_steps"] == 1, "reads work: memory is Redis's again, the step pending"
        admin.config_set("maxmemory", "0")
        reply = s.raw("feedback", "fb-full", task_id=task, reward=1.0)
        assert reply["status"] == "ok", reply
        assert admin.llen(f"ppoz:seg:{task}") == 1 and s.broker.metrics["errors/storage"] == 2
    finally:
        admin.close()


def test_a_failed_read_while_a_batch_is_in_flight_leaves_that_batch_to_its_own_answer(redis_url, key_prefix, zmq_context):
    """A read error says nothing sure about the batch Redis is applying: it must not be answered `internal` for it."""
    cfg = BrokerConfig(
        frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix)
    )
    broker = Broker(cfg, connect(redis_url), zmq_context)
    broker.start()
    client = zmq_context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(broker.frontend_endpoint)
    try:
        client.send_multipart([b"", p.encode(p.header("attach", "a-1"))])
        assert broker.frontend.poll(5000)  # a frame on loopback: ms alone; x1000
        broker.on_client_frames(broker.frontend.recv_multipart())
        broker.commit()
        assert broker.outbox.in_flight
        broker._storage_lost("Redis read failed (stream length): a stand-in")  # what housekeeping calls on a failed read

        def replied() -> dict | None:
            broker.now = time.monotonic()
            broker.commit()
            return p.decode(client.recv_multipart()[-1]) if client.poll(10) else None  # a look, under wait_for's deadline

        reply = wait_for(replied, what="the attach's own reply")
        assert reply["status"] == "attached" and reply["rid"] == "a-1", reply
        assert broker.storage_ok and broker.metrics["errors/storage"] == 0 and len(broker.sessions) == 1
    finally:
        client.close(linger=0)
        broker.close()
