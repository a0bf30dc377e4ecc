"""What each operation sends (client/operations.py): the same request from both clients, decided without sockets."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from client import AsyncClient, Client, RequestTimeout
from client import operations as ops
from common import protocol as p

ENDPOINT = "tcp://127.0.0.1:1"  # never connected to: the requests are recorded, not sent


def recorded_requests(client: Client | AsyncClient) -> list[tuple[str, Any, Any, dict[str, Any]]]:
    """Make `client.request` record its arguments and answer as the broker would, without a socket."""
    seen: list[tuple[str, Any, Any, dict[str, Any]]] = []

    def answer(op: str, rid: Any = None, deadline: Any = None, **fields: Any) -> dict[str, Any]:
        seen.append((op, rid, deadline, fields))
        return {"status": "ok", "task_id": fields.get("task_id", "new-task")}

    async def answer_later(op: str, rid: Any = None, deadline: Any = None, **fields: Any) -> dict[str, Any]:
        return answer(op, rid, deadline, **fields)

    client.request = answer_later if isinstance(client, AsyncClient) else answer  # type: ignore[method-assign]
    return seen


def every_operation(client: Any) -> list[Any]:
    """Each operation once, with every argument given; the async client's results are coroutines, awaited by the caller."""
    return [
        client.attach(),
        client.attach("t1"),
        client.detach("t1"),
        client.ask("t1"),
        client.wait_turn("t1", deadline=2.0),
        client.step("t1", {"action": ["a", "b"]}, rid="s1"),
        client.rag_step("t1", {"action": ["a"]}, rid="s2"),
        client.generate("t1", "Q: 1 + 1 =", max_new_tokens=4, temperature=0.5, top_p=0.9, top_k=3, stop=["\n"], seed=7, rid="g1"),
        client.generate("t1", messages=[{"role": "user", "content": "hi"}], deadline=3.0),
        client.feedback("t1", 1.0, done=True, truncated=False, rid="f1", next_obs={"x": 1}, sample="s-9"),
        client.feedback("t1", 0.5, next_obs={}),
        client.status(),
        client.ping(),
    ]


def test_both_clients_send_the_same_request_for_each_operation():
    blocking = Client(ENDPOINT, deadline=9.0)
    sent_blocking = recorded_requests(blocking)
    every_operation(blocking)

    async def run_async() -> list[tuple[str, Any, Any, dict[str, Any]]]:
        async with AsyncClient(ENDPOINT, deadline=9.0) as client:
            sent = recorded_requests(client)
            for call in every_operation(client):
                await call
            return sent

    sent_async = asyncio.run(run_async())
    blocking.close()
    assert sent_async == sent_blocking
    assert [op for op, *_ in sent_blocking] == [
        p.OP_ATTACH,
        p.OP_ATTACH,
        p.OP_DETACH,
        p.OP_ASK,
        p.OP_ASK,
        p.OP_STEP,
        p.OP_RAG_STEP,
        p.OP_GENERATE,
        p.OP_GENERATE,
        p.OP_FEEDBACK,
        p.OP_FEEDBACK,
        p.OP_STATUS,
        p.OP_PING,
    ]
    assert sent_blocking[0][3] == {} and sent_blocking[1][3] == {"task_id": "t1"}  # a task id only when resuming one
    # generate sends its deadline, the client's by default, to the broker too
    assert sent_blocking[7][2] == 9.0 and sent_blocking[7][3]["deadline_ms"] == 9000
    assert sent_blocking[8][2] == 3.0 and sent_blocking[8][3]["deadline_ms"] == 3000
    assert "next_obs" not in sent_blocking[10][3]  # an empty observation means none


def test_wait_turn_sleeps_what_the_broker_suggests_and_gives_up_past_its_deadline():
    end = time.monotonic() + 5.0
    assert ops.turn_pause({"status": "ok"}, end) is None
    assert ops.turn_pause({"status": "wait", "retry_after_ms": 250}, end) == 0.25
    assert ops.turn_pause({"status": "wait"}, end) == ops.DEFAULT_TURN_PAUSE_MS / 1000
    with pytest.raises(RequestTimeout, match=r"kept saying wait \(queue_full\) past the deadline"):
        ops.turn_pause({"status": "wait", "retry_after_ms": 6000, "reason": "queue_full"}, end)
