"""PPOClient, Kea's HTTP client API over ZeroMQ: the loop Kea runs, reply shapes, its ValueErrors, what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from client import FeedbackWithoutStep, PPOClient, UnknownTask
from common import protocol as p
from common.segments import Segment
from tests.client.helpers import pick

KEA_OBS = {
    "prompt": "You are testing the app Shop. Visited pages: MainActivity. Views: [0] Cart [1] Search [2] BACK",
    "question": "Which action should I choose next? I shall choose No. ",
    "action": [
        "0: TouchEvent(state=4f1c, view=a2b3(MainActivity/TextView-Cart))",
        "1: TouchEvent(state=4f1c, view=9e8d(Search))",
        "2: KeyEvent(state=4f1c, name=BACK)",
    ],
}


@pytest.fixture
def ppo_client(zmq_context):
    """A PPOClient factory whose clients are closed at teardown."""
    made: list[PPOClient] = []

    def make(base_url: str, **kwargs) -> PPOClient:
        made.append(PPOClient(base_url=base_url, context=zmq_context, **kwargs))
        return made[-1]

    yield make
    for client in made:
        client.close()


def test_kea_loop_attach_ask_step_feedback_detach(serving, ppo_client, redis_client, key_prefix):
    broker, _ = serving(segment_len=4)
    client = ppo_client(broker.frontend, deadline=10, attempt_timeout=5)  # make_client's (tests/conftest.py)
    assert client.task_id is None
    task_id = client.attach()
    assert isinstance(task_id, str) and client.task_id == task_id
    actions = []
    for n in range(5):
        assert client.ask() == {"status": "ok"}
        obs = {**KEA_OBS, "prompt": f"{KEA_OBS['prompt']} step {n}"}
        reply = client.rag_step(obs) if n == 4 else client.step(obs)
        assert reply["task_id"] == task_id and reply["status"] == "ok"
        assert type(reply["action"]) is int and 0 <= reply["action"] < len(KEA_OBS["action"])
        assert reply["policy_version"] == 0 and reply["logprob"] <= 0
        assert not {"proto", "v", "op", "rid"} & set(reply), "the protocol header is not part of the HTTP reply shape"
        actions.append(reply["action"])
        # Kea sends done=False always, and next_obs={} (the older client) or nothing.
        ack = client.feedback(0.5 + 0.1 * n, False, next_obs={}) if n % 2 else client.feedback(0.5 + 0.1 * n, False)
        assert ack == {"status": "ok", "task_id": task_id, "segment_closed": False}
    assert client.detach() is None and client.task_id is None
    segments = [Segment.from_entry(f) for _, f in redis_client.xrange(f"{key_prefix}:segments")]
    assert [(s.reason, len(s.transitions)) for s in segments] == [("length", 4), ("detach", 1)]
    transitions = [t for s in segments for t in s.transitions]
    assert [t.action for t in transitions] == actions
    assert [t.reward for t in transitions] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    assert transitions[-1].mode == "rag_step"


def test_ask_reports_back_pressure(start_broker, ppo_client):
    broker = start_broker()  # no actor
    client = ppo_client(broker.frontend)
    client.attach()
    reply = client.ask()
    assert reply["status"] == "wait" and reply["reason"] == "no_actor" and reply["retry_after_ms"] > 0


def test_numpy_rewards_and_flags_are_sent_as_plain_numbers(serving, ppo_client, redis_client, key_prefix):
    broker, _ = serving()
    client = ppo_client(broker.frontend)
    task_id = client.attach()
    client.step(pick(2))
    assert client.feedback(np.float32(0.25), np.bool_(False))["status"] == "ok"
    [stored] = [p.decode(x) for x in redis_client.lrange(f"{key_prefix}:seg:{task_id}", 0, -1)]
    assert stored["reward"] == 0.25 and stored["done"] is False


def test_a_real_next_obs_reaches_the_broker_with_truncated(serving, ppo_client, redis_client, key_prefix):
    broker, _ = serving()
    client = ppo_client(broker.frontend)
    client.attach()
    client.step(pick(1))
    assert client.feedback(0.5, False, next_obs=pick(9), truncated=True)["segment_closed"] is True
    [segment] = [Segment.from_entry(f) for _, f in redis_client.xrange(f"{key_prefix}:segments")]
    assert segment.reason == "truncated" and segment.next_obs.prompt == pick(9)["prompt"]


def test_protocol_errors_raise_their_exceptions(serving, ppo_client):
    broker, probe = serving()
    client = ppo_client(broker.frontend)
    task_id = client.attach()
    with pytest.raises(FeedbackWithoutStep):
        client.feedback(0.5, False)
    probe.detach(task_id)  # the session is gone (as after its TTL)
    with pytest.raises(UnknownTask):
        client.step(KEA_OBS)
    assert client.task_id == task_id


def test_calls_before_attach_raise_the_original_value_errors(ppo_client):
    client = ppo_client("tcp://127.0.0.1:1")  # never contacted
    with pytest.raises(ValueError, match=r"^No task_id to detach\.$"):
        client.detach()
    for call in (lambda: client.step(KEA_OBS), lambda: client.rag_step(KEA_OBS), lambda: client.feedback(0.5, False), client.ask):
        with pytest.raises(ValueError, match=r"^Task not attached\.$"):
            call()
    assert client.client.attempts == 0, "nothing may be sent for a call that cannot succeed"


@pytest.mark.parametrize("url", ["http://localhost:8000", "https://ppo.example.org", "HTTP://LOCALHOST:8000"])
def test_http_urls_are_refused_naming_the_value(url):
    with pytest.raises(ValueError, match="speaks ZeroMQ") as info:
        PPOClient(base_url=url)
    assert repr(url) in str(info.value)


def test_a_url_without_a_scheme_is_refused():
    with pytest.raises(ValueError, match="'localhost:5555'"):
        PPOClient(base_url="localhost:5555")


def test_generate_writes_a_response_and_takes_its_reward(start_broker, start_actor, ppo_client, tiny_models, redis_client, key_prefix):
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from models.policy_model import ModelSpec, load_policy
    from tests.helpers import wait_for

    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    broker = start_broker(segment_len=1)
    start_actor(broker.backend, policy=LLMPolicy(model, tokenizer, SamplingConfig()))
    client = ppo_client(broker.frontend)
    with pytest.raises(ValueError, match="not attached"):
        client.generate("Describe the screen")
    client.attach()
    wait_for(lambda: client.ask()["status"] == "ok", timeout=30, what="the actor")  # a loaded actor thread registering: 0.1-0.3 s; x100
    reply = client.generate("Describe the screen", max_new_tokens=4, temperature=0.5)
    assert set(reply) == {"task_id", "status", "text", "n_tokens", "finish_reason", "logprob", "policy_version"}
    assert reply["n_tokens"] == 4 and reply["finish_reason"] == "length"
    client.feedback(np.float32(0.5), np.bool_(True))
    (seg,) = wait_for(lambda: [Segment.from_entry(f) for _, f in redis_client.xrange(f"{key_prefix}:segments")], what="the segment")
    assert seg.transitions[0].mode == p.OP_GENERATE and seg.transitions[0].reward == 0.5
