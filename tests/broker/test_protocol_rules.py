"""What docs/protocol.md states about replies, retries, timeouts and `status`, each through a real broker and Redis."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import msgpack
import pytest
import zmq

from actor_node.policies import UniformPolicy
from broker.metrics import COUNTERS
from broker.sessions import RECENT_REPLIES
from client.errors import BadRequest
from common import protocol as p
from tests.broker.test_broker import obs, raw_request, running, segments, stack  # noqa: F401 (stack: a fixture)
from tests.helpers import OBS, wait_for

ROOT = Path(__file__).resolve().parents[2]
GENERATE_LIMITS = {"max_new_tokens": 4096, "max_stop_strings": 8, "max_stop_chars": 256, "max_messages": 256}
DOC = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")


def request(ctx: zmq.Context, endpoint: str, body: dict | bytes) -> dict:
    reply = raw_request(ctx, endpoint, [b"", body if isinstance(body, bytes) else p.encode(body)])
    assert reply is not None, "a well-framed request must get a reply"
    return reply


# --- replies to bodies the broker cannot read in full -------------------------------------------
def test_the_rid_is_echoed_whenever_it_can_be_read(start_broker, make_client, zmq_context):
    """Too large, invalid UTF-8 elsewhere, an int key: the reply still names the request's rid and op."""
    broker = start_broker(max_message_bytes=2048)
    task = make_client(broker.frontend).attach()
    too_large = p.header("step", "big-1") | {"task_id": task, "obs": {**OBS, "prompt": "p" * 5000}}
    reply = request(zmq_context, broker.frontend, too_large)
    assert (reply["rid"], reply["op"], reply["error"]["code"]) == ("big-1", "step", p.E_TOO_LARGE), reply
    bad_utf8 = p.encode(p.header("step", b"\x00bin-rid") | {"task_id": task, "obs": {**OBS, "prompt": "XXXX"}})
    reply = request(zmq_context, broker.frontend, bad_utf8.replace(b"XXXX", b"\xff\xfe\xfd\xfc"))
    assert (reply["rid"], reply["op"], reply["error"]["code"]) == (b"\x00bin-rid", "step", p.E_BAD_REQUEST), reply
    int_key = p.encode({"proto": "ppoz", "v": 1, 7: "x", "op": "ask", "rid": "ik-1"})
    reply = request(zmq_context, broker.frontend, int_key)
    assert (reply["rid"], reply["op"], reply["error"]["code"]) == ("ik-1", "ask", p.E_BAD_REQUEST), reply


@pytest.mark.parametrize(
    "body, op",
    [
        (p.encode({"proto": "ppoz", "v": 1, "op": "ask", "task_id": "t"}), "ask"),  # no rid
        (p.encode(p.header("ask", "x" * 65)), "ask"),  # over 64 bytes
        (p.encode(p.header("ask", "é" * 33)), "ask"),  # 33 characters, 66 bytes
        (p.encode(p.header("ask", "")), "ask"),  # empty
        (p.encode(p.header("ask", 7)), "ask"),  # not a str or bin
        (p.encode(p.header("ask", "XX")).replace(b"XX", b"\xff\xfe"), "ask"),  # the rid itself is not UTF-8
        (p.encode(p.header("ask", "cut"))[:-2], "ask"),  # cut short inside the rid
        (p.encode([1, 2]), None),  # not a map: no op either
        (b"\xc1", None),  # not msgpack
    ],
    ids=["missing", "65-bytes", "66-utf8-bytes", "empty", "int", "bad-utf8", "truncated", "array", "garbage"],
)
def test_a_reply_to_a_body_without_a_readable_rid_has_nil_rid_and_is_an_error(broker, zmq_context, body, op):
    reply = request(zmq_context, broker.frontend, body)
    assert reply["rid"] is None and reply["op"] == op, reply
    assert reply["error"]["code"] == p.E_BAD_REQUEST and list(reply) == ["proto", "v", "op", "rid", "error"], reply


