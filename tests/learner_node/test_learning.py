"""The whole loop on a tiny model: broker, real actor, real learner. The rewarded action wins, and
stays the winner until the end of the run, with all weights trained and with a LoRA adapter."""

from __future__ import annotations

import threading
import time

import pytest

from actor_node.config import ActorConfig
from actor_node.main import run_actor
from common.redis_server import connect
from common.shared_settings import PolicySpec, StoreSettings
from learner_node.config import LearnerConfig
from learner_node.worker import Learner
from models.tiny_models import LORA_TRAINABLE
from tests.helpers import REDIS_S, actors_ready, wait_for
from tests.learner_node.helpers import BANDIT

UPDATES = 30  # the run's fixed budget of policy updates
LATE_VERSIONS = 10  # the policy is judged on every step served by its last 10 versions


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_bandit_through_broker_and_actor_learns_and_stays_learned(
    start_broker, make_client, tiny_models, redis_url, key_prefix, tmp_path, adapter
):
    # Back-pressure keeps the learner close to the actors: `ask` says wait while 24 segments are unread
    # (above the learner's rollout of 16 one-step segments, or neither side could move).
    broker = start_broker(max_stream_backlog=24)
    if adapter == "full":
        policy = PolicySpec(model=tiny_models["llama"], lora_rank=0, normalisation="token")
    else:  # rank-4 LoRA on every linear layer, the random tiny model's head and final norm trained beside it
        policy = PolicySpec(
            model=tiny_models["llama"], lora_rank=4, lora_alpha=8, lora_trainable=list(LORA_TRAINABLE["llama"]), normalisation="token"
        )
    learner_cfg = LearnerConfig(
        policy=policy,
        device="cpu",
        store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
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
        max_updates=UPDATES,
    )
    learner = Learner(learner_cfg, connect(redis_url, socket_timeout=REDIS_S))
    learner_thread = threading.Thread(target=learner.run, daemon=True)
    learner_thread.start()
    stop = threading.Event()
    actor_cfg = ActorConfig(
        broker=broker.backend,
        policy=policy,
        device="cpu",
        store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
        weights=learner.weights_endpoint,
        weights_poll_s=1.0,
        heartbeat_ms=100,
    )
    threading.Thread(target=run_actor, args=(actor_cfg, stop), daemon=True).start()
    # A step: a forward of the tiny model on the actor thread while the learner trains in this process too, 0.05-1 s
    # alone (x60). The actor thread loads the model and registers in 1-3 s alone (x20).
    client = make_client(broker.frontend, deadline=60)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the actor")
    task = client.attach()
    green = []
    # a safety net for a broken build, not the measure: the 30 updates and their steps take under 40 s alone (x10); the
    # suite's 300 s per-test timeout comes first
    deadline = time.monotonic() + 400
    try:  # the whole budget runs: the learner stops itself after UPDATES updates
        while learner_thread.is_alive() and time.monotonic() < deadline:
            if client.ask(task)["status"] == "wait":
                time.sleep(0.02)  # a tick of the loop above, which the deadline bounds
                continue
            reply = client.step(task, BANDIT)
            client.feedback(task, 1.0 if reply["action"] == 1 else 0.0, done=True)
            green.append((reply["policy_version"], reply["probs"][1]))
    finally:
        learner.stop()
        learner_thread.join(60)  # the learner ends its update in hand: 1-2 s alone; x30
        stop.set()
    assert learner.version == UPDATES, f"the learner made {learner.version} of {UPDATES} updates"
    assert green[0][1] < 0.6, "the untrained policy should not already prefer the rewarded action"
    late = [p for version, p in green if version > UPDATES - LATE_VERSIONS]
    assert len(late) >= 3 * LATE_VERSIONS, f"only {len(late)} steps served by the last {LATE_VERSIONS} versions"
    assert min(late) > 0.8 and sum(late) / len(late) > 0.9, (
        f"P(green) over the last {LATE_VERSIONS} versions: mean {sum(late) / len(late):.2f}, min {min(late):.2f}"
    )
    assert (tmp_path / "tb").exists() and any((tmp_path / "tb").iterdir())
