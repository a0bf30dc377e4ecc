"""Asynchronous PPO: what the learner computes from samples an older (or the same) policy produced.

- On-policy data re-scored through the learner's real path (Learner.step on a real Redis
  stream) gives the actor's log-probs back: GPT-2's dropout is off in the learner, and an
  actor on another scoring path agrees with the learner's packed path.
- Stale data (lag 1 to 4) is trained on, not dropped: the decoupled objective clips
  against the learner's own weights, so the first minibatch's ratio is 1 and the update
  takes its optimizer steps; plain PPO against the behaviour policy stops after one.
- A transition from a version ahead of the learner's (another run) is dropped and counted.
"""

from __future__ import annotations

import math

import pytest
import torch

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from broker.sessions import SegmentClose, Session
from broker.store import Batch, SessionStore
from common import segments as seg
from common.segments import CandidateObservation, RedisKeys, Transition
from common.shared_settings import PolicySpec, StoreSettings
from learner_node.config import LearnerConfig, UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.rollout import build_rollout, candidate_update
from learner_node.worker import Learner, backlog_limit
from models.policy_model import ModelSpec, load_policy
from tests.learner_node.helpers import on_policy_segments

PROMPTS = [
    {"prompt": "Pick the best colour.", "question": " Answer: ", "action": ["red", "green", "blue"]},
    {"prompt": "Screen: Settings. Views: Wi-Fi, Display.", "question": " Next action: ", "action": ["tap Wi-Fi", "tap Display", "back"]},
    {"prompt": "Which fruit is yellow?", "question": " I choose ", "action": ["a banana", "an apple", "a plum", "grapes"]},
]


def actor_transitions(model_dir: str, dtype: str, path: str, n: int, version: int = 0) -> list[Transition]:
    """n steps chosen by the actor's own policy code on its own copy of the model, loaded as an actor loads it."""
    torch.manual_seed(1)  # the actor's adapter initialisation differs from the learner's; B = 0 makes both the identity
    model, tokenizer = load_policy(ModelSpec(model=model_dir, device="cpu", dtype=dtype, lora_rank=4))
    actor = LLMPolicy(model, tokenizer, SamplingConfig(normalisation="token", seed=3), path, policy_version=version)
    jobs = [{"job": i, "task_id": f"t{i}", "obs": PROMPTS[i % len(PROMPTS)]} for i in range(n)]
    with torch.inference_mode():
        choices = actor.choose_batch(jobs)
    return [
        Transition(
            obs=CandidateObservation.from_wire(job["obs"]),
            action=c.action,
            logprob=c.logprob,
            probs=c.probs,
            policy_version=version,
            mode="step",
            reward=float(c.action == 1),
            done=True,
            truncated=False,
        )
        for job, c in zip(jobs, choices, strict=True)
    ]


def write_to_stream(redis_client, prefix: str, transitions: list[Transition], per_segment: int = 1) -> None:
    """Segments of `per_segment` transitions (one task each), closed by the broker's own store code into the stream."""
    store = SessionStore(redis_client, RedisKeys(prefix), "learners")
    store.ensure_stream()
    batch = Batch()
    for start in range(0, len(transitions), per_segment):
        session = Session(f"emu-{start}", segment_len=per_segment)
        chunk = transitions[start : start + per_segment]
        for t in chunk:
            batch.add("RPUSH", store.keys.open_segment(session.task_id), seg.pack(t.to_wire()))
        last = chunk[-1]
        close = SegmentClose(
            session.task_id, session.seq, "done" if last.done else "length", last.done, False, None if last.done else last.obs, len(chunk)
        )
        store.stage_close(batch, session, close)
    store.apply(batch)


def learner_on(model_dir: str, dtype: str, redis_url: str, redis_client, prefix: str, tmp_path, n: int, **overrides) -> Learner:
    settings = dict(
        policy=PolicySpec(model=model_dir, lora_rank=4, normalisation="token", dtype=dtype),
        device="cpu",
        store=StoreSettings(redis_url=redis_url, key_prefix=prefix),
        rollout_batch=n,
        policy_minibatch=n,
        micro_batch=4,
        update_epochs=1,
        weights_bind="tcp://127.0.0.1:*",
        checkpoint_dir=str(tmp_path / "ckpt"),
        tensorboard_dir="",
        read_block_ms=100,
    )
    cfg = LearnerConfig(**{**settings, **overrides})
    learner = Learner(cfg, redis_client)
    learner.start()
    return learner


def durably(learner: Learner) -> None:
    """What `learner.step()` trained into a checkpoint on disk and acknowledged now, as the learner does by cadence
    (learner_node/checkpointer.py) and before it stops."""
    learner.checkpoint_all()
    learner.owed.settle()