# --- idempotence: the task's last writes are kept, in Redis ------------------------------------
def test_a_step_rid_sent_again_after_its_feedback_gets_the_first_reply_and_scores_nothing(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    first = client.step(task, obs(0), rid="s-1")
    client.feedback(task, 1.0, rid="f-1")
    assert client.step(task, obs(0), rid="s-1") == first
    assert client.feedback(task, 1.0, rid="f-1")["status"] == "ok"  # its own first reply, not feedback_without_step
    status = client.status()
    assert status["pending_steps"] == 0, "the replayed step must not become a pending step again"
    counters = status["counters"]
    assert (counters["broker/steps"], counters["broker/feedbacks"], counters["broker/replayed"]) == (1, 1, 2), counters
    assert redis_client.llen(f"{key_prefix}:seg:{task}") == 1
    fields = redis_client.hkeys(f"{key_prefix}:task:{task}")
    assert {b"recent:0", b"recent:1"} <= set(fields) and b"last_rid" not in fields


def test_the_kept_replies_survive_a_broker_restart(start_broker, start_actor, make_client, redis_client, key_prefix):
    broker, client = running(start_broker, start_actor, make_client)
    task = client.attach()
    first = client.step(task, obs(0), rid="s-1")
    feedback = client.feedback(task, 1.0, rid="f-1")
    broker.stop()
    again, client = running(start_broker, start_actor, make_client, frontend=broker.frontend, backend=broker.backend)
    assert client.step(task, obs(0), rid="s-1") == first and client.feedback(task, 1.0, rid="f-1") == feedback
    assert client.status()["counters"]["broker/steps"] == 0 and client.status()["pending_steps"] == 0
    assert redis_client.llen(f"{key_prefix}:seg:{task}") == 1


def test_only_the_last_writes_are_kept_an_older_rid_is_a_new_request(stack, redis_client, key_prefix):
    """The documented bound: a step's rid older than the task's last RECENT_REPLIES writes is scored again."""
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0), rid="old")
    client.feedback(task, 0.0)
    for n in range(RECENT_REPLIES // 2):  # RECENT_REPLIES more writes
        client.step(task, obs(n + 1))
        client.feedback(task, 0.0)
    client.step(task, obs(0), rid="old")
    assert client.status()["counters"]["broker/steps"] == RECENT_REPLIES // 2 + 2 and client.status()["pending_steps"] == 1


def test_ask_is_answered_afresh_and_carries_the_task_id(start_broker, start_actor, make_client):
    broker = start_broker()
    client = make_client(broker.frontend)
    task = client.attach()
    first = client.request("ask", rid="k-1", task_id=task)
    assert (first["task_id"], first["status"], first["reason"]) == (task, "wait", "no_actor")
    start_actor(broker.backend)
    wait_for(lambda: client.status()["actors"], what="the actor")
    again = client.request("ask", rid="k-1", task_id=task)
    assert (again["task_id"], again["status"]) == (task, "ok"), "ask has no effect: a resent ask is answered now, not replayed"


# --- a step answered `timeout` never takes effect later -------------------------------------------
class GatedPolicy(UniformPolicy):
    """Answers only once `gate` is set (or after 20 s, so a failing test cannot hang the actor: the test sets it
    within a 200 ms deadline and a reply, well under a second alone)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.gate = threading.Event()

    def choose_batch(self, jobs):
        self.gate.wait(20)
        return super().choose_batch(jobs)


def test_a_step_answered_timeout_is_abandoned_its_late_result_dropped_and_a_retry_scored_afresh(
    start_broker, start_actor, make_client, zmq_context
):
    broker = start_broker()
    policy = GatedPolicy()
    start_actor(broker.backend, policy=policy)
    client = make_client(broker.frontend)
    wait_for(lambda: client.status()["actors"], what="the actor")
    task = client.attach()
    step = p.header("step", "slow-1") | {"task_id": task, "obs": obs(0), "deadline_ms": 200}  # the deadline under test
    reply = request(zmq_context, broker.frontend, step)
    assert reply["rid"] == "slow-1" and reply["error"]["code"] == p.E_TIMEOUT and "task_id" not in reply
    policy.gate.set()  # the actor now answers the abandoned job
    wait_for(lambda: client.status()["counters"]["jobs/late_results"] == 1, what="the late result to be dropped")
    status = client.status()
    assert status["pending_steps"] == 0 and status["counters"]["broker/steps"] == 0, "a late result must record nothing"
    again = client.step(task, obs(0), rid="slow-1")  # the same rid: a new scoring
    assert again["status"] == "ok" and client.status()["counters"]["broker/steps"] == 1


# --- status: limits, added_latency, counters, actors -------------------------------------------
def test_status_reports_the_limits_and_every_latency_key_before_any_sample(start_broker, make_client):
    broker = start_broker(max_actions=7, max_action_chars=100, max_prompt_chars=5000, max_message_bytes=65536)
    status = make_client(broker.frontend).status()
    assert status["limits"] == {
        "max_message_bytes": 65536,
        "max_actions": 7,
        "max_action_chars": 100,
        "max_prompt_chars": 5000,
        **GENERATE_LIMITS,
        "max_abs_reward": 1e6,
    }
    assert status["added_latency"] == {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    assert all(isinstance(status["added_latency"][k], float) for k in ("p50_ms", "p99_ms", "max_ms"))


def test_the_default_limits_are_the_documented_ones(broker, make_client):
    limits = make_client(broker.frontend).status()["limits"]
    assert limits == {
        "max_message_bytes": 4 * 1024 * 1024,
        "max_actions": 256,
        "max_action_chars": 4096,
        "max_prompt_chars": 1_000_000,
        **GENERATE_LIMITS,
        "max_abs_reward": 1e6,
    }
    for name, value in limits.items():
        assert f"| `{name}` | {value} |" in DOC, f"docs/protocol.md must give {name}'s default, {value}"


def test_status_has_every_counter_from_zero_and_the_actors_fields(stack):
    broker, client = stack
    status = client.status()
    assert set(status["counters"]) == set(COUNTERS)
    assert set(status["actors"][0]) == {"name", "credits", "inflight", "policy_version", "served"}
    assert set(status) >= {
        "status",
        "sessions",
        "pending_steps",
        "queued_jobs",
        "jobs",
        "stream_length",
        "stream_read",
        "storage_ok",
        "actors",
        "added_latency",
        "counters",
        "steps_per_s",
        "uptime_s",
        "learner",
        "limits",
    }


def test_every_counter_the_broker_counts_is_declared_and_documented():
    used: set[str] = set()
    for source in (ROOT / "broker").glob("*.py"):
        used |= set(re.findall(r"metrics\[\"([a-z_]+/[a-z_]+)\"\]", source.read_text(encoding="utf-8")))
    used |= {f"errors/{code}" for code in p.ERROR_CODES}  # counted as errors/{code}
    assert used and used <= set(COUNTERS), sorted(used - set(COUNTERS))
    undocumented = [name for name in COUNTERS if f"`{name}`" not in DOC]
    assert not undocumented, f"docs/protocol.md does not name these counters: {undocumented}"
    assert all(f"`{name}`" in DOC for name in ("name", "credits", "inflight", "policy_version", "served"))


# --- small rules of the replies -----------------------------------------------------------------
def test_detach_of_an_empty_segment_closes_none_and_says_so(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))  # pending, never fed back: the open segment holds no transition
    reply = client.detach(task)
    assert (reply["segments_closed"], reply["dropped_pending_step"]) == (0, True)
    assert segments(redis_client, key_prefix) == []


def test_an_integral_reward_is_accepted_and_stored_as_a_float(stack, redis_client, key_prefix):
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))
    assert client.request("feedback", task_id=task, reward=1, done=True)["status"] == "ok"  # msgpack int
    [segment] = segments(redis_client, key_prefix)
    assert segment.transitions[0].reward == 1.0 and isinstance(segment.transitions[0].reward, float)


def test_error_replies_carry_no_task_id(stack, zmq_context):
    broker, client = stack
    task = client.attach()
    reply = request(zmq_context, broker.frontend, p.header("feedback", "fw-1") | {"task_id": task, "reward": 1.0})
    assert reply["error"]["code"] == p.E_FEEDBACK_WITHOUT_STEP and "task_id" not in reply
    assert list(reply) == ["proto", "v", "op", "rid", "error"]


@pytest.mark.parametrize("next_obs", ["the home screen", [1, 2], 3, True, b"raw"])
def test_a_truncated_feedback_whose_next_obs_is_not_a_map_is_refused_and_the_step_still_waits(stack, next_obs):  # noqa: F811
    """docs/protocol.md: `next_obs` is a map or nil. A str, array, number or bin was accepted and dropped."""
    broker, client = stack
    task = client.attach()
    client.step(task, obs(0))
    fields = {"task_id": task, "reward": 0.0, "done": False, "truncated": True, "next_obs": next_obs}
    with pytest.raises(BadRequest, match=f"`next_obs` must be a map \\(an observation\\) or nil, got {type(next_obs).__name__}"):
        client.request(p.OP_FEEDBACK, **fields)
    assert client.feedback(task, 0.5, next_obs={})["status"] == "ok"  # the step had waited; Kea's empty map is ignored
    client.step(task, obs(1))
    assert client.feedback(task, 0.5, truncated=True, next_obs=obs(2))["status"] == "ok"


def test_the_error_vectors_are_what_the_broker_sends_byte_for_byte(broker, make_client, zmq_context):
    """docs/protocol.md's error examples for an unknown task's ask, an empty candidate, a float deadline_ms and a
    msgpack extension type: each request sent raw, its reply compared with conformance/vectors/NAME.msgpack."""
    vectors = ROOT / "conformance" / "vectors"
    client = make_client(broker.frontend)
    client.attach("emu-7")
    client.attach("qa-3")
    generate = {"task_id": "qa-3", "prompt": "hi", "sampling": {"max_new_tokens": 4}, "deadline_ms": 20000.0}
    timestamp = {"sent": msgpack.Timestamp(1_700_000_000, 0)}  # a field the broker would ignore, were it no extension
    sent = {
        "ask-error-2": p.encode(p.header("ask", "k2") | {"task_id": "emu-9"}),
        "step-error": p.encode(p.header("step", "s2") | {"task_id": "emu-7", "obs": {**OBS, "action": ["0: TouchEvent(Cart)", ""]}}),
        "generate-error-2": p.encode(p.header("generate", "g4") | generate),
        "ping-error": msgpack.packb(p.header("ping", "p2") | timestamp),
    }
    for name, body in sent.items():
        sock = zmq_context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(broker.frontend)
        try:
            sock.send_multipart([b"", body])
            assert sock.poll(5000), name  # REPLY_S: a broker thread's reply
            assert sock.recv_multipart()[-1] == (vectors / f"{name}.msgpack").read_bytes(), name
        finally:
            sock.close()
    assert client.status()["queued_jobs"] == 0  # none of them was queued
