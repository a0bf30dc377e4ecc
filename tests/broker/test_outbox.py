"""The broker's storage path on its own (broker/outbox.py): a real Redis and a real ROUTER/DEALER pair."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

import pytest
import zmq

from broker.outbox import Outbox, StorageFailure
from common import protocol as p
from tests.helpers import wait_for


class Wire:
    """A ROUTER the outbox sends by, and a DEALER client connected to it."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind("tcp://127.0.0.1:*")
        self.client = ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.client.send_multipart([b"", b"hello"])
        assert self.router.poll(5000), "the DEALER did not connect"  # a loopback connect and one frame: ms alone; x1000
        self.envelope = (self.router.recv_multipart()[0], b"")

    def replies(self, timeout_s: float = 0.2) -> list[dict]:
        """What has arrived: replies sent before the call are on loopback in ms (x100); the tests also use it to see that
        nothing came, where load can only make them pass wrongly."""
        got = []
        while self.client.poll(timeout_s * 1000):
            got.append(p.decode(self.client.recv_multipart()[-1]))
        return got

    def close(self) -> None:
        self.client.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def wire(zmq_context) -> Iterator[Wire]:
    w = Wire(zmq_context)
    yield w
    w.close()


@pytest.fixture
def outbox(redis_client, wire) -> Iterator[Outbox]:
    box = Outbox(redis_client, storage_timeout_s=2.0, metrics=collections.Counter())  # a script on loopback Redis: ms; x1000
    box.sock = wire.router
    yield box
    box.committer.reset()


def body(op: str, rid: str) -> dict:
    return p.header(op, rid) | {"status": "ok", "task_id": "t"}


def commit_until_sent(box: Outbox) -> None:
    def done() -> bool:
        box.commit(time.monotonic())
        return not box.pending

    wait_for(done, timeout=5, what="Redis to apply the batch")  # one script on loopback Redis: ms alone; x1000


def test_a_durable_reply_leaves_only_once_its_writes_are_in_redis(outbox, wire, redis_client, key_prefix):
    outbox.batch.add("SET", f"{key_prefix}:k", "v")
    outbox.reply(wire.envelope, body("feedback", "f-1"), durable=True, since=time.monotonic())
    outbox.reply(wire.envelope, body("ping", "p-1"))  # not durable: at once, ahead of the durable one
    assert [r["rid"] for r in wire.replies()] == ["p-1"]
    commit_until_sent(outbox)
    assert redis_client.get(f"{key_prefix}:k") == b"v"
    assert [r["rid"] for r in wire.replies()] == ["f-1"]
    assert outbox.metrics["broker/commits"] == 1 and outbox.added_latency.summary()["n"] == 1


def test_a_failed_write_raises_and_fail_answers_every_unacknowledged_reply_with_internal(outbox, wire, redis_client, key_prefix):
    redis_client.rpush(f"{key_prefix}:list", "x")
    outbox.batch.add("INCR", f"{key_prefix}:list")  # WRONGTYPE inside the script: Redis refuses the batch
    outbox.reply(wire.envelope, body("feedback", "f-1"), durable=True)
    outbox.commit(time.monotonic())  # sent, in flight
    outbox.batch.add("SET", f"{key_prefix}:later", "v")
    outbox.reply(wire.envelope, body("step", "s-2"), durable=True)  # staged behind it

    def failure() -> StorageFailure | None:
        try:
            outbox.commit(time.monotonic())
        except StorageFailure as e:
            return e
        return None

    error = wait_for(failure, timeout=5, what="the failed write to be reported")  # Redis's refusal on loopback: ms alone; x1000
    assert "WRONGTYPE" in str(error) or "wrong kind" in str(error)
    assert wire.replies() == [], "nothing leaves before the broker decides (fail)"
    assert outbox.fail() == 2
    replies = wire.replies()
    assert [(r["rid"], r["op"], r["error"]["code"]) for r in replies] == [("f-1", "feedback", p.E_INTERNAL), ("s-2", "step", p.E_INTERNAL)]
    assert all("task_id" not in r for r in replies)
    assert not outbox.pending and not redis_client.exists(f"{key_prefix}:later"), "the staged writes are dropped unsent"
    assert outbox.metrics["errors/internal"] == 2


def test_replays_with_nothing_to_write_keep_their_order_behind_the_batch_in_flight(outbox, wire, key_prefix):
    outbox.batch.add("SET", f"{key_prefix}:k", "v")
    outbox.reply(wire.envelope, body("feedback", "f-1"), durable=True)
    outbox.commit(time.monotonic())
    outbox.reply(wire.envelope, body("feedback", "f-1-again"), durable=True)  # a replay: no write of its own
    commit_until_sent(outbox)
    assert [r["rid"] for r in wire.replies()] == ["f-1", "f-1-again"]
