"""A feedback's `sample`: the broker marks it stored (P:samples) in the same atomic write as its transition, and
stores a sample id once, so a driver that resumes after a kill can neither lose nor repeat a sample (issue 28)."""

from __future__ import annotations

import pytest

from client import BadRequest
from common.segments import RedisKeys
from tests.broker.test_broker import obs, running, segments


def stored(redis_client, key_prefix):
    return [(t.sample, t.reward) for s in segments(redis_client, key_prefix) for t in s.transitions]


def test_a_sample_is_marked_with_its_transition_and_stored_once(start_broker, start_actor, make_client, redis_client, key_prefix):
    _, client = running(start_broker, start_actor, make_client)
    marks = RedisKeys(key_prefix).samples
    task = client.attach()
    client.step(task, obs(0))
    assert client.feedback(task, 0.5, done=True, sample="run1:0")["segment_closed"] is True
    assert stored(redis_client, key_prefix) == [("run1:0", 0.5)]
    assert redis_client.hgetall(marks) == {b"run1:0": b"0.5"}
    # The same sample fed back again (a killed driver's last feedback arriving after its successor played it):
    # acknowledged, and nothing stored a second time; the mark keeps the reward stored.
    client.step(task, obs(1))
    assert client.feedback(task, 0.75, done=True, sample="run1:0")["status"] == "ok"
    assert client.status()["pending_steps"] == 0
    client.step(task, obs(2))
    client.feedback(task, 1.0, done=True, sample="run1:1")
    client.step(task, obs(3))
    client.feedback(task, 2.0, done=True)  # no sample: stored as ever, unmarked
    assert stored(redis_client, key_prefix) == [("run1:0", 0.5), ("run1:1", 1.0), (None, 2.0)]
    assert redis_client.hgetall(marks) == {b"run1:0": b"0.5", b"run1:1": b"1.0"}
    # a segment of several turns: the repeated sample alone is left out of it
    other = client.attach()
    client.step(other, obs(4))
    client.feedback(other, 3.0, sample="run1:1")
    client.step(other, obs(5))
    client.feedback(other, 4.0, done=True, sample="run1:2")
    assert stored(redis_client, key_prefix)[3:] == [("run1:2", 4.0)]
    # Counted, for the ledger: 6 feedbacks acknowledged = 4 stored + 2 duplicates
    assert int(redis_client.get(RedisKeys(key_prefix).duplicate_samples)) == 2


@pytest.mark.parametrize(
    "bad, words",
    [
        (17, "`sample` must be a str"),
        (b"run:1", "`sample` must be a str"),
        ("", "`sample` must be 1 to 128"),
        ("x" * 129, "`sample` must be 1 to 128"),
        ("run 1", "`sample` must be 1 to 128"),
        ("run*", "`sample` must be 1 to 128"),  # no glob characters: a resumed driver scans marks by pattern
    ],
)
def test_a_bad_sample_id_is_refused_and_the_step_still_waits(bad, words, start_broker, start_actor, make_client, redis_client, key_prefix):
    _, client = running(start_broker, start_actor, make_client)
    task = client.attach()
    client.step(task, obs(0))
    with pytest.raises(BadRequest, match=words.replace("*", r"\*")):
        client.request("feedback", task_id=task, reward=1.0, done=True, sample=bad)
    assert client.status()["pending_steps"] == 1 and stored(redis_client, key_prefix) == []
    client.feedback(task, 1.0, done=True, sample="run:1")
    assert stored(redis_client, key_prefix) == [("run:1", 1.0)]
