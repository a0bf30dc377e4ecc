"""A reply with `rid: nil` (docs/protocol.md, section 4): the Python clients take it as final, and never cause one."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from client import AsyncClient, BadRequest, Client, TooLarge
from client.retry import RetryRule, answers, build_request
from common import protocol as p
from tests.helpers import OBS


class ScriptedBroker:
    """A ROUTER on loopback, in a thread, that sends the requesting peer the replies `answer(request body)` lists."""

    def __init__(self, ctx: zmq.Context, answer: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.answer = answer
        self.received: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):  # a tick: how often `stop` is looked at
                continue
            frames = self.sock.recv_multipart()
            body = p.decode(frames[-1])
            self.received.append(body)
            for reply in self.answer(body):
                self.sock.send_multipart([*frames[:-1], p.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)  # within one 20 ms tick; x250 (a daemon thread)
        self.sock.close(linger=0)


@pytest.fixture
def scripted(zmq_context) -> Iterator[Callable[..., ScriptedBroker]]:
    made: list[ScriptedBroker] = []

    def make(answer: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> ScriptedBroker:
        made.append(ScriptedBroker(zmq_context, answer))
        return made[-1]

    yield make
    for broker in made:
        broker.close()


def unreadable(body: dict[str, Any]) -> list[dict[str, Any]]:
    """What the broker answers a request whose rid it could not read."""
    return [p.error_body(None, body.get("op"), p.E_BAD_REQUEST, "`rid` must be a non-empty str or bin, got nil")]


# --- without sockets -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rid, words",
    [
        ("x" * 65, r"longer than 64 bytes \(65\)"),
        ("é" * 33, r"longer than 64 bytes \(66\)"),
        (b"", "got an empty bin"),
        (7, "got int"),
        ("\ud800", "not valid UTF-8"),
    ],
)
def test_a_rid_the_broker_could_not_read_is_refused_before_sending_naming_it(rid, words):
    with pytest.raises(ValueError, match=words):
        build_request("ping", rid)
    assert build_request("ping", "é" * 32)["rid"] == "é" * 32 and build_request("ping", b"\x00" * 64)["rid"] == b"\x00" * 64


def test_a_nil_rid_error_answers_the_only_request_in_flight_and_is_final_whatever_its_code():
    rule = RetryRule("step", "s-1", {}, deadline=5, attempt_timeout=1)
    nil = p.error_body(None, None, p.E_INTERNAL, "no rid")
    assert answers(nil, "s-1", alone=True) and not answers(nil, "s-1", alone=False)
    assert not answers({"rid": None, "status": "ok"}, "s-1", alone=True), "only an error can come with rid nil"
    assert not answers({"rid": b"s-1", "status": "ok"}, "s-1", alone=True), "str and bin rids are distinct"
    with pytest.raises(Exception, match="internal: no rid"):  # `internal` is retried, but not with rid nil
        rule.wait_before_retry(nil)


# --- the blocking client -------------------------------------------------------------------------
def test_the_blocking_client_raises_a_nil_rid_reply_at_once_and_does_not_resend(scripted, zmq_context):
    broker = scripted(unreadable)
    client = Client(broker.endpoint, deadline=10, attempt_timeout=5, context=zmq_context)  # make_client's (tests/conftest.py)
    try:
        started = time.monotonic()
        with pytest.raises(BadRequest, match="`rid` must be"):
            client.ping()
        # at once (ms alone), not after its 5 s attempt: the bound was 2 s; 4 s tells the two apart as well
        assert time.monotonic() - started < 4, "the client must not wait for its deadline"
        time.sleep(0.2)  # a look for a resend that must not come, not a deadline
        assert client.attempts == 1 and len(broker.received) == 1, "a request the broker cannot read must not be resent"
    finally:
        client.close()


def test_a_message_over_the_brokers_limit_raises_too_large_at_once(start_broker, make_client):
    """The real broker reads the rid of a body over max_message_bytes, so the client stops waiting."""
    broker = start_broker(max_message_bytes=2048)
    client = make_client(broker.frontend, deadline=10, attempt_timeout=5)
    task = client.attach()
    started = time.monotonic()
    with pytest.raises(TooLarge, match="the limit is 2048") as info:
        client.step(task, {**OBS, "prompt": "p" * 5000}, rid="big-step")
    # at once, not after the 5 s attempt (the bound was 2 s: 4 s, as above); attach, then the step once
    assert time.monotonic() - started < 4 and client.attempts == 2
    assert info.value.reply["rid"] == "big-step"


# --- the asyncio client ----------------------------------------------------------------------------
def test_the_async_client_gives_a_nil_rid_reply_to_its_only_request_in_flight(scripted, zmq_context):
    broker = scripted(unreadable)

    async def main() -> int:
        async with AsyncClient(broker.endpoint, deadline=10, attempt_timeout=5, context=zmq_context) as client:
            started = time.monotonic()
            with pytest.raises(BadRequest):
                await client.ping()
            assert time.monotonic() - started < 4  # at once, not after the 5 s attempt (was 2 s, as above)
            return client.attempts

    assert asyncio.run(main()) == 1


def test_with_several_in_flight_a_nil_rid_reply_is_logged_and_each_request_gets_its_own(scripted, zmq_context, caplog):
    held: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> list[dict[str, Any]]:
        held.append(body)
        if len(held) < 2:
            return []  # wait until both are in flight, then: a nil-rid reply, and each one's own
        return [p.error_body(None, None, p.E_BAD_REQUEST, "unreadable"), *(p.header("ping", b["rid"]) | {"status": "ok"} for b in held)]

    broker = scripted(answer)

    async def main() -> tuple[list[dict[str, Any]], int]:
        async with AsyncClient(broker.endpoint, deadline=10, attempt_timeout=5, context=zmq_context) as client:  # replies in ms
            replies = await asyncio.gather(*(client.request("ping", rid=f"ping-{i}") for i in range(2)))
            return replies, client.attempts

    with caplog.at_level(logging.WARNING, logger="client.aio"):
        replies, attempts = asyncio.run(main())
    assert [(r["rid"], r["status"]) for r in replies] == [("ping-0", "ok"), ("ping-1", "ok")] and attempts == 2
    assert "rid nil" in caplog.text and "matches none of 2 requests in flight" in caplog.text
