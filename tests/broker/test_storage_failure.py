"""Redis goes away under a running broker: no false acknowledgement, and service resumes when it is back."""

import threading
import time

import pytest
import zmq

from broker.config import BrokerConfig
from broker.server import Broker
from common import protocol as p
from common.redis_server import EmbeddedRedis, connect
from tests.broker.test_broker import raw_request
from tests.helpers import OBS, actors_ready, wait_for


def start_broker_thread(redis_url: str, zmq_context: zmq.Context) -> tuple[Broker, threading.Thread]:
    cfg = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", redis_url=redis_url, heartbeat_ms=100,
                       storage_timeout_ms=1000)  # fmt: skip
    broker = Broker(cfg, connect(redis_url, socket_timeout=1.0), zmq_context)
    broker.start()
    thread = threading.Thread(target=broker.run, daemon=True)
    thread.start()
    return broker, thread


@pytest.mark.slow
def test_broker_refuses_writes_while_redis_is_down_and_recovers(tmp_path, start_actor, make_client, zmq_context):
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()
    broker, thread = start_broker_thread(server.url, zmq_context)
    try:
        start_actor(broker.backend_endpoint)
        client = make_client(broker.frontend_endpoint)
        wait_for(lambda: actors_ready(client, 1), what="the actor")
        task = client.attach()
        client.step(task, OBS)
        client.feedback(task, 1.0)
        client.step(task, OBS)

        server.stop()
        reply = raw_request(zmq_context, broker.frontend_endpoint,
                            [b"", p.encode(p.header("feedback", "fb-down") | {"task_id": task, "reward": 2.0})])  # fmt: skip
        assert reply["error"]["code"] in (p.E_INTERNAL, p.E_OVERLOADED)  # never "ok" while Redis is away
        wait_for(lambda: not broker.storage_ok, what="the broker to notice Redis is gone")

        server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()  # same socket path, same data
        wait_for(lambda: broker.storage_ok, timeout=20, what="the broker to reconnect")
        # The retried feedback (same rid) is applied exactly once, on top of the data that survived.
        assert client.feedback(task, 2.0, rid="fb-down")["status"] == "ok"
        assert client.feedback(task, 2.0, rid="fb-down")["status"] == "ok"
        stored = connect(server.url).lrange(f"ppoz:seg:{task}", 0, -1)
        assert [p.decode(x)["reward"] for x in stored] == [1.0, 2.0]
        assert broker.metrics["errors/storage"] >= 1
    finally:
        broker.stop()
        thread.join(10)
        server.stop()


@pytest.mark.slow
def test_a_retry_while_redis_is_still_down_is_not_answered_from_memory(tmp_path, start_actor, make_client, zmq_context):
    """The failed write's feedback was remembered in memory; its retry must wait for Redis, not get that `ok`.

    Found by the Redis-restart fault test: a retry answered from the in-memory reply cache was
    acknowledged but never stored, and the next step orphaned the step it belonged to.
    """
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()
    broker, thread = start_broker_thread(server.url, zmq_context)
    try:
        start_actor(broker.backend_endpoint)
        client = make_client(broker.frontend_endpoint)
        wait_for(lambda: actors_ready(client, 1), what="the actor")
        task = client.attach()
        client.step(task, OBS)
        server.stop()
        feedback = [b"", p.encode(p.header("feedback", "fb-1") | {"task_id": task, "reward": 2.0})]
        first = raw_request(zmq_context, broker.frontend_endpoint, feedback)
        assert first["error"]["code"] in (p.E_INTERNAL, p.E_OVERLOADED)
        wait_for(lambda: not broker.storage_ok, what="the broker to notice Redis is gone")
        for _ in range(3):  # retries with the same rid while Redis is still down
            retry = raw_request(zmq_context, broker.frontend_endpoint, feedback)
            assert retry.get("status") != "ok" and retry["error"]["code"] == p.E_OVERLOADED, retry
        ask = raw_request(zmq_context, broker.frontend_endpoint, [b"", p.encode(p.header("ask", "a-1") | {"task_id": task})])
        assert ask["status"] == "wait" and ask["reason"] == "storage", ask

        server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()
        wait_for(lambda: broker.storage_ok, timeout=20, what="the broker to reconnect")
        assert client.feedback(task, 2.0, rid="fb-1")["status"] == "ok"  # applied now, once
        stored = connect(server.url).lrange(f"ppoz:seg:{task}", 0, -1)
        assert [p.decode(x)["reward"] for x in stored] == [2.0]
        assert broker.metrics["broker/orphan_steps"] == 0
    finally:
        broker.stop()
        thread.join(10)
        server.stop()


