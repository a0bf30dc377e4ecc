"""rag_step through the real broker, a real LLM actor with retrieval and Redis, checked on what the learner trains on.

The retrieval math (chunking, ranking a relevant chunk first, the token budget,
adapter off while embedding) is tested in tests/actor_node/test_retrieval.py;
here: the history of one task never reaches another's prompt, the budget holds
in what is recorded, and the recorded observation is the one scored, so the
learner's first minibatch has ratio 1.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from actor_node.link import BrokerLink
from actor_node.llm_policy import LLMPolicy, SamplingConfig
from actor_node.rag import Retriever
from actor_node.retrieval import CONTEXT_HEADER
from actor_node.worker import serve
from broker.store import SessionStore
from common.segments import CandidateObservation, RedisKeys, Segment
from common.shared_settings import RetrievalConfig
from learner_node.config import UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.rollout import build_rollout, candidate_update
from models.policy_model import ModelSpec, load_policy
from tests.helpers import actors_ready, wait_for

GUIDE = """# Checkout screen
The checkout screen has a Pay button and a Coupon field. Entering coupon SAVE10 opens the discount dialog.

# Settings screen
Settings holds Language, Notifications and About. About opens the licence list, a tarpit: only Back leaves it.
"""
FILLER = "Unrelated notes about the weather, gardening and the history of tea. " * 40


def obs(marker: str, i: int) -> dict[str, Any]:
    return {
        "prompt": f"Task {marker}. Screen {i}: checkout with Pay and Coupon. Events so far: {marker}-{i}.",
        "question": " Next event:",
        "action": [" click Pay", " type Coupon", " press Back"],
    }


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "guide.md").write_text(GUIDE)
    (folder / "filler.txt").write_text(FILLER)
    return folder


def start_rag_actor(backend: str, tiny_model: str, corpus, budget: int, zmq_context) -> tuple[Any, Any, threading.Event, threading.Thread]:
    torch.manual_seed(0)
    model, tokenizer = load_policy(ModelSpec(model=tiny_model, device="cpu", lora_rank=4))
    policy = LLMPolicy(model, tokenizer, SamplingConfig(normalisation="token", seed=0), "packed")
    retriever = Retriever(
        RetrievalConfig(corpus_dir=str(corpus), chunk_tokens=48, chunk_overlap=8, top_k=4, max_context_tokens=budget), model, tokenizer
    )
    link = BrokerLink(backend, name="rag", credits=8, heartbeat_ms=100, context=zmq_context).start()
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(link, policy, stop, 8, None, None, retriever), daemon=True)
    thread.start()
    return retriever, link, stop, thread


def play(client, marker: str, steps: int) -> tuple[str, list[dict[str, Any]]]:
    task = client.attach()
    replies = []
    for i in range(steps):
        replies.append(client.rag_step(task, obs(marker, i)))
        client.feedback(task, 1.0 if i % 2 else 0.0, done=i == steps - 1)
    return task, replies


def stream_segments(redis_client, key_prefix: str) -> list[dict[str, Any]]:
    return [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{key_prefix}:segments")]


@pytest.mark.slow
def test_rag_step_history_stays_in_its_task_the_budget_holds_and_the_learner_sees_ratio_one(
    start_broker, make_client, tiny_models, corpus, redis_client, key_prefix, zmq_context
):
    budget = 160
    broker = start_broker(retrieval=RetrievalConfig(history_len=4))
    retriever, link, stop, thread = start_rag_actor(broker.backend, tiny_models["llama"], corpus, budget, zmq_context)
    try:
        # a rag_step of the tiny model with retrieval on an actor thread of this process: 0.1-0.5 s alone (x100); the
        # actor registers on 0.1 s heartbeats, its model loaded already (x100 and more)
        alpha, bravo = make_client(broker.frontend, deadline=60), make_client(broker.frontend, deadline=60)
        wait_for(lambda: actors_ready(alpha, 1), timeout=60, what="the rag actor")
        # The two tasks play at once, so their jobs share the actor's batches.
        played: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        threads = [
            threading.Thread(target=lambda c=c, m=m: played.__setitem__(m, play(c, m, 6))) for c, m in ((alpha, "ALPHA"), (bravo, "BRAVO"))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)  # 12 steps: 2-5 s alone; x24
        (task_a, replies_a), (task_b, _) = played["ALPHA"], played["BRAVO"]
        # Both tasks' history is in Redis while they are attached (and would come back after a broker restart).
        store = SessionStore(redis_client, RedisKeys(key_prefix), "learners")
        sessions = store.load_sessions(32)
        assert [h["prompt"] for h in sessions[task_a].history] == [obs("ALPHA", i)["prompt"] for i in range(2, 6)]  # the last 4
        assert all("BRAVO" not in h["prompt"] for h in sessions[task_a].history)
        alpha.detach(task_a)
        bravo.detach(task_b)
    finally:
        stop.set()
        thread.join(30)  # serve() sees `stop` after its batch in hand: under 0.5 s alone; x60 (a daemon thread)
        link.close()
    assert retriever.jobs == 12
    assert all(r["retrieved"] for r in replies_a[1:])  # the reply names what was put into the prompt
    assert any(label.startswith("history") for r in replies_a[1:] for label in r["retrieved"])

    segments = stream_segments(redis_client, key_prefix)
    by_task = {s.task_id: s.transitions for s in segments}
    tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))[1]
    for task, marker, other in ((task_a, "ALPHA", "BRAVO"), (task_b, "BRAVO", "ALPHA")):
        assert len(by_task[task]) == 6
        for i, t in enumerate(by_task[task]):
            raw = obs(marker, i)
            assert t.mode == "rag_step"
            assert t.obs.prompt.startswith(raw["prompt"]) and t.obs.action == raw["action"]
            assert other not in t.obs.prompt, f"{other}'s history reached {marker}'s prompt"
            block = t.obs.prompt[len(raw["prompt"]) :]
            assert CONTEXT_HEADER in block  # the corpus alone always has something to offer
            assert len(tokenizer.encode(block, add_special_tokens=False)) <= budget
    # Corpus chunks reach the prompt (which ones rank first is tested with a meaningful embedder in test_retrieval.py;
    # this model's weights are random).
    assert any("[doc " in t.obs.prompt for t in by_task[task_a]) and any("[doc " in t.obs.prompt for t in by_task[task_b])

    # The learner recomputes what the actor sampled from: ratio 1 on the first minibatch.
    torch.manual_seed(0)
    model, tok = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tok, "token", 1.0, [32, 16])
    # Had the broker recorded the client's plain observation, the learner would score another function.
    with torch.no_grad():
        items = [lp.tokenize(CandidateObservation.from_wire(obs("ALPHA", i))) for i in range(len(by_task[task_a]))]
        plain = [lp.logp_all([item])[0][t.action].item() for item, t in zip(items, by_task[task_a])]
    assert max(abs(a - t.logprob) for a, t in zip(plain, by_task[task_a])) > 1e-3

    def value_of(observations):
        return lp.values(observations)[1].tolist()

    rollout = build_rollout(segments, value_of, 0.99, 0.95, current_version=0, max_policy_lag=0)
    assert len(rollout) == 12
    metrics = candidate_update(
        lp,
        torch.optim.Adam(lp.trainable_parameters(), lr=1e-3),
        torch.optim.Adam(lp.value_head.parameters()),
        rollout,
        UpdateConfig(update_epochs=1, policy_minibatch=12, micro_batch=12, target_kl=None),
    )
    assert metrics["losses/on_policy_logprob_dev"] < 1e-4  # the learner re-scores the augmented prompt as the actor did
