"""The broker through real sockets and a real Redis: life cycle, retries, rules, actors, expiry."""

from __future__ import annotations

import collections
import json
import math
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import msgpack
import pytest
import zmq

from actor_node.link import BrokerLink
from actor_node.policies import UniformPolicy
from actor_node.worker import serve
from broker.config import BrokerConfig
from client import BadRequest, FeedbackWithoutStep, InternalError, RequestTimeout, UnknownTask
from common import protocol as p
from common.segments import RedisKeys, Segment
from tests.helpers import OBS, REPLY_S, actors_ready, wait_for


def segments(redis_client, prefix):
    return [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{prefix}:segments")]


def obs(n: int) -> dict:
    return {**OBS, "prompt": f"{OBS['prompt']} step {n}"}


def running(start_broker, start_actor, make_client, **config):
    """A broker (with `config`) and one uniform actor, and a client that has seen the actor register."""
    broker = start_broker(**config)
    start_actor(broker.backend)
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor to register")
    return broker, client


@pytest.fixture
def stack(start_broker, start_actor, make_client):
    return running(start_broker, start_actor, make_client)


def test_full_life_cycle_writes_segments_with_bootstrap_observations(start_broker, start_actor, make_client, redis_client, key_prefix):
    broker, client = running(start_broker, start_actor, make_client, segment_len=3)
    task = client.attach()
    assert client.ask(task)["status"] == "ok"
    replies = []
    for n in range(7):
        reply = client.step(task, obs(n))
        assert reply["status"] == "ok" and 0 <= reply["action"] < 3
        assert reply["policy_version"] == 0 and reply["probs"] == pytest.approx([1 / 3] * 3)
        replies.append(reply)
        assert client.feedback(task, reward=0.1 * n, done=False)["status"] == "ok"
    assert client.detach(task)["segments_closed"] == 1
    segs = segments(redis_client, key_prefix)
    epoch = segs[0].seg_id.split(":")[1]
    assert len(epoch) == 12 and [s.seg_id for s in segs] == [f"{task}:{epoch}:0", f"{task}:{epoch}:1", f"{task}:{epoch}:2"]
    assert [s.reason for s in segs] == ["length", "length", "detach"]
    transitions = [t for s in segs for t in s.transitions]
    assert [t.reward for t in transitions] == pytest.approx([0.1 * n for n in range(7)])
    assert [t.action for t in transitions] == [r["action"] for r in replies]
    assert [t.obs.prompt for t in transitions] == [obs(n)["prompt"] for n in range(7)]
    # A segment closed by length bootstraps from the observation that followed it.
    assert segs[0].next_obs.prompt == obs(3)["prompt"]
    assert segs[1].next_obs.prompt == obs(6)["prompt"]
    assert segs[2].truncated and segs[2].next_obs is None
    assert not redis_client.exists(f"{key_prefix}:task:{task}", f"{key_prefix}:seg:{task}")


def test_done_closes_the_segment_and_the_episode_goes_on(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))
    assert client.feedback(task, 1.0, done=True)["segment_closed"] is True
    client.step(task, obs(1))
    client.feedback(task, 0.5)
    segs = segments(redis_client, key_prefix)
    assert len(segs) == 1 and segs[0].done and segs[0].reason == "done" and segs[0].next_obs is None
    assert redis_client.llen(f"{key_prefix}:seg:{task}") == 1  # the new episode's first transition


def test_attach_with_own_task_id_resumes(stack):
    broker, client = stack
    assert client.request("attach", task_id="emu-1")["resumed"] is False
    client.step("emu-1", obs(0))
    reply = client.request("attach", task_id="emu-1")
    assert reply["task_id"] == "emu-1" and reply["resumed"] is True


def test_retried_requests_are_answered_once_and_applied_once(stack, redis_client, key_prefix):
    broker, client = stack
    first = client.request("attach", rid="attach-1")
    assert client.request("attach", rid="attach-1")["task_id"] == first["task_id"]
    task = first["task_id"]
    step = client.step(task, obs(0), rid="step-1")
    assert client.step(task, obs(0), rid="step-1") == step
    fb = client.feedback(task, 0.5, rid="fb-1")
    assert client.feedback(task, 0.5, rid="fb-1") == fb
    assert redis_client.llen(f"{key_prefix}:seg:{task}") == 1
    counters = client.status()["counters"]
    assert counters["broker/steps"] == 1 and counters["broker/feedbacks"] == 1 and counters["broker/replayed"] == 2
    detach = client.request("detach", rid="detach-1", task_id=task)
    assert client.request("detach", rid="detach-1", task_id=task) == detach
    with pytest.raises(UnknownTask):
        client.request("detach", rid="detach-2", task_id=task)


def test_a_lost_reply_is_recovered_by_resending_the_same_rid(stack, zmq_context, redis_client, key_prefix):
    """A client whose socket died after sending gets the original answer on a new socket."""
    broker, client = stack
    task = client.attach()
    lost = zmq_context.socket(zmq.DEALER)
    lost.connect(broker.frontend)
    body = p.header("step", "lost-1") | {"task_id": task, "obs": obs(0)}
    lost.send_multipart([b"", p.encode(body)])
    wait_for(lambda: client.status()["pending_steps"] == 1, what="the step to be recorded")
    lost.close(linger=0)  # the reply goes nowhere
    again = client.step(task, obs(0), rid="lost-1")
    assert again["rid"] == "lost-1" and client.status()["counters"]["broker/steps"] == 1
    client.feedback(task, 1.0)
    assert redis_client.llen(f"{key_prefix}:seg:{task}") == 1


def test_step_while_pending_closes_the_segment_and_counts_the_orphan(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))
    client.feedback(task, 1.0)
    client.step(task, obs(1))  # feedback for this one is lost
    client.step(task, obs(2))
    segs = segments(redis_client, key_prefix)
    assert [(s.reason, len(s.transitions), s.next_obs.prompt) for s in segs] == [("orphan_step", 1, obs(1)["prompt"])]
    assert client.status()["counters"]["broker/orphan_steps"] == 1
    client.feedback(task, 0.2)
    assert msgpack.unpackb(redis_client.lindex(f"{key_prefix}:seg:{task}", 0))["obs"]["prompt"] == obs(2)["prompt"]


