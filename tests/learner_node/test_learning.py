"""The whole loop on a tiny model: broker, real actor, real learner. The rewarded action wins."""

from __future__ import annotations

import threading
import time

import pytest

from actor_node.config import ActorConfig
from actor_node.main import run_actor
from common.redis_server import connect
from common.shared_settings import PolicySpec
from learner_node.config import LearnerConfig
from learner_node.worker import Learner
from tests.helpers import actors_ready, wait_for
from tests.learner_node.helpers import BANDIT


@pytest.mark.slow
def test_bandit_through_broker_and_actor_learns(start_broker, make_client, tiny_models, redis_url, key_prefix, tmp_path):
    # Back-pressure keeps the learner close to the actors: `ask` says wait while 24 segments are unread
    # (above the learner's rollout of 16 one-step segments, or neither side could move).
    broker = start_broker(max_stream_backlog=24)
    # All weights trained (--lora-rank 0), as for a tiny model; LoRA updates are covered in test_update.py.
    policy = PolicySpec(model=tiny_models["llama"], lora_rank=0, normalisation="token")
    learner_cfg = LearnerConfig(
        policy=policy,
        device="cpu",
        redis_url=redis_url,
        key_prefix=key_prefix,
        rollout_batch=16,
        policy_minibatch=8,
        micro_batch=8,
        update_epochs=4,
        policy_lr=1e-3,
        value_lr=1e-3,
        target_kl=0.0,
        ent_coef=0.0,
        weights_bind="tcp://127.0.0.1:*",
        checkpoint_dir=str(tmp_path / "ckpt"),
        tensorboard_dir=str(tmp_path / "tb"),
        max_updates=40,
    )
    learner = Learner(learner_cfg, connect(redis_url, socket_timeout=30))
    learner_thread = threading.Thread(target=learner.run, daemon=True)
    learner_thread.start()
    stop = threading.Event()
    actor_cfg = ActorConfig(
        broker=broker.backend,
        policy=policy,
        device="cpu",
        redis_url=redis_url,
        key_prefix=key_prefix,
        weights=learner.weights_endpoint,
        weights_poll_s=1.0,
        heartbeat_ms=100,
    )
    threading.Thread(target=run_actor, args=(actor_cfg, stop), daemon=True).start()
    client = make_client(broker.frontend, deadline=60)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the actor")
    task = client.attach()
    green = []
    deadline = time.monotonic() + 240
    try:
        while learner_thread.is_alive() and time.monotonic() < deadline:
            if client.ask(task)["status"] == "wait":
                time.sleep(0.02)
                continue
            reply = client.step(task, BANDIT)
            client.feedback(task, 1.0 if reply["action"] == 1 else 0.0, done=True)
            green.append((reply["policy_version"], reply["probs"][1]))
            if reply["probs"][1] > 0.9:
                break
    finally:
        learner.stop()
        learner_thread.join(60)
        stop.set()
    assert green[0][1] < 0.6, "the untrained policy should not already prefer the rewarded action"
    assert green[-1][1] > 0.9, f"after {learner.updates} updates P(green) is only {green[-1][1]:.2f}"
    assert learner.version <= 40 and green[-1][0] >= 1
    assert (tmp_path / "tb").exists() and any((tmp_path / "tb").iterdir())
