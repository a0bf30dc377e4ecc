"""The broker's side of rag_step: per-task history in Redis, the context an actor appends, and what is recorded.

The actor is the real serve loop on a real BrokerLink with the uniform policy; its
retrieval is a stand-in that appends a fixed context (the broker is under test here;
the real retrieval is tested in tests/actor_node/test_retrieval.py and tests/test_rag.py).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from actor_node.link import BrokerLink
from actor_node.policies import UniformPolicy
from actor_node.worker import serve
from broker.store import SessionStore
from client import InternalError
from common import protocol as p
from common.segments import RedisKeys
from common.shared_settings import RetrievalConfig
from tests.helpers import OBS, actors_ready, wait_for

CONTEXT = "\n\nRetrieved context (most relevant first):\n[doc guide.md#0] Back leaves the licence list.\n"


class FixedContext:
    """Retrieval stand-in: appends `context` to every rag_step prompt and remembers the history each job brought."""

    def __init__(self, context: str = CONTEXT) -> None:
        self.context = context
        self.histories: list[list[dict[str, Any]]] = []

    def augment_batch(self, jobs: list[dict[str, Any]]) -> dict[int, Exception]:
        for job in jobs:
            if job["mode"] == p.OP_RAG_STEP:
                self.histories.append(job["history"])
                job["obs"] = dict(job["obs"], prompt=job["obs"]["prompt"] + self.context)
                job.update(context=self.context, retrieved=["doc guide.md#0"])
        return {}


@pytest.fixture
def rag_actor(zmq_context):
    started = []

    def start(backend: str, retriever: Any = None) -> None:
        link = BrokerLink(backend, name="rag", credits=4, heartbeat_ms=100, context=zmq_context).start()
        stop = threading.Event()
        thread = threading.Thread(target=serve, args=(link, UniformPolicy(0), stop, 4, None, None, retriever), daemon=True)
        thread.start()
        started.append((link, stop, thread))

    yield start
    for link, stop, thread in started:
        stop.set()
        thread.join(10)  # serve() sees `stop` between its 0.1 s polls; x100 (a daemon thread)
        link.close()


def screen(i: int) -> dict[str, Any]:
    return dict(OBS, prompt=f"{OBS['prompt']} screen {i}")


def test_rag_step_records_prompt_plus_context_and_keeps_the_plain_prompt_as_history(
    start_broker, rag_actor, make_client, redis_client, key_prefix
):
    broker = start_broker(retrieval=RetrievalConfig(history_len=2))
    retriever = FixedContext()
    rag_actor(broker.backend, retriever)
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor")
    task, other = client.attach(), client.attach()
    store = SessionStore(redis_client, RedisKeys(key_prefix), "learners")
    for i in range(3):
        reply = client.rag_step(task, screen(i))
        assert reply["retrieved"] == ["doc guide.md#0"]
        pending = store.load_sessions(32)[task].pending
        assert pending.obs["prompt"] == screen(i)["prompt"] + CONTEXT  # what was scored is what is recorded
        assert pending.obs["action"] == screen(i)["action"]
        client.feedback(task, float(i))
    client.rag_step(other, screen(9))
    client.feedback(other, 5.0)
    # The history the actor got: the task's own plain prompts (context never nests), the last 2 only.
    assert retriever.histories[0] == []
    assert [(h["prompt"], h["reward"]) for h in retriever.histories[1]] == [(screen(0)["prompt"], 0.0)]
    assert [h["prompt"] for h in retriever.histories[2]] == [screen(0)["prompt"], screen(1)["prompt"]]
    assert retriever.histories[3] == []  # the other task starts with none of this one's
    kept = store.load_sessions(32, history_len=2)[task].history
    assert [(h["prompt"], h["reward"]) for h in kept] == [(screen(1)["prompt"], 1.0), (screen(2)["prompt"], 2.0)]
    assert all(CONTEXT not in h["prompt"] for h in kept)
    assert redis_client.llen(store.keys.history(task)) == 2  # trimmed in Redis too
    client.detach(task)
    assert not redis_client.exists(store.keys.history(task))  # gone with the session


def test_rag_step_without_retrieval_scores_the_plain_observation(start_broker, rag_actor, make_client, redis_client, key_prefix):
    broker = start_broker()
    rag_actor(broker.backend)  # no retriever: the uniform actor, or an actor with rag = false
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor")
    task = client.attach()
    assert client.rag_step(task, OBS)["retrieved"] == []
    assert "retrieved" not in client.step(task, OBS)
    assert SessionStore(redis_client, RedisKeys(key_prefix), "learners").load_sessions(32)[task].pending.obs == OBS


def test_a_context_over_the_limit_is_refused_and_nothing_is_recorded(start_broker, rag_actor, make_client, redis_client, key_prefix):
    broker = start_broker(rag_max_context_chars=10)
    rag_actor(broker.backend, FixedContext())
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor")
    task = client.attach()
    # retried to its deadline, then raised: the first answer, from an actor thread of this process, 10-100 ms alone; x20
    with pytest.raises(InternalError, match="invalid result"):
        client.request("rag_step", task_id=task, obs=OBS, deadline=2.0)
    assert SessionStore(redis_client, RedisKeys(key_prefix), "learners").load_sessions(32)[task].pending is None
    assert client.status()["counters"]["errors/bad_actor_result"] >= 1