def test_feedback_without_step_is_an_error_and_writes_nothing(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    with pytest.raises(FeedbackWithoutStep):
        client.feedback(task, 1.0)
    client.step(task, obs(0))
    client.feedback(task, 1.0)
    with pytest.raises(FeedbackWithoutStep):
        client.feedback(task, 1.0)
    assert redis_client.llen(f"{key_prefix}:seg:{task}") == 1
    assert client.status()["counters"]["broker/feedback_without_step"] == 2


def test_older_clients_empty_next_obs_is_accepted(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))
    assert client.request("feedback", task_id=task, reward=0.5, done=False, next_obs={})["status"] == "ok"


def raw_request(ctx, endpoint, frames, timeout=REPLY_S):
    """Send raw frames on a fresh DEALER; return the decoded reply or None (none within `timeout` s)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout * 1000):
            return None
        return p.decode(sock.recv_multipart()[-1])
    finally:
        sock.close()


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"", b"\x93\x01\x02"], p.E_BAD_REQUEST),  # an array, not a map
        ([b"", b"\xff\xfe\x00"], p.E_BAD_REQUEST),  # random bytes
        ([b"", p.encode({"proto": "ppoz", "v": 1, "op": "step", "rid": "r", "task_id": "t"})[:-3]], p.E_BAD_REQUEST),  # truncated
        ([b"", p.encode({"proto": "ppoz", "v": 1, "op": "ask"})], p.E_BAD_REQUEST),  # no rid
        ([b"", p.encode({"proto": "ppoz", "v": 1, "op": "teleport", "rid": "r"})], p.E_UNKNOWN_OP),
        ([b"", p.encode({"proto": "ppoz", "v": 9, "op": "ask", "rid": "r"})], p.E_UNSUPPORTED_VERSION),
        ([b"", p.encode({"proto": "ppoz", "v": 1, "op": "ask", "rid": "r", "task_id": "nobody"})], p.E_UNKNOWN_TASK),
        ([p.encode({"proto": "ppoz", "v": 1, "op": "ask", "rid": "r", "task_id": "nobody"})], p.E_UNKNOWN_TASK),  # no delimiter
    ],
)
def test_bad_requests_get_error_replies(broker, zmq_context, frames, code):
    reply = raw_request(zmq_context, broker.frontend, frames)
    assert reply is not None, "a well-framed request must get a reply"
    assert reply["error"]["code"] == code
    assert reply["proto"] == p.PROTOCOL_ID and reply["v"] == p.PROTOCOL_VERSION
    if code == p.E_UNSUPPORTED_VERSION:
        assert reply["supported"] == [p.PROTOCOL_VERSION] and reply["rid"] == "r"


def test_request_errors_name_the_field(stack):
    broker, client = stack
    task = client.attach()
    with pytest.raises(BadRequest, match="`obs.action` is empty"):
        client.step(task, {"prompt": "p", "question": "q", "action": []})
    with pytest.raises(BadRequest, match="`reward` must be a finite number, got str"):
        client.request("feedback", task_id=task, reward="high", done=False)
    with pytest.raises(BadRequest, match="`done` must be a bool, got int"):
        client.request("feedback", task_id=task, reward=1.0, done=1)


def test_limits_give_too_large(start_broker, make_client, zmq_context):
    broker = start_broker(max_actions=4, max_prompt_chars=100, max_message_bytes=2048)
    client = make_client(broker.frontend)
    task = client.attach()
    for bad, words in (({**OBS, "action": ["a"] * 5}, "5 candidates"), ({**OBS, "prompt": "p" * 200}, "the limit is 100")):
        reply = raw_request(zmq_context, broker.frontend, [b"", p.encode(p.header("step", "r") | {"task_id": task, "obs": bad})])
        assert reply["error"]["code"] == p.E_TOO_LARGE and words in reply["error"]["message"]
    reply = raw_request(zmq_context, broker.frontend, [b"", p.encode(p.header("ask", "r") | {"task_id": task, "pad": "x" * 4000})])
    assert reply["error"]["code"] == p.E_TOO_LARGE and "the limit is 2048" in reply["error"]["message"]


def test_malformed_frames_are_dropped_and_counted_and_service_goes_on(stack, zmq_context):
    broker, client = stack
    # how long to look for a reply that must not come, not a deadline: load can only make it pass wrongly
    assert raw_request(zmq_context, broker.frontend, [b"x", b"y", b"z"], timeout=0.5) is None
    assert raw_request(zmq_context, broker.frontend, [b"", b"", b"", b""], timeout=0.5) is None
    task = client.attach()
    assert client.step(task, obs(0))["status"] == "ok"
    assert client.status()["counters"]["dropped/malformed_frames"] == 2


def test_ask_says_wait_without_actors_and_steps_time_out(start_broker, make_client):
    broker = start_broker(request_timeout_ms=300)
    client = make_client(broker.frontend, deadline=1.5)  # the client retries `timeout` until its own deadline
    task = client.attach()
    reply = client.ask(task)
    assert reply["status"] == "wait" and reply["reason"] == "no_actor" and reply["retry_after_ms"] > 0
    started = time.monotonic()
    with pytest.raises(RequestTimeout):
        client.step(task, obs(0))
    # the client's 1.5 s deadline and a loaded machine's late wake-ups (under a second): a client that waited out its
    # 5 s attempt_timeout instead, or kept retrying, would fail
    assert time.monotonic() - started < 5
    assert client.status()["counters"]["errors/timeout"] >= 2  # each attempt got its `timeout` from the broker


def test_an_attach_rid_reused_by_another_client_gets_a_task_of_its_own_and_a_retry_on_a_new_socket_the_same(start_broker, zmq_context):
    """Two clients (two addresses: 127.0.0.1 and 127.0.0.2) sending `attach` with one rid get two tasks; the first
    client's retry on a new socket (retry rule 3) gets its own task again. Before, the rid alone found the task: a
    client reusing a rid got another's task id, and with it a way to write rewards into it."""
    broker = start_broker()
    port = broker.frontend.rsplit(":", 1)[1]

    def attach(source: str, rid: str = "a1") -> dict:
        sock = zmq_context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{source}:0;127.0.0.1:{port}")  # the connection's source address
        try:
            sock.send_multipart([b"", p.encode(p.header("attach", rid))])
            assert sock.poll(5000), f"no answer to an attach from {source}"  # REPLY_S: a broker thread's reply
            return p.decode(sock.recv_multipart()[-1])
        finally:
            sock.close(linger=0)

    first = attach("127.0.0.1")
    again = attach("127.0.0.1")
    other = attach("127.0.0.2")
    assert again["task_id"] == first["task_id"] and other["task_id"] != first["task_id"]
    assert not other["resumed"] and not again["resumed"]
    stored = broker.broker.store.load_sessions(32, 0)  # kept in Redis: a restarted broker tells them apart too
    assert (stored[first["task_id"]].attach_sender, stored[other["task_id"]].attach_sender) == ("127.0.0.1", "127.0.0.2")
    assert attach("127.0.0.2")["task_id"] == other["task_id"]