@pytest.mark.slow
def test_an_idle_broker_notices_redis_gone_by_its_stream_length_read_and_recovers(tmp_path, start_actor, make_client, zmq_context):
    """No request writes while Redis is away: housekeeping's read finds it, the sessions leave memory, and come back."""
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()
    broker, thread = start_broker_thread(server.url, zmq_context)
    try:
        start_actor(broker.backend_endpoint)
        client = make_client(broker.frontend_endpoint)
        wait_for(lambda: actors_ready(client, 1), what="the actor")
        task = client.attach()
        client.step(task, OBS)
        server.stop()
        wait_for(lambda: not broker.storage_ok, what="the idle broker to notice Redis is gone")
        status = client.status()  # answered without Redis
        assert status["storage_ok"] is False and status["sessions"] == 0 and status["counters"]["errors/storage"] == 1
        server = EmbeddedRedis(appendonly=True, data_dir=tmp_path).start()
        wait_for(lambda: broker.storage_ok, timeout=20, what="the broker to reconnect")
        assert client.status()["pending_steps"] == 1, "the session and its pending step come back from Redis"
        assert client.feedback(task, 1.0)["status"] == "ok"
        assert connect(server.url).llen(f"ppoz:seg:{task}") == 1
    finally:
        broker.stop()
        thread.join(10)
        server.stop()


def test_a_redis_that_refuses_writes_but_answers_reads_gets_internal_and_nothing_is_acknowledged(tmp_path, start_actor, make_client,
                                                                                                 zmq_context):  # fmt: skip
    """A full Redis (maxmemory, noeviction): the write fails, memory is reloaded from Redis at once, storage stays up."""
    server = EmbeddedRedis(data_dir=tmp_path).start()
    admin = connect(server.url)
    broker, thread = start_broker_thread(server.url, zmq_context)
    try:
        start_actor(broker.backend_endpoint)
        client = make_client(broker.frontend_endpoint, deadline=1.0)
        wait_for(lambda: actors_ready(client, 1), what="the actor")
        task = client.attach()
        client.step(task, OBS)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        feedback = [b"", p.encode(p.header("feedback", "fb-full") | {"task_id": task, "reward": 1.0})]
        for _ in range(2):  # the write fails each time; the reply never says ok
            reply = raw_request(zmq_context, broker.frontend_endpoint, feedback)
            assert reply["error"]["code"] == p.E_INTERNAL and reply["rid"] == "fb-full", reply
        assert broker.storage_ok and client.status()["pending_steps"] == 1, "reads work: memory is Redis's again, the step pending"
        admin.config_set("maxmemory", "0")
        reply = raw_request(zmq_context, broker.frontend_endpoint, feedback)
        assert reply["status"] == "ok", reply
        assert admin.llen(f"ppoz:seg:{task}") == 1 and broker.metrics["errors/storage"] == 2
    finally:
        broker.stop()
        thread.join(10)
        admin.close()
        server.stop()


def test_a_failed_read_while_a_batch_is_in_flight_leaves_that_batch_to_its_own_answer(redis_url, key_prefix, zmq_context):
    """A read error says nothing sure about the batch Redis is applying: it must not be answered `internal` for it."""
    cfg = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", redis_url=redis_url, key_prefix=key_prefix)
    broker = Broker(cfg, connect(redis_url), zmq_context)
    broker.start()
    client = zmq_context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(broker.frontend_endpoint)
    try:
        client.send_multipart([b"", p.encode(p.header("attach", "a-1"))])
        assert broker.frontend.poll(5000)
        broker.on_client_frames(broker.frontend.recv_multipart())
        broker.commit()
        assert broker.outbox.in_flight
        broker._storage_lost("Redis read failed (stream length): a stand-in")  # what housekeeping calls on a failed read

        def replied() -> dict | None:
            broker.now = time.monotonic()
            broker.commit()
            return p.decode(client.recv_multipart()[-1]) if client.poll(10) else None

        reply = wait_for(replied, what="the attach's own reply")
        assert reply["status"] == "attached" and reply["rid"] == "a-1", reply
        assert broker.storage_ok and broker.metrics["errors/storage"] == 0 and len(broker.sessions) == 1
    finally:
        client.close(linger=0)
        broker.close()
