"""The stream backlog counted in transitions (broker/backlog.py): hand-computed tallies, and a real broker that holds
clients back by the transitions its segments of different lengths hold, not by their number."""

from __future__ import annotations

import pytest

from broker.backlog import StreamTally
from common.segments import RedisKeys
from tests.broker.test_broker import obs, running
from tests.helpers import wait_for


def test_the_newest_segments_are_counted_at_their_own_lengths_older_ones_at_the_mean():
    tally = StreamTally(segment_len=32)
    assert tally.transitions(3) == 3 * 32  # none closed yet: each entry counted as full
    for length in (4, 2, 1):
        tally.add(length)
    assert tally.transitions(0) == 0
    assert tally.transitions(1) == 1  # the newest segment
    assert tally.transitions(2) == 3  # 2 + 1
    assert tally.transitions(3) == 7
    assert tally.transitions(5) == 7 + 5  # two written before this broker: at the mean of 7 / 3, rounded up (4.67 -> 5)


def test_only_the_last_keep_segments_are_remembered():
    tally = StreamTally(segment_len=32, keep=3)
    for length in (30, 30, 30, 1, 2, 3):  # the 30s fall out of the window
        tally.add(length)
    assert tally.transitions(3) == 6
    assert tally.transitions(4) == 6 + 2  # one older: at the mean of the three known (2)


@pytest.mark.parametrize("segments_over", [False, True])
def test_clients_wait_when_the_stream_holds_more_transitions_than_the_limit_however_few_segments(
    start_broker, start_actor, make_client, segments_over
):
    """A limit of 6 transitions: one segment of 4 (closed by length) and one of 2 (an episode's end) are at it, and
    the clients may step; one more step of 1 goes over it with 3 segments, far under 6 of them."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=4, max_stream_backlog=6)
    long, short = client.attach(), client.attach()
    for n in range(4):
        client.step(long, obs(n))
        client.feedback(long, reward=0.0, done=False)
    client.step(long, obs(4))  # a segment of 4 closes (with this step's observation to bootstrap from)
    for n in range(2):
        client.step(short, obs(10 + n))
        client.feedback(short, reward=0.0, done=n == 1)  # an episode of 2: a segment of 2
    status = client.status()
    assert (status["stream_length"], status["stream_transitions"]) == (2, 6)
    assert client.ask(short)["status"] == "ok"  # at the limit, not over it
    if segments_over:
        client.step(short, obs(20))
        client.feedback(short, reward=1.0, done=True)  # one more: 7 transitions in 3 segments
        status = client.status()
        assert (status["stream_length"], status["stream_transitions"]) == (3, 7)
        client.feedback(long, reward=0.0, done=False)
        reply = client.ask(long)
        assert reply["status"] == "wait" and reply["reason"] == "stream_backlog", reply


def test_a_broker_started_on_a_stream_reads_its_segments_lengths(start_broker, start_actor, make_client):
    """Segments of 4 and 2 transitions left by a broker that stopped: the next one counts 6, not 2 x segment_len."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=4)
    long, short = client.attach(), client.attach()
    for n in range(4):
        client.step(long, obs(n))
        client.feedback(long, reward=0.0, done=False)
    client.step(long, obs(4))  # closes the segment of 4
    for n in range(2):
        client.step(short, obs(10 + n))
        client.feedback(short, reward=0.0, done=n == 1)
    broker.stop()
    _, again = running(start_broker, start_actor, make_client, segment_len=4)
    status = again.status()
    assert (status["stream_length"], status["stream_transitions"]) == (2, 6)


def test_what_a_learner_has_read_is_no_backlog(start_broker, start_actor, make_client, redis_client, key_prefix):
    """Entries a learner has read stay in the stream until a checkpoint holds them (learner_node/checkpointer.py);
    nothing waits behind them. With a limit of one rollout (2 transitions, as the arithmetic demo's fixed 32), three
    segments are over it; once a learner reads two of them, the one left is under it and asks go on, though the
    stream still holds all three (the broker counted them before: the learner then waited for the clients it held)."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, ask_hold_ms=0)
    task = client.attach()
    for n in range(4):  # one-step segments, each closed by the next step: three in the stream
        client.step(task, obs(n))
        client.feedback(task, reward=0.0, done=False)
    status = client.status()
    assert (status["stream_length"], status["stream_read"], status["stream_transitions"]) == (3, 0, 3)
    assert client.ask(task)["reason"] == "stream_backlog"
    keys = RedisKeys(key_prefix)
    read = redis_client.xreadgroup(broker.config.store.consumer_group, "learner-0", {keys.stream: ">"}, count=2)
    assert len(read[0][1]) == 2  # read, not acknowledged: pending in the group, still in the stream
    wait_for(lambda: client.status()["stream_read"] == 2, what="the broker to re-read the stream (every second)")
    status = client.status()
    assert (status["stream_length"], status["stream_transitions"]) == (3, 1)
    assert client.ask(task)["status"] == "ok"
    redis_client.xgroup_destroy(keys.stream, broker.config.store.consumer_group)  # a reset group: nothing counts as read
    wait_for(lambda: client.status()["stream_read"] == 0, what="the broker to re-read the stream (every second)")
    assert client.ask(task)["reason"] == "stream_backlog"