def test_attach_past_max_sessions_is_overloaded_and_the_open_sessions_keep_working(start_broker, make_client, redis_client, key_prefix):
    """An attach flood must not grow Redis without bound: past `max_sessions` a new attach is `overloaded` (nothing
    written), while a retried attach, a resume by task id and the open sessions' steps go on; a detach makes room."""
    broker = start_broker(max_sessions=3, retry_after_ms=50)
    # how long the client retries `overloaded` before it raises it, short on purpose; every request here is answered
    # by the broker thread alone, in ms (x100)
    client = make_client(broker.frontend, deadline=0.5)
    first = client.request("attach", rid="a-0")["task_id"]
    others = [client.attach() for _ in range(2)]
    keys_before = sorted(redis_client.scan_iter(f"{key_prefix}:*"))
    with pytest.raises(Exception, match="3 sessions are open, the broker's max_sessions"):  # overloaded, retried to the deadline
        client.attach()
    assert sorted(redis_client.scan_iter(f"{key_prefix}:*")) == keys_before
    assert client.status()["counters"]["errors/overloaded"] >= 1 and client.status()["sessions"] == 3
    assert client.request("attach", rid="a-0")["task_id"] == first  # a retry of an accepted attach
    assert client.attach(others[0]) == others[0]  # a resume
    client.detach(others[1])
    assert client.attach() not in [first, *others]


def test_overloaded_when_the_queue_is_full_for_the_client_that_filled_it(start_broker, make_client, zmq_context):
    """The client holding the whole queue gets `overloaded`; another client, under its share, is still queued, and
    then it too is refused past its share."""
    broker = start_broker(max_queue=2, request_timeout_ms=3000)
    client = make_client(broker.frontend)
    a, b, c, d, e = (client.attach() for _ in range(5))
    flood, polite = zmq_context.socket(zmq.DEALER), zmq_context.socket(zmq.DEALER)
    for sock in (flood, polite):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(broker.frontend)
    for n, task in enumerate((a, b)):
        flood.send_multipart([b"", p.encode(p.header("step", f"q{n}") | {"task_id": task, "obs": obs(0)})])
    wait_for(lambda: client.status()["queued_jobs"] == 2, what="the flood to fill the queue")
    flood.send_multipart([b"", p.encode(p.header("step", "q2") | {"task_id": c, "obs": obs(0)})])
    assert flood.poll(2000), "no answer to a step past the queue's limit"  # a broker thread's reply: ms alone; x1000
    reply = p.decode(flood.recv_multipart()[-1])
    assert reply["rid"] == "q2" and reply["error"]["code"] == p.E_OVERLOADED and reply["retry_after_ms"] > 0
    assert "2 of them yours" in reply["error"]["message"]
    polite.send_multipart([b"", p.encode(p.header("step", "p1") | {"task_id": d, "obs": obs(0)})])
    wait_for(lambda: client.status()["queued_jobs"] == 3, what="the polite client's step queued past the limit")
    assert not polite.poll(200), "the polite client's step was answered, not queued"  # a look for what must not come
    polite.send_multipart([b"", p.encode(p.header("step", "p2") | {"task_id": e, "obs": obs(0)})])
    assert polite.poll(2000), "no answer to the polite client's step past its share"  # as above: ms alone; x1000
    assert p.decode(polite.recv_multipart()[-1])["error"]["code"] == p.E_OVERLOADED
    assert client.ask(b)["reason"] == "no_actor"
    flood.close(linger=0)
    polite.close(linger=0)


def test_a_step_refused_for_its_deadline_leaves_the_task_s_running_step_alone(start_broker, make_client, zmq_context):
    """A newer step supersedes the running one only once it is accepted: one refused for its `deadline_ms` must not
    answer the running step `timeout` (found by reading on_step: the deadline was checked after the superseding)."""
    broker = start_broker(request_timeout_ms=5000)
    client = make_client(broker.frontend)
    task = client.attach()
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.frontend)
    sock.send_multipart([b"", p.encode(p.header("step", "s1") | {"task_id": task, "obs": obs(0)})])
    wait_for(lambda: client.status()["queued_jobs"] == 1, what="the first step queued (no actor)")
    for bad in (0, -5, "soon"):
        sock.send_multipart([b"", p.encode(p.header("step", f"s-{bad}") | {"task_id": task, "obs": obs(1), "deadline_ms": bad})])
        assert sock.poll(2000), "no answer to a bad deadline"  # a broker thread's reply: ms alone; x1000
        reply = p.decode(sock.recv_multipart()[-1])
        assert reply["rid"] == f"s-{bad}" and reply["error"]["code"] == p.E_BAD_REQUEST and "deadline_ms" in reply["error"]["message"]
    assert not sock.poll(300), "the running step was answered (superseded by a refused request)"  # what must not come
    assert client.status()["jobs"] == 1
    sock.close(linger=0)


