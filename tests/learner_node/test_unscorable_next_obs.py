"""A segment's next observation the learner cannot score does not stop its update (issue 30, "bounded under abuse").

A client's `feedback` may carry a `next_obs` that the broker checks for types and sizes only (up to 1,000,000
characters of prompt); the actor never scores it, the learner's critic does, to bootstrap the segment's last
transition. One that tokenizes to nothing (an empty prompt + question and a tokenizer that adds no BOS, as
GPT-2's) raised ScoringError, and one past the model's positions was fed whole to it (an IndexError on GPT-2's
learned position table, attention memory quadratic in its length on RoPE models): the whole update failed, and
the learner, restarted, read the same pending entries first and failed again. Now such a segment is trained as
truncated with no successor (its last transition dropped, counted `dropped_truncated` and, of those,
`dropped_unscorable_next_obs`), the rest of the batch as before, and the model never sees the over-long context.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from broker.sessions import SegmentClose, Session
from broker.store import Batch, SessionStore
from common import learner_figures
from common.segments import CandidateObservation, GenerateObservation, RedisKeys, Segment, Transition, pack
from learner_node import trainer as trainer_module
from learner_node.rollout import Rollout, build_rollout
from learner_node.token_update import build_generation_batch
from learner_node.worker import Learner
from models import scoring
from tests.learner_node.test_async_ppo import durably, learner_on
from tests.learner_node.test_generation_update import gen_transition

BANDIT = {"prompt": "Pick the best colour.", "question": " Answer: ", "action": ["red", "green", "blue"]}
FINE_NEXT = {"prompt": "Pick the best fruit.", "question": " Answer: ", "action": ["red", "green"]}
LIMIT = 128  # the tiny models' positions in the length cases
# With the byte tokenizer (BOS + one token per character) and candidates "red" (3 tokens) and "green" (5):
# 122 characters are 123 context tokens, + 5 = 128 positions: just fits; 124 are 125 + "red"'s 3 = 128, but
# + "green"'s 5 = 130: the longest candidate decides.
AT_THE_LIMIT = {"prompt": "x" * 122, "question": "", "action": ["red", "green"]}
PAST_THE_LIMIT = {"prompt": "x" * 124, "question": "", "action": ["red", "green"]}
HUGE = {"prompt": "word " * 199_800, "question": "", "action": ["red"]}  # 999,000 characters: within the broker's limit


def step(obs: dict[str, Any], reward: float, done: bool = False) -> Transition:
    scored = CandidateObservation.from_wire(obs)
    return Transition(
        obs=scored, action=1, logprob=-1.0986, probs=[1 / 3] * 3, policy_version=0, reward=reward, done=done, truncated=False, mode="step"
    )


def write(redis_client, prefix: str, task: str, transitions: list[Transition], reason: str, next_obs: dict[str, Any] | None) -> str:
    """One segment closed by the broker's own store code into the stream; its id."""
    store = SessionStore(redis_client, RedisKeys(prefix), "learners")
    store.ensure_stream()
    batch = Batch()
    session = Session(task, segment_len=len(transitions))
    for t in transitions:
        batch.add("RPUSH", store.keys.open_segment(session.task_id), pack(t.to_wire()))
    close = SegmentClose(session.task_id, session.seq, reason, reason == "done", reason == "truncated", next_obs, len(transitions))
    store.stage_close(batch, session, close)
    store.apply(batch)
    return close.seg_id


