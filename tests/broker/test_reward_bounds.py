"""A reward the learner could not survive never enters: the broker refuses a non-finite or absurd reward with
`bad_request`, records nothing, and the step keeps waiting for a corrected feedback (issue 28)."""

from __future__ import annotations

import math

import msgpack
import pytest

from client import BadRequest
from common.protocol import DEFAULT_MAX_ABS_REWARD
from common.segments import Segment
from tests.broker.test_broker import obs, running


def segments(redis_client, prefix):
    return [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{prefix}:segments")]


def open_transitions(redis_client, prefix, task):
    return [msgpack.unpackb(raw) for raw in redis_client.lrange(f"{prefix}:seg:{task}", 0, -1)]


@pytest.fixture
def stack_with_segments(start_broker, start_actor, make_client, redis_client, key_prefix):
    broker, client = running(start_broker, start_actor, make_client)
    return client, redis_client, key_prefix


@pytest.mark.parametrize(
    "bad, words",
    [
        (1e300, ["1e+300", "[-1000000.0, 1000000.0]"]),
        (-1e300, ["-1e+300", "[-1000000.0, 1000000.0]"]),
        (DEFAULT_MAX_ABS_REWARD + 1, ["1000001.0 is outside", "[-1000000.0, 1000000.0]"]),  # not 1e+06 (as %g printed it)
        (math.inf, ["inf", "not a finite number"]),
        (-math.inf, ["-inf", "not a finite number"]),
        (math.nan, ["nan", "not a finite number"]),
    ],
)
def test_a_bad_reward_is_refused_records_nothing_and_the_step_still_waits(
    bad, words, start_broker, start_actor, make_client, redis_client, key_prefix
):
    broker, client = running(start_broker, start_actor, make_client, segment_len=4)
    task = client.attach()
    client.step(task, obs(0))
    with pytest.raises(BadRequest) as refused:
        client.feedback(task, bad, done=True)  # msgpack carries nan and inf as floats; the broker reads them as sent
    message = str(refused.value)
    assert "`reward`" in message and all(w in message for w in words), message
    assert "nothing was recorded" in message
    status = client.status()
    assert status["pending_steps"] == 1  # the step still waits for its reward
    assert status["counters"]["broker/feedbacks"] == 0 and status["counters"]["errors/bad_request"] == 1
    assert open_transitions(redis_client, key_prefix, task) == [] and segments(redis_client, key_prefix) == []
    # The emulator corrects itself: the same step takes the next feedback, stored with the corrected reward.
    assert client.feedback(task, 0.25, done=True)["segment_closed"] is True
    [segment] = segments(redis_client, key_prefix)
    assert [t.reward for t in segment.transitions] == [0.25] and segment.done
    assert client.status()["counters"]["broker/feedbacks"] == 1


def test_the_bound_itself_is_accepted(stack_with_segments):
    client, redis_client, key_prefix = stack_with_segments
    for n, edge in enumerate((DEFAULT_MAX_ABS_REWARD, -DEFAULT_MAX_ABS_REWARD)):
        task = client.attach()
        client.step(task, obs(n))
        assert client.feedback(task, edge, done=True)["status"] == "ok"
    assert sorted(t.reward for s in segments(redis_client, key_prefix) for t in s.transitions) == [-1e6, 1e6]


def test_a_broker_configured_with_a_smaller_bound_refuses_past_it(start_broker, start_actor, make_client, redis_client, key_prefix):
    broker, client = running(start_broker, start_actor, make_client, max_abs_reward=10)
    assert client.status()["limits"]["max_abs_reward"] == 10
    task = client.attach()
    client.step(task, obs(0))
    with pytest.raises(BadRequest, match=r"`reward` 11.0 is outside the accepted range \[-10, 10\] \(max_abs_reward\)"):
        client.feedback(task, 11, done=True)
    with pytest.raises(BadRequest, match=r"`reward` -10.5 is outside the accepted range \[-10, 10\]"):
        client.feedback(task, -10.5, done=True)
    assert open_transitions(redis_client, key_prefix, task) == [] and client.status()["pending_steps"] == 1
    assert client.feedback(task, -10, done=True)["status"] == "ok"
    [segment] = segments(redis_client, key_prefix)
    assert [t.reward for t in segment.transitions] == [-10.0]


def test_an_integral_reward_past_the_bound_is_refused_too(stack_with_segments):
    client, redis_client, key_prefix = stack_with_segments
    task = client.attach()
    client.step(task, obs(0))
    with pytest.raises(BadRequest, match=r"`reward` 1e\+18 is outside"):
        client.request("feedback", task_id=task, reward=10**18, done=True)  # a msgpack int, not a float
    assert client.status()["pending_steps"] == 1 and segments(redis_client, key_prefix) == []