def test_actor_errors_and_invalid_results_become_internal_errors(broker, start_actor, make_client):
    class Broken(UniformPolicy):
        def choose(self, o):
            if o["prompt"].endswith("raise"):
                raise RuntimeError("boom")
            return 99, 0.0, [1.0]  # out of range and wrong length

    start_actor(broker.backend, policy=Broken())
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor")
    task = client.attach()
    # The client retries `internal_error` until its deadline, then raises it: the deadline only has to outlast the first
    # answer, from an actor thread of this process, 10-100 ms alone. It was 1 s (x10 at best): 2 s.
    with pytest.raises(InternalError, match="boom"):
        client.request("step", task_id=task, obs={**OBS, "prompt": "raise"}, deadline=2.0)
    with pytest.raises(InternalError, match="invalid result"):
        client.request("step", task_id=task, obs=OBS, deadline=2.0)
    assert client.status()["pending_steps"] == 0


class SilentActor:
    """A stand-in actor: announces itself, takes jobs, never answers; heartbeats only if told to."""

    def __init__(self, ctx, endpoint, heartbeat: bool):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send(p.encode(p.header(p.OP_READY) | {"name": "silent", "credits": 4, "policy_version": 0}))
        self.jobs = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(heartbeat,), daemon=True)
        self.thread.start()

    def run(self, heartbeat):
        while not self.stop.is_set():
            if self.sock.poll(50):  # a tick: how often `stop` is looked at
                msg = p.decode(self.sock.recv())
                self.jobs += len(msg.get("jobs", []))
            if heartbeat:
                self.sock.send(p.encode(p.header(p.OP_HEARTBEAT)))

    def kill(self):
        self.stop.set()
        self.thread.join(5)  # the loop sees `stop` within one 50 ms poll; x100
        self.sock.close(linger=0)


@pytest.mark.parametrize("hang", [False, True], ids=["dead", "hung"])
def test_requests_of_a_dead_or_hung_actor_go_to_another(start_broker, start_actor, make_client, zmq_context, hang):
    # The three steps are answered once the broker has given up on the silent actor (3 missed 0.1 s heartbeats, or
    # its 0.6 s job timeout) and the healthy actor thread has registered and served them: 1-1.5 s alone after they
    # were sent. The steps' own timeout was 8 s (x5): 30 s, and the clients wait past it (x20).
    broker = start_broker(heartbeat_ms=100, heartbeat_liveness=3, actor_job_timeout_ms=600, request_timeout_ms=30_000)
    client = make_client(broker.frontend)
    silent = SilentActor(zmq_context, broker.backend, heartbeat=hang)
    wait_for(lambda: actors_ready(client, 1), what="the silent actor")
    tasks = [client.attach() for _ in range(3)]
    results: dict[str, dict] = {}
    threads = []
    for task in tasks:
        c = make_client(broker.frontend, deadline=35.0, attempt_timeout=35.0)
        threads.append(threading.Thread(target=lambda c=c, t=task: results.__setitem__(t, c.step(t, obs(0)))))
        threads[-1].start()
    # three client threads connect and the broker hands the silent actor each step: well under a second alone; 30 s
    # (the default 10 s timed out once in a full suite on the 2-core VM)
    wait_for(lambda: silent.jobs == 3, timeout=30, what="the silent actor to take all three jobs")
    if not hang:
        silent.kill()  # dies holding three requests
    start_actor(broker.backend, name="healthy")
    for t in threads:
        t.join(40)  # past the clients' deadline: a thread still running is a step lost
    assert sorted(results) == sorted(tasks) and all(r["status"] == "ok" for r in results.values())
    counters = client.status()["counters"]
    assert counters["jobs/requeued"] == 3
    assert counters["actors/hung" if hang else "actors/dead"] == 1
    assert client.status()["pending_steps"] == 3
    if hang:
        silent.kill()