# The actor's log-probs come back to float rounding: float32 sums of a few token log-probs;
# bfloat16 carries 8 significant bits, and actor and learner batch (pad) differently.
TOLERANCE = {"float32": 1e-4, "bfloat16": 4e-3}  # bfloat16: one unit in the last place at 1.0 is 2**-8


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,dtype,actor_path",
    [
        ("gpt2", "float32", "packed"),
        ("gpt2", "float32", "per_candidate"),
        ("llama", "float32", "kv_batch"),
        ("gpt2", "bfloat16", "packed"),
        ("llama", "bfloat16", "per_candidate"),
    ],
)
def test_the_learner_rescores_on_policy_data_as_the_actor_scored_it(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path, arch, dtype, actor_path
):
    """GPT-2's config has dropout 0.1: a learner in train mode re-scores with noise (|dlogp| ~ 0.03)."""
    n = 12
    transitions = actor_transitions(tiny_models[arch], dtype, actor_path, n)
    write_to_stream(redis_client, key_prefix, transitions)
    learner = learner_on(tiny_models[arch], dtype, redis_url, redis_client, key_prefix, tmp_path, n)
    try:
        metrics = learner.step()
    finally:
        learner.close()
    assert metrics is not None and learner.counters["transitions_trained"] == n
    assert metrics["losses/on_policy_logprob_dev"] < TOLERANCE[dtype], metrics["losses/on_policy_logprob_dev"]
    assert metrics["losses/first_minibatch_ratio_dev"] < TOLERANCE[dtype]
    assert metrics["losses/kl_behaviour"] < TOLERANCE[dtype] ** 2 * 10


