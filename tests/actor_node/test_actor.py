"""A real actor (tiny LLM) behind a real broker: serving, late joining, live weight swaps."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from actor_node.config import ActorConfig
from actor_node.llm_policy import LLMPolicy, SamplingConfig
from actor_node.main import run_actor
from common import weights
from common.shared_settings import PolicySpec, StoreSettings
from models.policy_model import ModelSpec, load_policy, policy_state_dict
from tests.helpers import OBS, TORCH_START_S, actors_ready, wait_for


@pytest.fixture
def start_llm_actor(tiny_models, redis_url, key_prefix):
    started = []

    def start(backend: str, weights_endpoint: str = "", poll_s: float = 30.0) -> threading.Event:
        cfg = ActorConfig(
            broker=backend,
            policy=PolicySpec(model=tiny_models["llama"], lora_rank=4, normalisation="token"),
            device="cpu",
            heartbeat_ms=100,
            store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
            weights=weights_endpoint,
            weights_poll_s=poll_s,
            prefix_cache_mb=16,
        )
        stop = threading.Event()
        thread = threading.Thread(target=run_actor, args=(cfg, stop), daemon=True)
        thread.start()
        started.append((stop, thread))
        return stop

    yield start
    for stop, thread in started:
        stop.set()
        thread.join(15)  # the actor ends its batch in hand and closes: under 0.5 s alone; x30 (a daemon thread)


# The waits of these tests: the actor thread loads the tiny model (torch already imported here) and registers in 1-3 s
# alone (60 s: x20); each step is a forward of it, 10-100 ms (the clients' 30 s deadline: x300); a snapshot is taken at
# the actor's next poll (0.2 s) and loaded in under 0.5 s (30 s: x60).


def actor_spec(tiny_models) -> ModelSpec:
    """The model the LLM actor above loads (its [policy]: a tiny model's head and norm train beside the adapter)."""
    return ModelSpec.of(PolicySpec(model=tiny_models["llama"], lora_rank=4), "cpu")


def new_snapshot(tiny_models, seed: int) -> dict[str, torch.Tensor]:
    """Adapter weights with a non-zero B, so the policy really changes."""
    model, _ = load_policy(actor_spec(tiny_models))
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in policy_state_dict(model).items()}


def expected_probs(tiny_models, state) -> list[float]:
    model, tok = load_policy(actor_spec(tiny_models))
    policy = LLMPolicy(model, tok, SamplingConfig(normalisation="token"), "per_candidate")
    if state is not None:
        policy.set_weights(state, 1, "run-a")
    return policy.choose_batch([{"job": 1, "obs": OBS}])[0].probs


def test_actor_serves_step_and_rag_step(broker, start_llm_actor, make_client):
    start_llm_actor(broker.backend)
    client = make_client(broker.frontend, deadline=30)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    task = client.attach()
    for op in ("step", "rag_step"):
        reply = client.request(op, task_id=task, obs=OBS)
        assert reply["policy_version"] == 0 and len(reply["probs"]) == 3
        assert sum(reply["probs"]) == pytest.approx(1.0, abs=1e-5)
        client.feedback(task, 1.0)


def test_late_joiner_starts_from_the_stored_snapshot(broker, start_llm_actor, make_client, redis_client, key_prefix, tiny_models):
    state = new_snapshot(tiny_models, seed=1)
    weights.store_snapshot(redis_client, key_prefix, 1, state, "lora")
    start_llm_actor(broker.backend)
    client = make_client(broker.frontend, deadline=30)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    reply = client.step(client.attach(), OBS)
    assert reply["policy_version"] == 1
    assert reply["probs"] == pytest.approx(expected_probs(tiny_models, state), abs=1e-5)


@pytest.mark.parametrize("via", ["pub", "redis_only"])
def test_weight_swap_mid_stream_never_mixes_versions(broker, start_llm_actor, make_client, redis_client, key_prefix, tiny_models, via):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    # With "redis_only" the actor has no announcement to hear: it must catch up from Redis.
    # poll_s 30 where the announcement must do it: no poll comes within the test
    start_llm_actor(broker.backend, f"tcp://127.0.0.1:{port}" if via == "pub" else "", poll_s=0.5 if via == "redis_only" else 30)
    client = make_client(broker.frontend, deadline=30)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    task = client.attach()
    old, state = expected_probs(tiny_models, None), new_snapshot(tiny_models, seed=2)
    new = expected_probs(tiny_models, state)
    replies = []
    for _ in range(3):
        replies.append(client.step(task, OBS))
        client.feedback(task, 0.0)
    ann = weights.store_snapshot(redis_client, key_prefix, 1, state, "lora")
    # The swap comes with the next announcement heard or poll (0.5 s), and a load of the snapshot: about 1 s alone. The
    # loop was bounded by 200 steps, 2-10 s alone; by time now: 60 s (x60)
    swap_by = time.monotonic() + 60
    while time.monotonic() < swap_by:
        weights.announce(pub, ann)  # repeated: a SUB may join late (the slow-joiner rule)
        replies.append(client.step(task, OBS))
        client.feedback(task, 0.0)
        if replies[-1]["policy_version"] == 1 and len([r for r in replies if r["policy_version"] == 1]) >= 3:
            break
    pub.close()
    versions = [r["policy_version"] for r in replies]
    assert versions[:3] == [0, 0, 0] and versions[-1] == 1
    assert versions == sorted(versions), "a reply after the swap must never carry the old version"
    for r in replies:
        assert r["probs"] == pytest.approx(old if r["policy_version"] == 0 else new, abs=1e-5), "probabilities of one version only"


