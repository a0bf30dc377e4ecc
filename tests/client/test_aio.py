"""The asyncio client against a real broker and actor: life cycle, concurrency, the retry rule, errors, close."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from client import AsyncClient, BadRequest, FeedbackWithoutStep, RequestTimeout, UnknownTask
from common import protocol as p
from common.segments import Segment
from tests.client.helpers import EchoPolicy, pick
from tests.helpers import IN_PROCESS_S, wait_for
from tests.processes import free_port


def test_full_life_cycle(serving, zmq_context, redis_client, key_prefix):
    broker, _ = serving(segment_len=8)

    async def main() -> None:
        # make_client's timeouts (tests/conftest.py): a broker and actor of this process answer in ms
        async with AsyncClient(broker.frontend, deadline=10, attempt_timeout=5, context=zmq_context) as client:
            assert (await client.ping())["status"] == "ok"
            task = await client.attach()
            assert (await client.ask(task))["status"] == "ok"
            for n in range(3):
                reply = await client.step(task, pick(n))
                assert reply["status"] == "ok" and reply["task_id"] == task and reply["action"] == n
                assert reply["probs"] == pytest.approx([1 / 32] * 32) and reply["policy_version"] == 0
                assert (await client.feedback(task, reward=0.1 * n))["status"] == "ok"
            assert (await client.rag_step(task, pick(5)))["action"] == 5
            assert (await client.feedback(task, 0.5, done=True))["segment_closed"] is True
            assert (await client.status())["sessions"] == 1
            assert (await client.detach(task))["status"] == "detached"
            with pytest.raises(UnknownTask):
                await client.ask(task)
        with pytest.raises(RuntimeError, match="closed"):
            await client.ping()

    asyncio.run(main())
    [segment] = [Segment.from_entry(f) for _, f in redis_client.xrange(f"{key_prefix}:segments")]
    assert segment.reason == "done" and [t.action for t in segment.transitions] == [0, 1, 2, 5]
    assert [t.mode for t in segment.transitions] == ["step"] * 3 + ["rag_step"]


def test_concurrent_coroutines_share_one_client_and_each_gets_its_own_reply(serving, zmq_context, redis_client, key_prefix):
    policy = EchoPolicy(delay=0.2)
    broker, _ = serving(policy=policy, credits=32)

    async def emulator(client: AsyncClient, i: int) -> None:
        task = await client.attach(task_id=f"emu-{i}")
        for n in range(3):
            wanted = (i + 7 * n) % 32
            reply = await client.step(task, pick(wanted), rid=f"emu-{i}-step-{n}")
            assert (reply["rid"], reply["task_id"], reply["action"]) == (f"emu-{i}-step-{n}", task, wanted)
            await client.feedback(task, reward=float(n))

    async def main() -> int:
        # a second attempt fails the test: 60 steps at 0.2 s a batch, all in flight at once, take 0.2-0.6 s each alone; x30
        async with AsyncClient(broker.frontend, deadline=30, attempt_timeout=20, context=zmq_context) as client:
            await asyncio.gather(*(emulator(client, i) for i in range(20)))
            return client.attempts

    attempts = asyncio.run(main())
    assert attempts == 20 * 7, "no request may need a second attempt"
    # The steps were in flight together: the actor got them in batches, not one by one.
    assert max(policy.batches) > 1 and sum(policy.batches) == 60
    for i in range(20):
        stored = [p.decode(x) for x in redis_client.lrange(f"{key_prefix}:seg:emu-{i}", 0, -1)]
        assert [(t["action"], t["reward"]) for t in stored] == [((i + 7 * n) % 32, float(n)) for n in range(3)]


def test_no_broker_gives_request_timeout_within_the_deadline(zmq_context):
    async def main() -> AsyncClient:
        # the deadline and the attempts' timeouts are what is tested; nothing answers
        async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", deadline=1.0, attempt_timeout=0.3, context=zmq_context) as client:
            started = time.monotonic()
            with pytest.raises(RequestTimeout, match="no reply to ping within 1.0 s"):
                await client.ping()
            # given up at the deadline, not before it and not attempts later: the 1.0 s, then the loop's wake-up, which a
            # loaded machine makes late (the bound was 1.5 s: 2.0 s, still short of another whole attempt after the end)
            assert 0.9 < time.monotonic() - started < 2.0
            return client

    client = asyncio.run(main())
    # 0.3 + 0.3 + 0.3 + 0.1 s, a fresh socket each time. How many attempts fit in the second is a count per unit of time:
    # a loaded machine that wakes the loop late by 0.1 s in all leaves no time for the fourth, so 3 passes too
    assert client.attempts in (3, 4), client.attempts


def test_requests_in_flight_survive_a_broker_restart(start_broker, start_actor, zmq_context, redis_client, key_prefix):
    """Steps sent while the broker is down are resent (same rid, fresh socket) and answered by its successor."""
    frontend = f"tcp://127.0.0.1:{free_port()}"
    first = start_broker(frontend=frontend)
    start_actor(first.backend, policy=EchoPolicy())

    async def main() -> None:
        # 0.3 s attempts: the resends while the broker is away are under test. The 30 s deadline covers a broker thread's
        # restart in this process (ms) and an actor registering (0.1-0.3 s): x100
        async with AsyncClient(frontend, deadline=30, attempt_timeout=0.3, context=zmq_context) as client:
            registered_by = time.monotonic() + IN_PROCESS_S
            while not (await client.status())["actors"]:
                assert time.monotonic() < registered_by, "the actor did not register"
                await asyncio.sleep(0.05)
            tasks = [await client.attach(task_id=f"emu-{i}") for i in range(5)]
            for task in tasks:
                await client.step(task, pick(0))
                await client.feedback(task, 1.0)
            await asyncio.to_thread(first.stop)

            before = client.attempts
            steps = [asyncio.ensure_future(client.step(task, pick(i + 1), rid=f"after-{i}")) for i, task in enumerate(tasks)]
            # Each step sent three times at least (two silent 0.3 s attempts, then again): waited for, not counted in a
            # second of sleep, which a loaded machine's late wake-ups would fill with fewer attempts
            resent_by = time.monotonic() + IN_PROCESS_S  # 0.6 s of attempt timers alone; x16
            while client.attempts - before < 5 * 3:
                assert time.monotonic() < resent_by, f"{client.attempts - before} attempts of 5 steps"
                await asyncio.sleep(0.05)
            assert not any(s.done() for s in steps), "nobody is there to answer"
            second = await asyncio.to_thread(start_broker, frontend=frontend)
            start_actor(second.backend, policy=EchoPolicy())
            replies = await asyncio.gather(*steps)
            assert [(r["rid"], r["action"]) for r in replies] == [(f"after-{i}", i + 1) for i in range(5)]
            assert client.attempts - before >= 5 * 3  # each step was sent again after each silent attempt
            for task in tasks:  # the sessions came back from Redis: the pending steps take their rewards
                assert (await client.feedback(task, 2.0))["status"] == "ok"
            assert (await client.status())["counters"]["broker/steps"] == 5, "each resent step is scored once"

    asyncio.run(main())
    for i in range(5):
        stored = [p.decode(x) for x in redis_client.lrange(f"{key_prefix}:seg:emu-{i}", 0, -1)]
        assert [(t["action"], t["reward"]) for t in stored] == [(0, 1.0), (i + 1, 2.0)]


def test_overloaded_replies_are_retried_after_retry_after_ms(start_broker, start_actor, make_client, zmq_context):
    # The step is answered once the waits below end and an actor thread registers: 1-1.5 s alone. Its timeout (and the
    # client's deadline) were 10 s (x7): 30 s
    broker = start_broker(max_queue=1, retry_after_ms=200, request_timeout_ms=30_000)
    probe = make_client(broker.frontend)
    a, b, c = probe.attach(), probe.attach(), probe.attach()
    # Two clients' steps fill the queue while no actor is there: a third client is refused only once the queue
    # holds twice max_queue (under that, a client below its share is still queued: broker/scheduling.py).
    blockers = [zmq_context.socket(zmq.DEALER) for _ in range(2)]
    for blocker, task in zip(blockers, (a, c)):
        blocker.setsockopt(zmq.LINGER, 0)
        blocker.connect(broker.frontend)
        blocker.send_multipart([b"", p.encode(p.header("step", "blocker") | {"task_id": task, "obs": pick(0)})])
    wait_for(lambda: probe.status()["queued_jobs"] == 2, what="two steps to fill the queue")

    async def main() -> tuple[dict, int, float]:
        async with AsyncClient(broker.frontend, deadline=30, attempt_timeout=5, context=zmq_context) as client:
            started = time.monotonic()
            step = asyncio.ensure_future(client.step(b, pick(3)))
            # Refused and retried three times at least: waited for, not counted in a second of sleep (5 attempts alone,
            # fewer where a loaded machine wakes the loop late)
            retried_by = time.monotonic() + IN_PROCESS_S  # 0.6 s of retry_after_ms alone; x16
            while client.attempts < 4:
                assert time.monotonic() < retried_by, f"{client.attempts} attempts"
                await asyncio.sleep(0.05)
            assert not step.done()
            await asyncio.to_thread(start_actor, broker.backend, policy=EchoPolicy())
            reply = await step
            return reply, client.attempts, time.monotonic() - started

    try:
        reply, attempts, elapsed = asyncio.run(main())
    finally:
        for blocker in blockers:
            blocker.close(linger=0)
    assert reply["action"] == 3
    assert probe.status()["counters"]["errors/overloaded"] == attempts - 1 >= 3
    # at most one attempt per retry_after_ms: load can only make fewer
    assert attempts <= elapsed / 0.2 + 2, "the client must wait retry_after_ms between attempts"


def test_error_codes_raise_their_exceptions_without_retry(serving, zmq_context):
    broker, _ = serving()

    async def main() -> int:
        async with AsyncClient(broker.frontend, deadline=5, attempt_timeout=2, context=zmq_context) as client:  # replies in ms; x1000
            with pytest.raises(UnknownTask, match="unknown_task"):
                await client.step("nobody", pick(0))
            task = await client.attach()
            with pytest.raises(FeedbackWithoutStep):
                await client.feedback(task, 1.0)
            with pytest.raises(BadRequest, match="`obs.action` is empty"):
                await client.step(task, {"prompt": "p", "action": []})
            return client.attempts

    assert asyncio.run(main()) == 4


def test_close_fails_requests_in_flight(start_broker, zmq_context):
    broker = start_broker()  # no actor: a step waits

    async def main() -> None:
        client = AsyncClient(broker.frontend, deadline=10, attempt_timeout=5, context=zmq_context)  # outlasts the 0.2 s below
        task = await client.attach()
        step = asyncio.ensure_future(client.step(task, pick(0)))
        await asyncio.sleep(0.2)  # not a deadline: the step sends and waits at the loop's first turn
        await client.close()
        with pytest.raises(RuntimeError, match="closed while the request waited"):
            await step
        await client.close()  # idempotent

    asyncio.run(main())


def test_a_cancelled_request_leaves_the_client_usable(serving, zmq_context):
    broker, _ = serving(policy=EchoPolicy(delay=1.0))

    async def main() -> None:
        # the answer comes after the policy's 1 s sleep, a timer load does not stretch, and ms of work: x5 an attempt
        async with AsyncClient(broker.frontend, deadline=10, attempt_timeout=5, context=zmq_context) as client:
            task = await client.attach()
            with pytest.raises(asyncio.TimeoutError):  # the cancellation under test, at 0.2 s, before the 1 s answer
                await asyncio.wait_for(client.step(task, pick(1), rid="slow"), 0.2)
            assert not client._waiters, "a cancelled request must not leave its waiter behind"
            assert (await client.step(task, pick(1), rid="slow"))["action"] == 1  # the same rid: joins the first

    asyncio.run(main())


@pytest.mark.parametrize("deadline, attempt_timeout", [(0, 1), (5, -1)])
def test_bad_timeouts_are_refused(deadline, attempt_timeout):
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        AsyncClient("tcp://127.0.0.1:5555", deadline=deadline, attempt_timeout=attempt_timeout)


def test_generate_and_wait_turn(start_broker, start_actor, zmq_context, tiny_models, redis_client, key_prefix):
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from models.policy_model import ModelSpec, load_policy

    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    broker = start_broker(segment_len=1)
    start_actor(broker.backend, policy=LLMPolicy(model, tokenizer, SamplingConfig()))

    async def main() -> list[dict]:
        # a few tokens of the tiny model on an actor thread of this process: 0.05-0.5 s alone; x60 an attempt
        async with AsyncClient(broker.frontend, deadline=60, attempt_timeout=30, context=zmq_context) as client:
            tasks = [await client.attach() for _ in range(3)]
            for task in tasks:
                await client.wait_turn(task)

            async def one(i: int, task: str) -> dict:
                reply = await client.generate(task, f"prompt {i}", max_new_tokens=3 + i, seed=i)
                await client.feedback(task, float(i), done=True)
                return reply

            replies = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))  # in flight together, in one batch
            with pytest.raises(ValueError, match="exactly one of"):
                await client.generate(tasks[0], max_new_tokens=3)
            return replies

    replies = asyncio.run(main())
    assert [r["n_tokens"] for r in replies] == [3, 4, 5]
    stored = wait_for(lambda: len(redis_client.xrange(f"{key_prefix}:segments")) == 3 and redis_client.xrange(f"{key_prefix}:segments"))
    assert sorted(Segment.from_entry(f).transitions[0].reward for _, f in stored) == [0.0, 1.0, 2.0]
