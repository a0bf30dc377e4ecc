"""Clients held to the learner's pace, through real sockets and a real Redis: back-pressure that reaches clients that
never ask (a step over the stream backlog waits in the broker's queue for the learner, within its deadline:
broker/backpressure.py), and segments closed by age, so that a slow client's transitions reach the learner fresh."""

from __future__ import annotations

import threading
import time

import pytest

from actor_node.link import BrokerLink
from actor_node.policies import UniformPolicy
from actor_node.worker import serve
from broker.config import BrokerConfig
from common import protocol as p
from common.segments import RedisKeys
from tests.broker.test_broker import obs, over_the_backlog, running
from tests.helpers import actors_ready, wait_for


def _step_in_background(client, task, n):
    replies: list[tuple[dict, float]] = []
    thread = threading.Thread(target=lambda: replies.append((client.step(task, obs(n)), time.monotonic())), daemon=True)
    thread.start()
    return thread, replies


def test_a_step_over_the_backlog_waits_for_the_learner_and_goes_on_as_soon_as_it_reads(
    start_broker, start_actor, make_client, redis_client, key_prefix
):
    """A client that never asks is held back all the same: its step is not scored while the stream holds more than
    the learner can train fresh, and is answered within moments of the learner's read (XDEL after an update)."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2)
    task = client.attach()
    stepper = make_client(broker.frontend)
    stream = RedisKeys(key_prefix).stream
    for round_ in range(3):  # three times: the broker's once-a-second read of the stream cannot pass them all by chance
        over_the_backlog(client, task)
        before = client.status()["counters"]
        held_before = before["broker/steps_held"]
        thread, replies = _step_in_background(stepper, task, 100 + round_)
        wait_for(lambda n=held_before: client.status()["counters"]["broker/steps_held"] > n, what="the step held")
        time.sleep(0.6)  # a look for an answer that must not come, not a deadline
        assert not replies, f"scored while the backlog was over its limit: {replies}"
        assert client.status()["counters"]["broker/steps"] == before["broker/steps"]  # not scored meanwhile
        redis_client.xdel(stream, *[entry_id for entry_id, _ in redis_client.xrange(stream)])  # the learner read them
        read_at = time.monotonic()
        thread.join(5)  # answered within 10-100 ms alone (re-read every 0.01 s while steps are held, a uniform actor); x50
        assert replies and replies[0][0]["status"] == "ok", replies
        # A timing claim, kept: the step goes on at the learner's read (ms alone), not at the once-a-second refresh;
        # 0.5 s leaves x5 over the slowest alone and the chance that the refresh passes all three rounds at 12%.
        assert replies[0][1] - read_at < 0.5, f"answered {replies[0][1] - read_at:.2f} s after the learner read"
        client.feedback(task, reward=0.0, done=False)
    counters = client.status()["counters"]
    assert counters["broker/steps_held"] == 3 and counters["broker/steps_held_out"] == 0, counters


def test_a_held_step_is_scored_anyway_once_it_has_waited_its_share_of_its_deadline(start_broker, start_actor, make_client):
    """The learner never reads: the step still gets its answer within its deadline, after step_hold_share of it, and
    is counted as held out."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, step_hold_share=0.5)
    task = client.attach()
    over_the_backlog(client, task)
    started = time.monotonic()
    reply = client.request(p.OP_STEP, task_id=task, obs=obs(9), deadline_ms=2000)
    waited = time.monotonic() - started
    assert reply["status"] == "ok", reply
    assert waited >= 0.95, f"answered after {waited:.2f} s: not held for half of its 2 s deadline"  # load only makes it later
    counters = client.status()["counters"]
    assert counters["broker/steps_held"] == 1 and counters["broker/steps_held_out"] == 1, counters


def test_with_step_hold_share_0_a_step_over_the_backlog_is_scored_at_once(start_broker, start_actor, make_client):
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, step_hold_share=0.0)
    task = client.attach()
    over_the_backlog(client, task)
    started = time.monotonic()
    assert client.step(task, obs(9))["status"] == "ok"
    assert time.monotonic() - started < 2.5  # ms alone; not held, whose shortest hold would be 0.25 x 10 s
    assert client.status()["counters"]["broker/steps_held"] == 0


def test_the_held_steps_of_three_clients_all_go_on_at_the_learner_s_read(start_broker, start_actor, make_client, redis_client, key_prefix):
    """Each of three clients' held steps goes on at the learner's read: none is starved behind another's."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2)
    tasks = [client.attach() for _ in range(3)]
    over_the_backlog(client, tasks[0])
    steppers = [make_client(broker.frontend) for _ in tasks]
    started = [_step_in_background(c, t, 50 + i) for i, (c, t) in enumerate(zip(steppers, tasks, strict=True))]
    wait_for(lambda: client.status()["counters"]["broker/steps_held"] == 3, what="three steps held")
    assert not any(replies for _, replies in started)
    stream = RedisKeys(key_prefix).stream
    redis_client.xdel(stream, *[entry_id for entry_id, _ in redis_client.xrange(stream)])
    for thread, replies in started:
        thread.join(5)
        assert replies and replies[0][0]["status"] == "ok", replies


def test_status_shows_the_version_a_busy_actor_serves_from_its_results(start_broker, make_client, zmq_context):
    """An actor that is never idle sends no heartbeat (actor_node/link.py): the version `ppoz status` lists comes from
    its results too (issue 55: `policy v0, lag 108` for an actor serving version 108)."""
    broker = start_broker()
    # heartbeats a minute apart: within this test the actor's version reaches the broker only with its results
    link = BrokerLink(broker.backend, name="busy", credits=4, heartbeat_ms=60_000, context=zmq_context).start()
    policy = UniformPolicy(0)
    policy.policy_version = 7
    stop = threading.Event()
    thread = threading.Thread(target=lambda: serve(link, policy, stop), daemon=True)
    thread.start()
    try:
        client = make_client(broker.frontend)
        wait_for(lambda: actors_ready(client, 1), what="the actor to register")
        assert client.status()["actors"][0]["policy_version"] == -1  # it registered before it knew its policy
        task = client.attach()
        assert client.step(task, obs(0))["policy_version"] == 7
        assert client.status()["actors"][0]["policy_version"] == 7
    finally:
        stop.set()
        thread.join(5)
        link.close()


def test_step_hold_share_out_of_its_bounds_is_refused_by_name():
    for share in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="step_hold_share"):
            BrokerConfig(step_hold_share=share)


def test_a_restarted_broker_knows_the_version_an_open_segment_started_at(start_broker, make_client, zmq_context, key_prefix, redis_url):
    """The age rule survives a restart: the open segment's first transition is read back from Redis."""
    broker = start_broker(segment_len=32)
    link = BrokerLink(broker.backend, name="v5", credits=4, heartbeat_ms=100, context=zmq_context).start()
    policy = UniformPolicy(0)
    policy.policy_version = 5
    stop = threading.Event()
    thread = threading.Thread(target=lambda: serve(link, policy, stop), daemon=True)
    thread.start()
    try:
        client = make_client(broker.frontend)
        wait_for(lambda: actors_ready(client, 1), what="the actor to register")
        task = client.attach()
        for n in range(2):
            client.step(task, obs(n))
            client.feedback(task, reward=1.0, done=False)
        assert broker.broker.sessions[task].open_version == 5
    finally:
        stop.set()
        thread.join(5)
        link.close()
    broker.stop()
    again = start_broker(segment_len=32)
    session = again.broker.sessions[task]
    assert (session.open_len, session.open_version) == (2, 5)
