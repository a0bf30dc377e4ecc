"""Sampling every row at once (actor_node/sampling.py): the distribution each row is drawn from, the
log-probability logged, and draws that depend on the request's seed and the token's index only."""

from __future__ import annotations

import math

import pytest
import torch

from actor_node import sampling


def settings(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
    return (
        torch.full((n,), temperature),
        torch.full((n,), top_p),
        torch.full((n,), top_k, dtype=torch.long),
    )


def draws(n: int, seed: int = 0) -> torch.Tensor:
    return sampling.row_uniforms(torch.full((n,), seed, dtype=torch.long), torch.arange(n))


def test_top_p_samples_within_the_nucleus_and_logs_its_renormalised_probability() -> None:
    n = 4000
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3])).repeat(n, 1)  # not in sorted order
    tokens, logprobs, failed = sampling.sample(logits, *settings(n, top_p=0.7), draws(n))
    # Nucleus for p = 0.7: tokens 1 (0.5) and 3 (0.5 < 0.7, so 0.3 joins); renormalised 0.625 and 0.375.
    assert set(tokens.tolist()) == {1, 3} and not failed.any()
    expected = torch.where(tokens == 1, math.log(0.625), math.log(0.375)).double()
    assert torch.allclose(logprobs.double(), expected, atol=1e-5)
    # 4000 draws of p = 0.625: standard error 0.0077; a sampler ignoring top-p draws tokens 0 and 2 20% of the time.
    assert abs(float((tokens == 1).double().mean()) - 0.625) < 4 * 0.0077


def test_top_k_and_temperature() -> None:
    n = 4000
    probs = torch.tensor([0.1, 0.2, 0.4, 0.3])
    logits = torch.log(probs).repeat(n, 1)
    tokens, logprobs, _ = sampling.sample(logits, *settings(n, top_k=2), draws(n, seed=1))
    assert set(tokens.tolist()) == {2, 3}  # the two most likely
    assert torch.allclose(logprobs.double(), torch.where(tokens == 2, math.log(4 / 7), math.log(3 / 7)).double(), atol=1e-5)
    assert abs(float((tokens == 2).double().mean()) - 4 / 7) < 4 * math.sqrt(4 / 7 * 3 / 7 / n)
    # Temperature 2 flattens: p ~ sqrt(probs); every token drawn at its frequency.
    tokens, logprobs, _ = sampling.sample(logits, *settings(n, temperature=2.0), draws(n, seed=2))
    flat = probs.sqrt() / probs.sqrt().sum()
    for token in range(4):
        share = float((tokens == token).double().mean())
        assert abs(share - float(flat[token])) < 4 * math.sqrt(float(flat[token]) * (1 - float(flat[token])) / n), token
    assert torch.allclose(logprobs, flat.log()[tokens], atol=1e-5)


def test_rows_with_different_settings_in_one_batch_each_get_their_own() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.01, 1.0])
    top_k = torch.tensor([0, 1, 0, 0])
    tokens, logprobs, failed = sampling.sample(logits, temperature, top_p, top_k, torch.tensor([0.99, 0.99, 0.99, 0.99]))
    # greedy; top-k 1; a nucleus of one; the whole vocabulary, where u = 0.99 lands on the last token in vocabulary order
    assert tokens.tolist() == [1, 1, 1, 3]
    assert logprobs[:3].tolist() == [0.0, 0.0, 0.0] and not failed.any()


@pytest.mark.parametrize("top_p", [0.1, 1e-30, 1e-45, 5e-324])  # the last two are 0 once in float32, as the engine holds them
def test_a_top_p_below_the_most_likely_tokens_probability_keeps_that_token_alone(top_p: float) -> None:
    """docs/protocol.md: any top_p in (0, 1] is served; one that small is greedy decoding, logged with log-probability 0."""
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]] * 3))
    temperature, top_ps, top_k = settings(3, top_p=top_p)
    tokens, logprobs, failed = sampling.sample(logits, temperature, top_ps.float(), top_k, torch.tensor([0.0, 0.5, 0.9999]))
    assert tokens.tolist() == [1, 1, 1] and logprobs.tolist() == [0.0, 0.0, 0.0] and not failed.any()