class SlowPolicy(UniformPolicy):
    """Computes each batch in small steps for `seconds`, its progress growing at each, as a model on a slow device
    runs its layers: a stand-in for a Kea observation that takes longer than the broker's job timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__(0)
        self.seconds = seconds
        self.batches = 0

    def choose_batch(self, jobs):
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            time.sleep(0.02)
            self.progress += 1
        self.batches += 1
        return super().choose_batch(jobs)


def test_a_busy_actor_that_progresses_keeps_its_job_past_the_timeout_and_answers_it_once(start_broker, make_client, zmq_context):
    """An actor computing one job for 4x `actor_job_timeout_ms` (its heartbeats' progress growing) is busy, not hung:
    the job is never given to the idle second actor, nothing is requeued, and the client gets the busy actor's answer."""
    broker = start_broker(heartbeat_ms=100, heartbeat_liveness=3, actor_job_timeout_ms=300, request_timeout_ms=30_000)
    client = make_client(broker.frontend, deadline=30.0, attempt_timeout=30.0)
    policy = SlowPolicy(seconds=1.2)
    stop = threading.Event()
    link = BrokerLink(
        broker.backend, name="busy", credits=1, heartbeat_ms=100, context=zmq_context, progress=lambda: policy.progress
    ).start()
    thread = threading.Thread(target=serve, args=(link, policy, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: actors_ready(client, 1), what="the busy actor")
        task = client.attach()
        answered: dict[str, dict] = {}
        stepping = threading.Thread(target=lambda: answered.__setitem__("step", client.step(task, obs(0))))
        stepping.start()
        wait_for(lambda: policy.progress > 0, timeout=30, what="the busy actor to start computing")
        idle = SilentActor(zmq_context, broker.backend, heartbeat=True)  # free credits all along: a requeued job would go here
        stepping.join(30)  # the 1.2 s job, from an actor thread of this process; x25
        assert answered["step"]["status"] == "ok"
        counters = client.status()["counters"]
        assert counters["actors/hung"] == 0 and counters["jobs/requeued"] == 0
        assert idle.jobs == 0 and policy.batches == 1
        idle.kill()
    finally:
        stop.set()
        thread.join(10)
        link.close()


class ForgetfulActor:
    """A stand-in actor that heartbeats with a growing progress and answers every job but the first it takes: a job
    lost inside an actor that is busy with others."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send(p.encode(p.header(p.OP_READY) | {"name": "forgetful", "credits": 4, "policy_version": 0}))
        self.taken: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        progress = 0
        while not self.stop.is_set():
            if self.sock.poll(50):
                for job in p.decode(self.sock.recv()).get("jobs", []):
                    self.taken.append(job["job"])
                    if len(self.taken) > 1:  # the first is lost
                        n = len(job["obs"]["action"])
                        result = {"job": job["job"], "action": 0, "logprob": -math.log(n), "probs": [1 / n] * n, "policy_version": 0}
                        self.sock.send(p.encode(p.header(p.OP_RESULT) | {"results": [result]}))
            progress += 1
            self.sock.send(p.encode(p.header(p.OP_HEARTBEAT) | {"policy_version": 0, "progress": progress}))

    def kill(self):
        self.stop.set()
        self.thread.join(5)  # the loop sees `stop` within one 50 ms poll; x100
        self.sock.close(linger=0)


def test_a_job_lost_in_an_actor_that_answers_later_ones_is_requeued(start_broker, start_actor, make_client, zmq_context):
    """Progress alone does not keep a job: an actor answered a job sent after it, so it lost this one, and after
    `actor_job_timeout_ms` the job goes to another actor while the progressing one is taken as hung."""
    broker = start_broker(heartbeat_ms=100, heartbeat_liveness=3, actor_job_timeout_ms=600, request_timeout_ms=30_000)
    client = make_client(broker.frontend)
    forgetful = ForgetfulActor(zmq_context, broker.backend)
    wait_for(lambda: actors_ready(client, 1), what="the forgetful actor")
    first, second = client.attach(), client.attach()
    answers: dict[str, dict] = {}
    lost = threading.Thread(
        target=lambda: answers.__setitem__("first", make_client(broker.frontend, deadline=30.0, attempt_timeout=30.0).step(first, obs(0)))
    )
    lost.start()
    wait_for(lambda: len(forgetful.taken) == 1, timeout=30, what="the forgetful actor to take the first job")
    assert client.step(second, obs(1))["action"] == 0  # answered, after the first was sent
    start_actor(broker.backend, name="healthy")
    lost.join(30)  # the 0.6 s timeout, then the healthy actor thread: a second alone; x20
    assert answers["first"]["action"] in range(3)
    counters = client.status()["counters"]
    assert counters["actors/hung"] == 1 and counters["jobs/requeued"] == 1
    forgetful.kill()


def test_silent_sessions_expire_into_truncated_segments(start_broker, start_actor, make_client, redis_client, key_prefix):
    broker, client = running(start_broker, start_actor, make_client, session_ttl_s=0.5)
    task = client.attach()
    client.step(task, obs(0))
    client.feedback(task, 1.0)
    client.step(task, obs(1))  # the emulator dies here, without detach
    # the 0.5 s TTL, then the broker's next session scan (once a second): 0.5-1.5 s alone. It was 10 s (x7): 20 s
    segs = wait_for(lambda: segments(redis_client, key_prefix), timeout=20, what="the expired session's segment")
    assert [(s.reason, s.truncated, len(s.transitions), s.next_obs.prompt) for s in segs] == [("expired", True, 1, obs(1)["prompt"])]
    with pytest.raises(UnknownTask):
        client.ask(task)
    assert client.status()["counters"]["sessions/expired"] == 1


def test_status_reports_actors_sessions_and_added_latency(stack):
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))
    client.feedback(task, 1.0)
    status = client.status()
    assert status["sessions"] == 1 and status["pending_steps"] == 0 and status["storage_ok"] is True
    assert status["actors"][0]["served"] == 1 and status["actors"][0]["credits"] == 8
    assert status["added_latency"]["n"] == 2 and status["added_latency"]["p99_ms"] >= 0


def test_prometheus_endpoint_serves_the_status_figures(start_broker, start_actor, make_client):
    import urllib.request

    broker = start_broker(metrics_bind="127.0.0.1:0")
    start_actor(broker.backend, name="prom-actor")
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor")
    task = client.attach()
    for _ in range(3):
        client.step(task, OBS)
        client.feedback(task, 1.0)
    port = broker.broker.metrics_server.port

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # a thread of this process: ms; x1000
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return r.read().decode()

    def scraped_after_the_steps() -> str | None:
        text = scrape()
        return text if 'ppoz_events_total{name="broker/steps"} 3.0' in text else None

    # the steps are counted; the endpoint's figures are renewed once a second: at most 1 s alone. It was 10 s: 20 s (x20)
    text = wait_for(scraped_after_the_steps, timeout=20, what="the scrape to show 3 steps")
    assert "ppoz_sessions 1.0" in text and 'ppoz_actor_credits{actor="prom-actor"}' in text
    assert "# TYPE ppoz_events_total counter" in text
    assert 'ppoz_added_latency_ms{quantile="0.5"}' in text and 'ppoz_added_latency_ms{quantile="0.99"}' in text
    for line in text.splitlines():  # every sample line is NAME[{labels}] VALUE
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert name.startswith("ppoz_"), line


def test_a_task_id_attached_again_after_detach_gets_new_segment_ids(stack, redis_client, key_prefix):
    """Found by the fuzz's ledger: seq starts at 0 in each life of a task id, and the learner drops a seg_id it has seen,
    so a client re-attaching under its own name lost its later segments from training."""
    broker, client = stack
    for life in range(2):
        assert client.attach("emulator-7") == "emulator-7"
        client.step("emulator-7", obs(life))
        client.feedback("emulator-7", 1.0, done=True)
        client.detach("emulator-7")
    ids = [s.seg_id for s in segments(redis_client, key_prefix)]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("emulator-7:") and i.endswith(":0") for i in ids)


def over_the_backlog(client, task, limit=2):
    """Over a backlog limit of 2: one-step segments (each closed by the next step), nobody reading them. No step here
    waits for the backlog (broker/backpressure.py): each comes while it is at its limit or under, and the last takes
    it over."""
    n = 0
    while client.status()["stream_length"] <= limit:
        client.step(task, obs(n))
        client.feedback(task, reward=0.0, done=False)
        n += 1


def test_one_ask_is_held_per_task_and_an_ended_task_s_held_ask_gets_unknown_task(start_broker, start_actor, make_client, zmq_context):
    """What the broker holds is bounded by its sessions: a task's second ask takes the place of its first, which is
    answered `wait` at once; and a held ask of a task detached meanwhile is answered `unknown_task`, not `ok`."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, ask_hold_ms=5000)
    held = broker.broker.held_asks
    task, other = client.attach(), client.attach()
    over_the_backlog(client, task)
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.frontend)

    def ask(rid: str, task_id: str) -> None:
        sock.send_multipart([b"", p.encode(p.header("ask", rid) | {"task_id": task_id})])

    def answer(timeout_ms: int = 2000) -> dict:
        assert sock.poll(timeout_ms), "no answer"  # a broker thread's reply: ms alone; x1000
        return p.decode(sock.recv_multipart()[-1])

    ask("k1", task)
    wait_for(lambda: len(held) == 1, what="the first ask held")
    started = time.monotonic()
    ask("k2", task)
    first = answer()
    assert first["rid"] == "k1" and first["status"] == "wait" and first["retry_after_ms"] == 1, first
    # at once (ms alone), not at the end of its 5 s hold, which says the same: the bound was 1 s; 2.5 s, half the hold,
    # tells the two apart as well and leaves a loaded machine room
    assert time.monotonic() - started < 2.5
    # the broker answers the older ask before it holds the newer one: read from this thread, in between it is 0
    wait_for(lambda: len(held) == 1 and task in held, what="the second ask held in the first one's place")
    ask("k3", other)
    wait_for(lambda: len(held) == 2, what="the other task's ask held")
    client.detach(other)
    ended = answer()
    assert ended["rid"] == "k3" and ended["error"]["code"] == p.E_UNKNOWN_TASK and "detached" in ended["error"]["message"], ended
    assert list(held) == [task]
    sock.close(linger=0)


def test_an_ask_over_the_backlog_is_held_and_answered_ok_as_soon_as_the_learner_reads(
    start_broker, start_actor, make_client, redis_client, key_prefix
):
    """Held, not told to sleep retry_after_ms: answered `ok` within moments of the stream shrinking (the learner's
    XDEL after an update), by the broker's own re-read of the stream's length, long before the hold or the retry."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, ask_hold_ms=4000)
    task = client.attach()
    asker = make_client(broker.frontend)
    stream = RedisKeys(key_prefix).stream
    for _ in range(3):  # three times: the broker's once-a-second housekeeping read cannot pass them all by chance
        over_the_backlog(client, task)
        replies: list[tuple[dict, float]] = []
        thread = threading.Thread(target=lambda got=replies: got.append((asker.ask(task), time.monotonic())), daemon=True)
        thread.start()
        time.sleep(0.6)  # a look for an answer that must not come, not a deadline
        assert not replies, f"answered while the backlog was over its limit: {replies}"
        redis_client.xdel(stream, *[entry_id for entry_id, _ in redis_client.xrange(stream)])  # the learner read and acknowledged them
        read_at = time.monotonic()
        thread.join(5)  # answered within 10 ms alone (the broker re-reads the stream every 0.01 s while it holds asks); x500
        assert replies and replies[0][0]["status"] == "ok" and replies[0][0]["task_id"] == task
        # A timing claim, kept: the answer follows the read at once (10 ms alone), not at the broker's once-a-second
        # refresh of the stream's length; 0.3 s leaves x30 and keeps the chance that the refresh passes all three
        # rounds at 2.7%. It passed beside two spinners (bin/test --busy 2).
        assert replies[0][1] - read_at < 0.3, f"answered {replies[0][1] - read_at:.2f} s after the learner read, not at once"


@pytest.mark.parametrize("hold_ms", [0, 300])
def test_an_ask_held_past_ask_hold_ms_is_told_to_ask_again_at_once_and_without_a_hold_to_wait(
    start_broker, start_actor, make_client, hold_ms
):
    """Past the hold: `wait` with retry_after_ms 1 (a long poll: the client asks again and is held again); with
    ask_hold_ms 0, the broker's retry_after_ms at once, as before holding existed."""
    broker, client = running(
        start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, ask_hold_ms=hold_ms, retry_after_ms=1500
    )
    task = client.attach()
    over_the_backlog(client, task)
    started = time.monotonic()
    reply = client.ask(task)
    waited = time.monotonic() - started
    assert reply["status"] == "wait" and reply["reason"] == "stream_backlog"
    # Held, the answer says so (retry_after_ms 1) and it came no sooner than the hold (load only makes it later); not
    # held, the broker's own retry_after_ms tells it from a held answer, whatever the time it took.
    if hold_ms:
        assert reply["retry_after_ms"] == 1 and waited >= 0.25, (reply, waited)
    else:
        assert reply["retry_after_ms"] == 1500, (reply, waited)


@pytest.mark.parametrize("hold_ms", [-1, 5001])
def test_ask_hold_ms_out_of_its_bounds_is_refused_by_name(tmp_path, hold_ms):
    """0 to 5000: a hold past the clients' attempt timeouts would have them resend asks the broker still holds."""
    import argparse

    from common.config import ConfigError, add_flags, load

    words = f"`ask_hold_ms` must be 0 to 5000 (below clients' attempt timeouts), got {hold_ms}"
    with pytest.raises(ValueError, match=re.escape(words)):
        BrokerConfig(ask_hold_ms=hold_ms)
    path = tmp_path / "ppoz.toml"
    path.write_text(f"[broker]\nask_hold_ms = {hold_ms}\n")
    with pytest.raises(ConfigError, match=re.escape(words)):
        load(BrokerConfig, path)
    parser = argparse.ArgumentParser()
    add_flags(parser, BrokerConfig)
    with pytest.raises(ConfigError, match=re.escape(words)):
        load(BrokerConfig, None, parser.parse_args(["--ask-hold-ms", str(hold_ms)]))


@pytest.mark.parametrize("hold_ms", [0, 5000])
def test_ask_hold_ms_at_its_bounds_is_accepted(tmp_path, hold_ms):
    from common.config import load

    assert BrokerConfig(ask_hold_ms=hold_ms).ask_hold_ms == hold_ms
    path = tmp_path / "ppoz.toml"
    path.write_text(f"[broker]\nask_hold_ms = {hold_ms}\n")
    assert load(BrokerConfig, path).ask_hold_ms == hold_ms


# A client in a process of its own: asks for each task id read from stdin, prints the reply and when it came
ASKER = """
import json, sys, time
from client import Client
client = Client(sys.argv[1], deadline=10, attempt_timeout=5)  # past the 4 s hold; the answer after the read takes ms
print("ready", flush=True)
for line in sys.stdin:
    reply = client.ask(line.strip())
    print(json.dumps({"reply": reply, "at": time.monotonic()}), flush=True)
"""


def test_the_asks_of_many_clients_and_processes_are_all_held_and_all_answered_ok_as_soon_as_the_learner_reads(
    start_broker, start_actor, make_client, redis_client, key_prefix
):
    """16 threads (a client each) and 3 processes ask at once over the backlog: each ask is held (the broker holds
    one entry per ask: none answered early, none lost), and every one is answered `ok` within moments of the
    learner's read, three times over (as above: the once-a-second housekeeping read cannot pass them all). A
    blocking client drops a second reply to its rid; the flood below, on raw sockets, sees one."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, ask_hold_ms=4000)
    held = broker.broker.held_asks  # the broker's own queue of held asks (its length read from this thread)
    stream = RedisKeys(key_prefix).stream
    n_threads, n_procs = 16, 3
    task = client.attach()
    tasks = [client.attach() for _ in range(n_threads + n_procs)]  # an asker each
    askers = [make_client(broker.frontend) for _ in range(n_threads)]
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen([sys.executable, "-c", ASKER, broker.frontend], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(n_procs)
    ]
    lines: queue.Queue[tuple[int, str]] = queue.Queue()  # (process, line): read by threads, so a silent process fails the test

    def read(n: int, out: IO[str]) -> None:
        for line in out:
            lines.put((n, line))

    def next_line(timeout: float) -> tuple[int, str]:
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"an asking process printed nothing in {timeout:.0f} s (its ask lost?)")

    for n, proc in enumerate(procs):
        assert proc.stdout is not None
        threading.Thread(target=read, args=(n, proc.stdout), daemon=True).start()
    try:
        # a Python process importing the client (zmq, msgpack; no torch): 0.3 s alone; x100
        assert sorted(next_line(30) for _ in procs) == [(n, "ready\n") for n in range(n_procs)]
        for _ in range(3):
            over_the_backlog(client, task)
            waits = client.status()["counters"].get("broker/ask_wait", 0)
            replies: dict[str, list[tuple[dict, float]]] = collections.defaultdict(list)  # by task id, every reply
            lock = threading.Lock()

            def ask(asker, task_id, replies=replies, lock=lock):
                try:
                    reply = asker.ask(task_id)
                except Exception as e:  # (a lost ask times out) shown in the assertions, not left to the thread
                    reply = {"error": repr(e)}
                with lock:
                    replies[task_id].append((reply, time.monotonic()))

            threads = [threading.Thread(target=ask, args=(askers[k], tasks[k]), daemon=True) for k in range(n_threads)]
            for thread in threads:
                thread.start()
            for proc, task_id in zip(procs, tasks[n_threads:]):
                assert proc.stdin is not None
                proc.stdin.write(task_id + "\n")
                proc.stdin.flush()
            # 19 asks sent at once to a broker thread: ms alone; x100 (and below the 4 s hold, when the first would be let go)
            wait_for(lambda: len(held) == len(tasks), timeout=5, what=f"all {len(tasks)} asks held (held now: {len(held)})")
            time.sleep(0.3)  # a look for an answer that must not come, not a deadline
            assert len(held) == len(tasks) and not replies, f"answered while the backlog was over its limit: {dict(replies)}"
            dropped_at = time.monotonic()
            redis_client.xdel(stream, *[entry_id for entry_id, _ in redis_client.xrange(stream)])  # the learner read them
            read_at = time.monotonic()
            for thread in threads:
                thread.join(5)  # answered within 10 ms of the read alone; x500 (the 4 s hold would end them anyway)
            for _ in procs:
                n, line = next_line(10)  # the same, then a line through a pipe; x1000
                printed = json.loads(line)
                replies[tasks[n_threads + n]].append((printed["reply"], printed["at"]))  # the same clock: CLOCK_MONOTONIC
            assert sorted(replies) == sorted(tasks), f"{len(tasks) - len(replies)} asks lost"
            assert all(len(got) == 1 for got in replies.values())
            assert all(r["status"] == "ok" and r["task_id"] == t for t, [(r, _)] in replies.items()), dict(replies)
            assert all(at > dropped_at for [(_, at)] in replies.values()), "answered before the learner read"
            late = max(at for [(_, at)] in replies.values()) - read_at
            # a timing claim, as in the test above (at once, not at the once-a-second refresh); passed under --busy 2
            assert late < 0.3, f"answered up to {late:.3f} s after the learner read, not at once"
            assert len(held) == 0 and client.status()["counters"].get("broker/ask_wait", 0) == waits
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(10)  # its stdin closed, the asking loop ends and the process exits: 0.1 s alone; x100
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _flood(socks, tag: str, per_socket: int, tasks: list[str]) -> tuple[dict[str, float], dict[str, str]]:
    """Send `per_socket` asks on each raw socket without waiting for replies, each for a task of its own (the broker
    holds one ask per task); when each rid was sent, and its task."""
    sent, task_of = {}, {}
    for i in range(per_socket):
        for s, sock in enumerate(socks):
            rid = f"{tag}-{s}-{i}"
            task_of[rid] = tasks[i * len(socks) + s]
            sock.send_multipart([b"", p.encode(p.header("ask", rid) | {"task_id": task_of[rid]})])
            sent[rid] = time.monotonic()
    return sent, task_of


def _collect(socks, until: float) -> dict[str, list[tuple[dict, float]]]:
    """Every reply the sockets get until `until` (monotonic), by rid, with when it came."""
    got: dict[str, list[tuple[dict, float]]] = collections.defaultdict(list)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    while (left := until - time.monotonic()) > 0:  # a window its caller sizes, with its reason
        for sock in dict(poller.poll(max(1, int(left * 1000)))):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = p.decode(frames[-1])
                got[reply["rid"]].append((reply, time.monotonic()))
    return got


@pytest.mark.slow
def test_a_flood_of_held_asks_gets_one_answer_each_and_the_broker_keeps_serving(
    start_broker, start_actor, make_client, zmq_context, redis_client, key_prefix
):
    """2,000 asks (a task each) from four sockets at once over the backlog: all held (none lost), each answered exactly once,
    `wait` after its own hold (not before, and not long after) or `ok` within moments of the learner's read; a
    `ping` from another client is answered at once all along, and the broker holds nothing once they are answered."""
    # A 3 s hold: each bound below tells what it guards from its failure (a hold expired early or late, a loop blocked
    # until the holds end) by 1.5 s, x7 to x15 what it takes alone on the 2-core VM (0.1-0.2 s).
    hold_ms, per_socket = 3000, 500
    broker, client = running(start_broker, start_actor, make_client, segment_len=1, max_stream_backlog=2, ask_hold_ms=hold_ms)
    held = broker.broker.held_asks
    task = client.attach()
    over_the_backlog(client, task)
    stream = RedisKeys(key_prefix).stream
    tasks = [client.attach() for _ in range(4 * per_socket)]
    socks = []
    for _ in range(4):
        sock = zmq_context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(broker.frontend)
        socks.append(sock)
    total = per_socket * len(socks)
    pinger = make_client(broker.frontend)
    pinger.ping()  # connected before the flood
    pings: list[float] = []
    flooding = threading.Event()

    # Every ask held within 1.5 s of the flood (before the first hold ends), each answered within 1.5 s of its hold's
    # end or of the learner's read (not at the next hold's end), every ping answered within 1.5 s (a loop blocked by
    # the held asks would answer it when they end, at 3 s).
    def ping_along():
        while flooding.is_set():
            started = time.monotonic()
            try:
                ok = pinger.ping()["status"] == "ok"
            except Exception:  # the broker stopped answering: counted below as a ping that took forever
                ok = False
            pings.append(time.monotonic() - started if ok else float("inf"))
            time.sleep(0.02)

    for tag in ("expire", "release"):  # held to the end of the hold; then released by the learner's read
        waits = client.status()["counters"].get("broker/ask_wait", 0)
        flooding.set()
        pings.clear()
        pinging = threading.Thread(target=ping_along, daemon=True)
        pinging.start()
        try:
            sent, task_of = _flood(socks, tag, per_socket, tasks)
            wait_for(lambda: len(held) == total, timeout=1.5, what=f"all {total} asks held (held now: {len(held)})")  # see above
            if tag == "release":
                redis_client.xdel(stream, *[entry_id for entry_id, _ in redis_client.xrange(stream)])  # the learner read them
                read_at = time.monotonic()
            # every reply (a second one too): the last ask's hold, then 3 s, twice the 1.5 s the last answer may take
            got = _collect(socks, max(sent.values()) + hold_ms / 1000 + 3.0)
        finally:
            flooding.clear()
            pinging.join(15)  # the pinger sees `flooding` cleared after the ping in hand, which its 10 s deadline ends
        assert len(pings) >= 10 and max(pings) < 1.5, f"{len(pings)} pings during the flood, the slowest {max(pings):.3f} s"
        assert sorted(got) == sorted(sent), f"{len(set(sent) - set(got))} asks unanswered, {len(set(got) - set(sent))} strangers"
        twice = [rid for rid, replies in got.items() if len(replies) != 1]
        assert not twice, f"{len(twice)} asks answered more than once, e.g. {got[twice[0]]}"
        answers = {rid: replies[0] for rid, replies in got.items()}
        assert all(reply["task_id"] == task_of[rid] for rid, (reply, _) in answers.items())
        if tag == "expire":
            assert all(r["status"] == "wait" and r["reason"] == "stream_backlog" and r["retry_after_ms"] == 1 for r, _ in answers.values())
            held_for = sorted(at - sent[rid] for rid, (_, at) in answers.items())
            assert hold_ms / 1000 - 0.1 < held_for[0] and held_for[-1] < hold_ms / 1000 + 1.5, (held_for[0], held_for[-1])
            assert client.status()["counters"]["broker/ask_wait"] == waits + len(sent)
        else:
            assert all(r["status"] == "ok" for r, _ in answers.values())
            late = sorted(at - read_at for _, at in answers.values())
            assert late[-1] < 1.5, f"answered up to {late[-1]:.2f} s after the learner read, not at once"
            assert client.status()["counters"].get("broker/ask_wait", 0) == waits
        assert len(held) == 0
        over_the_backlog(client, task)  # for the next round
    assert client.status()["counters"].get("dropped/unroutable_replies", 0) == 0


def test_default_back_pressure_follows_the_limit_the_learner_publishes(start_broker, start_actor, make_client, redis_client, key_prefix):
    """max_stream_backlog -1 (the default): no limit until a learner publishes one, then `ask` waits above it."""
    broker, client = running(start_broker, start_actor, make_client, segment_len=1)
    assert broker.config.max_stream_backlog == -1
    task = client.attach()
    for n in range(4):  # one-step segments (each closed by the next step), nobody reading them
        client.step(task, obs(n))
        client.feedback(task, reward=0.0, done=False)
    assert client.status()["stream_length"] == 3
    assert client.ask(task)["status"] == "ok"
    redis_client.set(RedisKeys(key_prefix).learner_backlog, 2)  # what the learner writes after an update
    # the broker reads the learner's limit with its once-a-second session scan: at most 1 s alone. It was 5 s (x5): 15 s
    reply = wait_for(lambda: (r := client.ask(task))["status"] == "wait" and r, timeout=15, what="the broker to read the learner's limit")
    assert reply["reason"] == "stream_backlog"
    assert client.status()["stream_backlog_limit"] == 2
    redis_client.set(RedisKeys(key_prefix).learner_backlog, 10)  # a faster learner, or a longer lag bound
    wait_for(lambda: client.ask(task)["status"] == "ok", timeout=15, what="the broker to read the raised limit")  # as above