def without_bos(model_dir: str, to: Path) -> str:
    """A copy of a tiny model whose tokenizer adds no BOS (as GPT-2's): an empty context tokenizes to nothing."""
    shutil.copytree(model_dir, to)
    spec = json.loads((to / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (to / "tokenizer.json").write_text(json.dumps(spec))
    return str(to)


class Spy:
    """What the learner's critic was asked and answered (its trainer's `values`), and the rollouts it built."""

    def __init__(self, learner: Learner, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked: list[tuple[list[CandidateObservation], list[float | None]]] = []
        self.rollouts: list[Rollout] = []
        self.longest = 0  # the most positions any forward of the model's decoder saw
        values, build = learner.trainer.values, trainer_module.build_rollout

        def spied_values(observations: list[CandidateObservation]) -> list[float | None]:
            got = values(observations)
            self.asked.append((observations, got))
            return got

        def spied_build(*args: Any, **kwargs: Any) -> Rollout:
            rollout = build(*args, **kwargs)
            self.rollouts.append(rollout)
            return rollout

        def positions(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
            seen = int(pos.max()) + 1 if pos is not None else ids.shape[1] if ids is not None else 0
            self.longest = max(self.longest, seen)

        monkeypatch.setattr(learner.trainer, "values", spied_values)
        monkeypatch.setattr(trainer_module, "build_rollout", spied_build)
        self.hook = scoring.model_parts(learner.lp.model)[0].register_forward_pre_hook(positions, with_kwargs=True)

    def value(self, obs: dict[str, Any]) -> float | None:
        """The critic's answer for an observation equal to `obs` (the stream decodes new objects)."""
        answers = {json.dumps(o.to_wire(), sort_keys=True): v for observations, got in self.asked for o, v in zip(observations, got)}
        return answers[json.dumps(obs, sort_keys=True)]


def returns_of(rollout: Rollout, seg_id: str) -> list[float]:
    return [r for r, s in zip(rollout.returns, rollout.seg_ids) if s == seg_id]


def write_batch(redis_client, prefix: str, fine_next: dict[str, Any], bad_next: list[dict[str, Any]]) -> dict[str, str]:
    """A segment closed by length with `fine_next` after it, a done one, and a truncated one per unscorable next
    observation: 3 + 2 x len(bad_next) transitions."""
    ids = {
        "fine": write(redis_client, prefix, "fine", [step(BANDIT, 0.0), step(BANDIT, 0.5)], "length", fine_next),
        "done": write(redis_client, prefix, "done", [step(BANDIT, 1.0, done=True)], "done", None),
    }
    for k, next_obs in enumerate(bad_next):
        ids[f"bad{k}"] = write(redis_client, prefix, f"bad{k}", [step(BANDIT, 0.25), step(BANDIT, 2.0)], "truncated", next_obs)
    return ids


def check_batch(learner: Learner, spy: Spy, metrics: dict[str, float] | None, ids: dict[str, str], fine_next: dict[str, Any]) -> None:
    """The update on `write_batch`'s segments: every segment trained, the unscorable ones as truncated with no successor."""
    unscorable = len(ids) - 2
    gamma = learner.cfg.gamma
    assert metrics is not None
    durably(learner)
    assert metrics["charts/dropped_unscorable_next_obs"] == metrics["charts/dropped_truncated"] == unscorable
    (rollout,) = spy.rollouts
    # fine: bootstraps from its next observation's value; done: from nothing
    assert returns_of(rollout, ids["fine"])[-1] == pytest.approx(0.5 + gamma * spy.value(fine_next), rel=1e-5, abs=1e-6)
    assert returns_of(rollout, ids["done"]) == pytest.approx([1.0])
    # bad: the last transition dropped, its observation's value bootstrapping the one before
    for k in range(unscorable):
        assert returns_of(rollout, ids[f"bad{k}"]) == pytest.approx([0.25 + gamma * spy.value(BANDIT)], rel=1e-5, abs=1e-6)
    assert rollout.dropped_unscorable_next_obs == rollout.dropped_truncated == unscorable and rollout.dropped_stale == 0
    # every transition of the other segments trained; the counters exact and published; nothing left pending
    stored = 3 + 2 * unscorable
    assert (learner.counters["transitions_stored"], learner.counters["transitions_trained"]) == (stored, stored - unscorable)
    assert learner.counters["dropped_truncated"] == learner.counters["dropped_unscorable_next_obs"] == unscorable
    assert learner.counters["segments_trained"] == 2 + unscorable and learner.version == 1
    figures = learner_figures.counters(learner_figures.read_latest(learner.redis, learner.cfg.store.key_prefix))
    assert figures["dropped_unscorable_next_obs"] == unscorable and figures["transitions_trained"] == stored - unscorable
    assert learner.redis.xlen(learner.stream) == 0
    assert math.isfinite(metrics["losses/policy_loss"]) and math.isfinite(metrics["losses/value_loss"])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_next_obs_that_tokenizes_to_nothing_ends_its_segment_as_truncated(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path, monkeypatch, caplog, arch
) -> None:
    """Before: ScoringError "prompt + question tokenize to nothing and the tokenizer adds no BOS: nothing to
    condition on" out of Learner.step, on every try (the entries stay pending)."""
    model = without_bos(tiny_models[arch], tmp_path / "no-bos")
    empty = {"prompt": "", "question": "", "action": ["red"]}
    ids = write_batch(redis_client, key_prefix, FINE_NEXT, [empty])
    learner = learner_on(model, "float32", redis_url, redis_client, key_prefix, tmp_path, 5)
    spy = Spy(learner, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger=trainer_module.__name__):
            check_batch(learner, spy, learner.step(), ids, FINE_NEXT)
            assert spy.value(empty) is None
            # white space alone is no better (the context's trailing white space goes to the candidates); the warning
            # is not repeated within UNSCORABLE_LOG_INTERVAL_S
            write(redis_client, key_prefix, "again", [step(BANDIT, 0.0), step(BANDIT, 1.0)], "truncated", {**empty, "prompt": " \n"})
            write(redis_client, key_prefix, "more", [step(BANDIT, 0.0), step(BANDIT, 0.0), step(BANDIT, 1.0, done=True)], "done", None)
            assert learner.step() is not None
    finally:
        spy.hook.remove()
        learner.close()
    assert (learner.counters["dropped_unscorable_next_obs"], learner.counters["transitions_trained"]) == (2, 8)
    warnings = [r.getMessage() for r in caplog.records if "could not be scored" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("1 segments' next observations") and "tokenize to nothing" in warnings[0]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_next_obs_past_the_position_limit_is_never_fed_to_the_model(
    tiny_model, redis_url, redis_client, key_prefix, tmp_path, monkeypatch, arch
) -> None:
    """Before: gpt2 "IndexError: index out of range in self" (its learned position table) out of Learner.step on
    every try; llama scored the contexts whole (130 positions; a 999,000-character prompt is as many tokens)."""
    model = tiny_model(arch, max_positions=LIMIT)
    # the fine segment's next observation just fits: it bootstraps from it
    ids = write_batch(redis_client, key_prefix, AT_THE_LIMIT, [PAST_THE_LIMIT, HUGE])
    learner = learner_on(model, "float32", redis_url, redis_client, key_prefix, tmp_path, 7)
    spy = Spy(learner, monkeypatch)
    try:
        check_batch(learner, spy, learner.step(), ids, AT_THE_LIMIT)
    finally:
        spy.hook.remove()
        learner.close()
    assert spy.value(PAST_THE_LIMIT) is None and spy.value(HUGE) is None
    # the critic reads contexts alone: the longest forward was the fine next observation's 123 context positions
    assert spy.longest == len(AT_THE_LIMIT["prompt"]) + 1


def test_the_rollout_bootstraps_an_unscorable_next_obs_from_its_own_last_observation() -> None:
    """build_rollout's rule on its own: the critic's None for a next_obs is a truncated segment with no successor."""

    def obs(name: str) -> dict[str, Any]:
        return {"prompt": name, "question": "", "action": ["a", "b"]}

    values = {"s0": 0.5, "s1": 0.4, "after": 2.0}

    def value_of(observations: list[CandidateObservation]) -> list[float | None]:
        return [values.get(o.prompt) for o in observations]

    def seg(seg_id: str, next_obs: dict[str, Any]) -> Segment:
        following = CandidateObservation.from_wire(next_obs)
        return Segment(seg_id, seg_id, 0, "truncated", False, True, following, [step(obs("s0"), 1.0), step(obs("s1"), 3.0)])

    r = build_rollout([seg("a", obs("unscorable")), seg("b", obs("after"))], value_of, 0.5, 1.0, current_version=0, max_policy_lag=0)
    # a: s0 alone, bootstrapping from V(s1) = 0.4; b: both, bootstrapping from V(after) = 2
    assert r.seg_ids == ["a", "b", "b"] and r.returns == pytest.approx([1.0 + 0.5 * 0.4, 1.0 + 0.5 * (3.0 + 0.5 * 2.0), 3.0 + 0.5 * 2.0])
    assert (r.stored, r.dropped_truncated, r.dropped_unscorable_next_obs) == (4, 1, 1)
    # a transition's own observation was scored by an actor: the learner must score it too
    done = Segment("c", "c", 0, "done", True, False, None, [step(obs("s0"), 1.0), step(obs("?"), 1.0)])
    with pytest.raises(scoring.ScoringError, match="transition 1 of segment c"):
        build_rollout([done], value_of, 0.5, 1.0, 0, 0)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_next_prompt_past_the_position_limit_ends_its_generate_segment_as_truncated(
    tiny_model, redis_url, redis_client, key_prefix, tmp_path, arch
) -> None:
    """The generate path's next observation is a prompt's token ids (the actor's, kept by the broker): one longer
    than the model's positions (an actor serving a model with more) was fed whole to the critic. Before: gpt2
    "IndexError: index out of range in self"; llama valued it."""
    model = tiny_model(arch, max_positions=LIMIT)
    sampling = {"max_new_tokens": 8}
    fine = [gen_transition([5, 6], [7, 8], done=False, version=0), gen_transition([9], [10], done=False, version=0)]
    write(redis_client, key_prefix, "fine", fine, "length", {"prompt_ids": [11] * LIMIT, "sampling": sampling})
    bad = [gen_transition([12, 13], [14], done=False, version=0), gen_transition([15], [16, 17], done=False, version=0)]
    write(redis_client, key_prefix, "bad", bad, "truncated", {"prompt_ids": [18] * (LIMIT + 1), "sampling": sampling})
    learner = learner_on(model, "float32", redis_url, redis_client, key_prefix, tmp_path, 4)
    try:
        metrics = learner.step()
    finally:
        learner.close()
    assert metrics is not None and metrics["charts/dropped_unscorable_next_obs"] == 1
    assert (learner.counters["transitions_stored"], learner.counters["transitions_trained"]) == (4, 3)
    assert learner.counters["dropped_truncated"] == learner.counters["dropped_unscorable_next_obs"] == 1
    assert all(math.isfinite(metrics[f"generation/{k}"]) for k in ("policy_loss", "value_loss"))


def test_a_dropped_turns_prompt_that_cannot_be_scored_does_not_bootstrap_the_turn_before() -> None:
    """A turn dropped (stale, another run, ...) cuts its chain, and the part before bootstrapped from its prompt, even
    one holding a token id outside the vocabulary or past the positions (an actor serving another model): the
    update failed as on such a next_obs. Now the turn before it has no successor: dropped and counted as well."""
    ok = gen_transition([1, 2], [3], done=False, version=5)
    cases = {"vocabulary": [70], "positions": [4] * 9}
    for why, prompt in cases.items():
        stale = gen_transition(prompt, [5], done=False, version=0)
        segments = [Segment(why, why, 0, "length", False, False, GenerateObservation([6], {}), [ok, ok, stale, ok])]
        batch = build_generation_batch(segments, current_version=5, max_policy_lag=4, vocab_size=64, position_limit=8)
        # the first turn bootstraps from the second's prompt; the second is dropped; the last bootstraps from next_obs
        assert [(c.samples, c.next_prompt) for c in batch.chains] == [([0], [1, 2]), ([1], [6])], why
        assert len(batch) == 2 and batch.prompts == [[1, 2], [1, 2]] and len(batch.rewards) == len(batch.lags) == 2
        assert (batch.stored, batch.dropped_stale, batch.dropped_truncated, batch.dropped_unscorable_next_obs) == (4, 1, 1, 1), why
        assert why in batch.unscorable_reason
    # a next prompt holding an id outside the vocabulary was already left out; it is counted as unscorable too
    segments = [Segment("next", "next", 0, "length", False, False, GenerateObservation([64], {}), [ok])]
    batch = build_generation_batch(segments, current_version=5, max_policy_lag=4, vocab_size=64)
    assert len(batch) == 0 and (batch.dropped_truncated, batch.dropped_unscorable_next_obs) == (1, 1)


def test_values_refuses_an_unscorable_observation_before_any_forward(tiny_model) -> None:
    """LearnerPolicy.values (the critic other callers use) raises ScoringError naming the limit, not IndexError."""
    from common.shared_settings import PolicySpec
    from learner_node.policy import LearnerPolicy
    from models.policy_model import ModelSpec, load_policy

    model, tokenizer = load_policy(ModelSpec.of(PolicySpec(model=tiny_model("gpt2", max_positions=LIMIT), lora_rank=4), "cpu"))
    lp = LearnerPolicy(model, tokenizer, "token", 1.0, (16,))
    assert lp.values([CandidateObservation.from_wire(AT_THE_LIMIT)])[1].shape == (1,)
    with pytest.raises(scoring.ScoringError, match="130 positions, over the model's limit of 128"), torch.no_grad():
        lp.values([CandidateObservation.from_wire(AT_THE_LIMIT), CandidateObservation.from_wire(PAST_THE_LIMIT)])
