"""The LLM policy behind an actor: sampling, evaluation mode, prefix cache, weight swaps."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from actor_node.llm_policy import Choice, LLMPolicy, SamplingConfig
from models import scoring
from models.policy_model import ModelSpec, load_policy, policy_state_dict
from tests.helpers import own_logits_scores

OBS = {
    "prompt": "Task: test the app. History: step 1 tapped Cart.",
    "question": " Which action? No. ",
    "action": ["0: TouchEvent(Cart)", "1: TouchEvent(Search)", "2: KeyEvent(BACK)"],
}


def job(obs=OBS, task="t1", n=1):
    return {"job": n, "task_id": task, "mode": "step", "obs": obs}


@pytest.fixture
def policy_factory(tiny_models):
    def make(cache_mb=0.0, greedy=False, lora_rank=4, normalisation="token", seed=0, temperature=1.0):
        model, tok = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=lora_rank))
        sampling = SamplingConfig(normalisation=normalisation, greedy=greedy, max_batch_tokens=4096, seed=seed, temperature=temperature)
        return LLMPolicy(model, tok, sampling, "auto", cache_mb)

    return make


def expected_logprobs(policy: LLMPolicy, obs=OBS) -> torch.Tensor:
    """log pi over the candidates, from the model's own logits and the normalisation written out here."""
    item = scoring.tokenize_observation(policy.tokenizer, obs["prompt"], obs["question"], obs["action"])
    sums = own_logits_scores(policy.model, item)
    if policy.sampling.normalisation == "token":
        sums = sums / torch.tensor([len(a) for a in item.actions])
    elif policy.sampling.normalisation == "word":
        sums = sums / torch.tensor([max(1, len(a.split())) for a in obs["action"]])
    return torch.log_softmax(sums / policy.sampling.temperature, -1)


@pytest.mark.parametrize("normalisation", ["token", "word", "sum"])
def test_logprob_and_probs_are_the_models_normalised_softmax(policy_factory, normalisation):
    policy = policy_factory(normalisation=normalisation, temperature=0.3)
    expected = expected_logprobs(policy)
    answers = policy.choose_batch([job(n=i) for i in range(4)])
    for a in answers:
        assert isinstance(a, Choice) and 0 <= a.action < 3
        assert a.probs == pytest.approx(expected.exp().tolist(), abs=1e-5)
        assert a.logprob == pytest.approx(float(expected[a.action]), abs=1e-5)


def test_sampling_follows_a_peaked_distribution(policy_factory):
    """Frequencies over 3,000 draws match the probabilities within 4 standard errors, on a distribution
    far from uniform (a uniform or argmax sampler fails by more than 10 standard errors)."""
    short = {"prompt": "Task", "question": ": ", "action": ["back", "open settings", "scroll down the list"]}  # cheap to score
    policy = policy_factory(seed=1, normalisation="token")
    scores = expected_logprobs(policy, short)  # at temperature 1: log-softmax of the normalised scores, up to a constant
    low, high = 1e-4, 1.0  # the temperature that puts 0.7 on the best candidate
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if float(torch.softmax(scores / middle, -1).max()) < 0.7 else (middle, high)
    policy.sampling = dataclasses.replace(policy.sampling, temperature=high)
    probs = expected_logprobs(policy, short).exp()
    assert float(probs.max()) > 0.6 and float(probs.min()) < 0.25  # peaked: the test can tell samplers apart
    n = 3000
    answers = policy.choose_batch([job(short, n=i) for i in range(n)])
    for k in range(3):
        freq = sum(a.action == k for a in answers) / n
        p = float(probs[k])
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n), (k, freq, p)


def test_an_over_long_observation_fails_alone_naming_the_limit(tiny_model):
    """A context past the model's position limit (GPT-2's learned positions would fail the whole
    batch's forward) is refused with an error naming the limit; the rest of the batch is answered."""
    path = tiny_model("gpt2", max_positions=128)
    model, tok = load_policy(ModelSpec(model=str(path), device="cpu", lora_rank=0))
    policy = LLMPolicy(model, tok, SamplingConfig(normalisation="token"), "auto")
    long_obs = {**OBS, "prompt": "x" * 200}
    answers = policy.choose_batch([job(), job(long_obs), job()])
    assert isinstance(answers[0], Choice) and isinstance(answers[2], Choice)
    assert isinstance(answers[1], scoring.ScoringError)
    assert "limit of 128" in str(answers[1])


def test_greedy_picks_the_most_probable(policy_factory):
    policy = policy_factory(greedy=True)
    answers = policy.choose_batch([job(n=i) for i in range(5)])
    best = max(range(3), key=lambda i: answers[0].probs[i])
    assert all(a.action == best for a in answers)


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