def moved_policy(model_dir: str) -> tuple[LearnerPolicy, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A learner whose weights have moved away from the initial policy (several large steps toward "green")."""
    torch.manual_seed(0)
    model, tok = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tok, "token", 1.0, [32, 16])
    popt = torch.optim.Adam(lp.trainable_parameters(), lr=3e-2)
    vopt = torch.optim.Adam(lp.value_head.parameters(), lr=1e-3)
    return lp, popt, vopt


def stale_rollout(lp: LearnerPolicy, segments, lag: int, max_policy_lag: int = 8):
    def value_of(observations):
        return lp.values(observations)[1].tolist()

    return build_rollout(segments, value_of, 0.99, 0.95, current_version=lag, max_policy_lag=max_policy_lag)


@pytest.mark.parametrize("lag", [1, 2, 4])
def test_stale_samples_are_trained_on_and_the_update_takes_its_steps(tiny_models, lag):
    lp, popt, vopt = moved_policy(tiny_models["llama"])
    # The behaviour data: sampled by the initial weights (version 0), before the learner moved.
    behaviour = on_policy_segments(lp.model, lp.tokenizer, 16, version=0)
    warm = UpdateConfig(update_epochs=3, policy_minibatch=4, micro_batch=4, target_kl=None, ent_coef=0.0)
    candidate_update(lp, popt, vopt, stale_rollout(lp, on_policy_segments(lp.model, lp.tokenizer, 16, seed=9), 0), warm)
    rollout = stale_rollout(lp, behaviour, lag)
    assert len(rollout) == 16 and rollout.dropped_stale == 0 and set(rollout.lags) == {lag}

    cfg = UpdateConfig(update_epochs=2, policy_minibatch=4, micro_batch=4, target_kl=0.02)
    decoupled = candidate_update(lp, popt, vopt, rollout, cfg)
    assert decoupled["losses/kl_behaviour"] > 0.02  # the learner has really moved away from the behaviour policy
    assert decoupled["losses/first_minibatch_ratio_dev"] < 1e-5  # clipped against its own weights: ratio 1 at the start
    assert decoupled["losses/optimizer_steps"] >= 2  # not stopped by the lag it inherited
    assert decoupled["losses/behaviour_weight"] != pytest.approx(1.0)  # and the behaviour correction is applied
    assert math.isnan(decoupled["losses/on_policy_logprob_dev"])  # nothing here is on-policy


def test_plain_ppo_on_the_same_stale_samples_stops_after_one_step(tiny_models):
    """Today's rule, for contrast: the ratio against the behaviour policy carries the lag, target-KL fires at once."""
    lp, popt, vopt = moved_policy(tiny_models["llama"])
    behaviour = on_policy_segments(lp.model, lp.tokenizer, 16, version=0)
    warm = UpdateConfig(update_epochs=3, policy_minibatch=4, micro_batch=4, target_kl=None, ent_coef=0.0)
    candidate_update(lp, popt, vopt, stale_rollout(lp, on_policy_segments(lp.model, lp.tokenizer, 16, seed=9), 0), warm)
    plain = candidate_update(
        lp, popt, vopt, stale_rollout(lp, behaviour, 2), UpdateConfig(update_epochs=2, policy_minibatch=4, micro_batch=4, objective="ppo")
    )
    assert plain["losses/early_stop"] == 1.0 and plain["losses/optimizer_steps"] == 1
    assert plain["losses/first_minibatch_ratio_dev"] > 0.1


def test_a_transition_from_a_version_ahead_of_the_learner_is_dropped_and_counted(tiny_models):
    lp, _, _ = moved_policy(tiny_models["llama"])
    segments = on_policy_segments(lp.model, lp.tokenizer, 3, version=5)
    segments += on_policy_segments(lp.model, lp.tokenizer, 2, version=3)
    rollout = stale_rollout(lp, segments, lag=3)  # the learner is at version 3: version 5 is another run's
    assert rollout.dropped_mismatched == 3 and len(rollout) == 2 and rollout.dropped_stale == 0
    assert rollout.stored == len(rollout) + rollout.dropped_mismatched


@pytest.mark.slow
def test_an_update_holds_about_rollout_batch_transitions_not_segments(tiny_models, redis_url, redis_client, key_prefix, tmp_path):
    """rollout_batch counts transitions; the stream's COUNT counts segments (here of 4 transitions each)."""
    transitions = actor_transitions(tiny_models["llama"], "float32", "packed", 48)
    write_to_stream(redis_client, key_prefix, transitions, per_segment=4)  # 12 segments
    learner = learner_on(tiny_models["llama"], "float32", redis_url, redis_client, key_prefix, tmp_path, 10, micro_batch=8)
    try:
        sizes = []
        for _ in range(3):
            assert learner.step() is not None
            sizes.append(learner.counters["transitions_stored"] - sum(sizes))
    finally:
        learner.close()
    assert all(10 <= size <= 10 + 4 - 1 for size in sizes), sizes  # within one segment of rollout_batch (was 40: 10 segments)
    # the back-pressure limit it publishes for the broker, in transitions: lag 8 / 2 = 4 rollouts of 10, less the one
    # being trained; what waits for its checkpoint is no longer in it (the broker counts only unread entries)
    assert int(redis_client.get(RedisKeys(key_prefix).learner_backlog)) == 30


def test_the_backlog_limit_is_half_the_lag_bound_less_the_rollout_in_training_and_at_least_one_rollout():
    assert backlog_limit(rollout_batch=64, max_policy_lag=8) == 192  # 4 versions less the one training, x 64 transitions
    assert backlog_limit(rollout_batch=64, max_policy_lag=9) == 192  # half the bound, rounded down
    assert backlog_limit(rollout_batch=16, max_policy_lag=4) == 16  # never fewer than one rollout: the next one
    assert backlog_limit(rollout_batch=16, max_policy_lag=0) == 16


def critic_error_after_updates(model_dir: str, cfg: UpdateConfig, updates: int) -> float:
    """|V(s) - 5| after `updates` critic-only updates on one-step episodes that all return 5, with the
    learner's default value head and critic learning rate."""
    defaults = LearnerConfig(policy=PolicySpec(model=model_dir), store=StoreSettings(redis_url="redis://unused"))
    model, tok = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tok, "token", 1.0, defaults.value_hidden)
    popt = torch.optim.Adam(lp.trainable_parameters(), lr=defaults.resolved_policy_lr())
    vopt = torch.optim.Adam(lp.value_head.parameters(), lr=defaults.value_lr)
    segments = on_policy_segments(lp.model, lp.tokenizer, 16)
    for s in segments:
        s.transitions[0].reward = 5.0
    for i in range(updates):
        candidate_update(lp, popt, vopt, stale_rollout(lp, segments, 0), cfg, train_policy=False, update_index=i)
    values = lp.values([s.transitions[0].obs for s in segments])[1]
    return float((values - 5.0).abs().max())


def test_the_critic_converges_on_constant_returns_of_about_five(tiny_models):
    """With the defaults (8 critic epochs on cached features at lr 1e-3, no value clipping) the critic reaches
    returns of 5 within 6 updates, from an untrained head that predicts about 0."""
    torch.manual_seed(0)
    assert critic_error_after_updates(tiny_models["llama"], UpdateConfig(), updates=0) > 4.0
    torch.manual_seed(0)
    assert critic_error_after_updates(tiny_models["llama"], UpdateConfig(), updates=6) < 0.25
