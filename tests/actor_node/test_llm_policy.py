"""The LLM policy behind an actor: sampling, evaluation mode, prefix cache, weight swaps."""

from __future__ import annotations

import math

import pytest
import torch

from actor_node.llm_policy import Choice, LLMPolicy, SamplingConfig
from common import scoring
from common.policy_model import ModelSpec, load_policy, policy_state_dict

OBS = {
    "prompt": "Task: test the app. History: step 1 tapped Cart.",
    "question": " Which action? No. ",
    "action": ["0: TouchEvent(Cart)", "1: TouchEvent(Search)", "2: KeyEvent(BACK)"],
}


def job(obs=OBS, task="t1", n=1):
    return {"job": n, "task_id": task, "mode": "step", "obs": obs}


@pytest.fixture
def policy_factory(tiny_models):
    def make(cache_mb=0.0, greedy=False, lora_rank=4, normalisation="token", seed=0):
        model, tok = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=lora_rank))
        return LLMPolicy(
            model, tok, SamplingConfig(normalisation=normalisation, greedy=greedy, max_batch_tokens=4096, seed=seed), "auto", cache_mb
        )

    return make


def test_choices_are_a_distribution_and_logprob_matches(policy_factory):
    policy = policy_factory()
    answers = policy.choose_batch([job(n=i) for i in range(4)])
    for a in answers:
        assert isinstance(a, Choice) and 0 <= a.action < 3
        assert math.isclose(sum(a.probs), 1.0, rel_tol=1e-5)
        assert math.isclose(a.logprob, math.log(a.probs[a.action]), rel_tol=1e-5)
    assert answers[0].probs == pytest.approx(answers[1].probs)  # same observation, same distribution


def test_probs_are_the_normalised_score_softmax(policy_factory):
    policy = policy_factory(normalisation="word")
    item = scoring.tokenize_observation(policy.tokenizer, OBS["prompt"], OBS["question"], OBS["action"])
    with torch.inference_mode():
        sums = scoring.score_per_candidate(policy.model, [item])[0]
    expected = torch.softmax(scoring.normalise(sums, item, "word"), -1)
    assert policy.choose_batch([job()])[0].probs == pytest.approx(expected.tolist(), abs=1e-5)


def test_greedy_picks_the_most_probable(policy_factory):
    policy = policy_factory(greedy=True)
    answers = policy.choose_batch([job(n=i) for i in range(5)])
    best = max(range(3), key=lambda i: answers[0].probs[i])
    assert all(a.action == best for a in answers)


def test_sampling_follows_the_probabilities(policy_factory):
    policy = policy_factory(seed=1)
    answers = policy.choose_batch([job(n=i) for i in range(600)])
    freq = [sum(a.action == k for a in answers) / 600 for k in range(3)]
    assert freq == pytest.approx(answers[0].probs, abs=0.07)


def test_bad_observation_fails_alone(policy_factory):
    policy = policy_factory()
    answers = policy.choose_batch([job(), job({**OBS, "action": ["ok", ""]}), job()])
    assert isinstance(answers[0], Choice) and isinstance(answers[2], Choice)
    assert isinstance(answers[1], scoring.ScoringError)


def test_prefix_cache_is_used_and_changes_nothing(policy_factory):
    cached, plain = policy_factory(cache_mb=64), policy_factory(cache_mb=0)
    history = OBS["prompt"]
    for step in range(4):
        obs = {**OBS, "prompt": history}
        a, b = cached.choose_batch([job(obs)])[0], plain.choose_batch([job(obs)])[0]
        assert a.probs == pytest.approx(b.probs, abs=1e-5)
        history += f" Step {step}: tapped something new."
    assert cached.cache.hits == 3 and cached.cache.reused_tokens > 3 * 40
    assert plain.cache.hits == 0


def test_weight_swap_changes_outputs_and_drops_the_cache(policy_factory):
    policy = policy_factory(cache_mb=64)
    before = policy.choose_batch([job()])[0].probs
    assert policy.cache.entries
    state = {k: torch.randn_like(v) * 0.5 for k, v in policy_state_dict(policy.model).items()}
    policy.set_weights(state, version=7, run="run-a")
    assert policy.policy_version == 7 and not policy.cache.entries
    after = policy.choose_batch([job()])[0].probs
    assert after != pytest.approx(before, abs=1e-4)


def test_a_batch_is_one_forward_within_the_token_budget(policy_factory):
    policy = policy_factory()
    jobs = [job({**OBS, "prompt": OBS["prompt"] * (1 + i)}, task=f"t{i}", n=i) for i in range(6)]
    batched = policy.choose_batch(jobs)
    assert policy.forwards == 1
    alone = [policy.choose_batch([j])[0] for j in jobs]
    for a, b in zip(batched, alone):
        assert a.probs == pytest.approx(b.probs, abs=1e-5)
    tight = policy_factory()
    tight.sampling = SamplingConfig(normalisation="token", max_batch_tokens=300, seed=0)
    tight.choose_batch(jobs)
    sizes = [
        scoring.tokenize_observation(tight.tokenizer, j["obs"]["prompt"], j["obs"]["question"], j["obs"]["action"]).n_tokens for j in jobs
    ]
    assert 1 < tight.forwards <= len(jobs) and max(sizes) > 300  # split, and an over-long item still runs alone