def test_corrupt_snapshot_is_refused_and_serving_goes_on(broker, start_llm_actor, make_client, redis_client, key_prefix, tiny_models):
    state = new_snapshot(tiny_models, seed=3)
    ann = weights.store_snapshot(redis_client, key_prefix, 1, state, "lora")
    redis_client.hset(f"{key_prefix}:weights:latest", "checksum", "0" * 64)  # damaged in transit
    start_llm_actor(broker.backend, poll_s=0.2)
    client = make_client(broker.frontend, deadline=30)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    assert client.step(client.attach(), OBS)["policy_version"] == 0
    redis_client.hset(f"{key_prefix}:weights:latest", "checksum", ann.checksum)  # repaired: now it is taken
    task = client.attach()
    wait_for(
        lambda: client.step(task, OBS)["policy_version"] == 1 and client.feedback(task, 0.0),
        timeout=30,
        what="the actor to take the repaired snapshot",
    )


def test_a_snapshot_of_other_policy_settings_is_refused_and_serving_goes_on(
    broker, start_llm_actor, make_client, redis_client, key_prefix, tiny_models
):
    """An adapter made without the trainable head the actor's [policy] has: refused by name, version 0 served on."""
    model, _ = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=4, lora_trainable=()))
    weights.store_snapshot(redis_client, key_prefix, 1, policy_state_dict(model), "lora")
    start_llm_actor(broker.backend, poll_s=0.2)
    client = make_client(broker.frontend, deadline=30)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    task = client.attach()
    for _ in range(3):
        assert client.step(task, OBS)["policy_version"] == 0
        client.feedback(task, 0.0)
        time.sleep(0.3)  # past the actor's poll: it has tried the snapshot (not a deadline: a late try only passes wrongly)


@pytest.mark.slow
def test_ppoz_actor_command_serves_a_model(broker, make_client, tiny_models):
    import signal
    import subprocess

    from tests.processes import PPOZ

    proc = subprocess.Popen(
        [
            *PPOZ,
            "actor",
            "--model",
            tiny_models["gpt2"],
            "--broker",
            broker.backend,
            "--heartbeat-ms",
            "100",
            "--lora-rank",
            "0",
            "--name",
            "cli-llm",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = make_client(broker.frontend, deadline=60)
        # a `ppoz actor` process: torch, transformers and peft imported, the model loaded. It was 60 s (x6): TORCH_START_S
        wait_for(lambda: actors_ready(client, 1), timeout=TORCH_START_S, what="the actor process")
        task = client.attach()
        assert len(client.rag_step(task, OBS)["probs"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # PROCESS_STOP_S: its batch in hand, then exit
        assert "scoring path packed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_new_learner_run_is_followed_at_a_lower_version_and_every_transition_carries_its_stamp(
    broker, start_llm_actor, make_client, redis_client, key_prefix, tiny_models
):
    """A learner restarted without --resume counts from 0 again; its actors must serve its weights, not keep the old run's."""
    from common.segments import RedisKeys, Segment

    weights.store_snapshot(redis_client, key_prefix, 5, new_snapshot(tiny_models, seed=4), "lora", run="run-a")
    start_llm_actor(broker.backend, poll_s=0.2)
    client = make_client(broker.frontend, deadline=30)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    task = client.attach()

    def served(version: int) -> bool:
        reply = client.step(task, OBS)
        client.feedback(task, 0.0)
        return reply["policy_version"] == version

    wait_for(lambda: served(5), timeout=30, what="version 5 of run-a")
    weights.store_snapshot(redis_client, key_prefix, 1, new_snapshot(tiny_models, seed=5), "lora", run="run-b")
    wait_for(lambda: served(1), timeout=30, what="version 1 of run-b, although 1 < 5")
    client.detach(task)
    entries = redis_client.xrange(RedisKeys(key_prefix).stream)
    stamps = [(t.policy_version, t.policy) for _, fields in entries for t in Segment.from_entry(fields).transitions]
    assert stamps and all(policy is not None for _, policy in stamps)
    assert {policy["run"] for version, policy in stamps if version == 5} == {"run-a"}
    assert {policy["run"] for version, policy in stamps if version == 1} == {"run-b"}
    assert all(
        policy["normalisation"] == "token" and policy["lora_rank"] == 4 and policy["greedy"] is False and policy["path"]
        for _, policy in stamps
    )