def test_draws_depend_on_the_seed_and_the_index_only() -> None:
    seeds = torch.tensor([5, 5, 7, 2**62 + 3], dtype=torch.long)
    counters = torch.tensor([0, 1, 0, 9], dtype=torch.long)
    together = sampling.row_uniforms(seeds, counters)
    alone = torch.cat([sampling.row_uniforms(seeds[i : i + 1], counters[i : i + 1]) for i in range(4)])
    assert torch.equal(together, alone)
    assert together[0] != together[1] and together[0] != together[2]
    many = sampling.row_uniforms(torch.full((100_000,), 11, dtype=torch.long), torch.arange(100_000))
    assert float(many.min()) >= 0 and float(many.max()) < 1
    assert abs(float(many.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / 100_000)
    counts = torch.histc(many.float(), bins=10, min=0, max=1)  # chi-square with 9 degrees of freedom: < 27.9 at p = 0.001
    assert float(((counts - 10_000) ** 2 / 10_000).sum()) < 27.9


def test_a_distribution_that_cannot_be_sampled_fails_its_row_alone() -> None:
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [0.0, 1.0]])
    tokens, _, failed = sampling.sample(logits, *settings(3), torch.tensor([0.5, 0.5, 0.5]))
    assert failed.tolist() == [False, True, False]
    greedy = sampling.sample(logits[:1], torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.zeros(1))
    assert greedy[0].tolist() == [1]


@pytest.mark.parametrize("u", [0.0, 0.2999, 0.3001, 0.9999999])
def test_the_draw_inverts_the_cumulative_distribution(u: float) -> None:
    logits = torch.log(torch.tensor([[0.3, 0.0, 0.7]]))  # a token of probability 0 is never drawn
    tokens, _, _ = sampling.sample(logits, *settings(1), torch.tensor([u], dtype=torch.float64))
    assert tokens.item() == (0 if u < 0.3 else 2)


def splitmix64_reference(seed: int, t: int) -> float:
    """docs/protocol.md's draw in plain Python integers: state = mix(seed + gamma), u = mix(state + (t + 1) gamma) >> 11 / 2^53."""
    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    state = mix(seed + gamma)
    return (mix(state + (t + 1) * gamma) >> 11) / 2**53


def test_the_draw_is_splitmix64_of_the_seed_and_the_index() -> None:
    seeds = [0, 1, 7, 2**40 + 5, 2**63 - 1]
    counters = [0, 3, 1000, 2**20, 5]
    got = sampling.row_uniforms(torch.tensor(seeds, dtype=torch.long), torch.tensor(counters, dtype=torch.long))
    assert got.tolist() == [splitmix64_reference(s, t) for s, t in zip(seeds, counters)]


def test_a_row_without_top_p_or_top_k_is_not_changed_by_a_neighbour_that_has_them() -> None:
    """A float32 cumulative sum reaches 1 before the vocabulary ends: a top_p = 1 row must not lose its tail."""
    vocab = 50_000
    logits = torch.full((vocab,), -12.0)
    logits[:10] = torch.linspace(8.0, 4.0, 10)
    u = torch.tensor([0.9999999, 0.5], dtype=torch.float64)
    alone = sampling.sample(logits[None], torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long), u[:1])
    beside = sampling.sample(logits.repeat(2, 1), torch.ones(2), torch.tensor([1.0, 0.5]), torch.zeros(2, dtype=torch.long), u)
    assert alone[0][0] == beside[0][0] and alone[0][0] >= 10  # the tail token u lands on, alone and beside
    assert torch.equal(alone[1][0], beside[1][0])


def test_greedy_rows_with_non_finite_logits_fail_too() -> None:
    logits = torch.tensor([[0.0, float("nan")], [float("inf"), 0.0], [0.0, 1.0]])
    _, _, failed = sampling.sample(logits, torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.long), torch.zeros(3))
    assert failed.tolist() == [True, True, False]


def test_top_k_comes_first_then_top_p_over_the_renormalised_top_k() -> None:
    """transformers' and vLLM's order: top-2 of (0.4, 0.3, 0.2, 0.1) renormalised is (4/7, 3/7); a nucleus of 0.5
    over that holds the first token alone (over the whole distribution it would hold two)."""
    n = 200
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).repeat(n, 1)
    tokens, logprobs, _ = sampling.sample(logits, *settings(n, top_p=0.5, top_k=2), draws(n, seed=4))
    assert set(tokens.tolist()) == {0} and torch.allclose(logprobs, torch.zeros(n), atol=1e-6)
