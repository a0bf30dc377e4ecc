"""Token-level PPO math against vectors computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from learner_node import token_ppo as tp


def test_kl_estimators_by_hand() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(0.25 / 0.5) = -0.693147; k1 = 0.693147, k2 = 0.480453 / 2, k3 = (0.5 - 1) + 0.693147
    assert tp.kl_estimate(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert tp.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert tp.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    with pytest.raises(ValueError, match="k4"):
        tp.kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_exact_kl() -> None:
    # pi = (0.7, 0.2, 0.1), ref = (0.4, 0.4, 0.2): KL(pi || ref) = sum pi log(pi / ref)
    pi, ref = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    exact = float((pi * (pi / ref).log()).sum())  # 0.7 ln 1.75 + 0.2 ln 0.5 + 0.1 ln 0.5 = 0.391731 - 0.138629 - 0.069315 = 0.183787
    assert exact == pytest.approx(0.183787, abs=1e-6)
    for kind in ("k1", "k3"):  # expectation over a ~ pi, taken exactly
        expected = float((pi * tp.kl_estimate(pi.log(), ref.log(), kind)).sum())
        assert expected == pytest.approx(exact, abs=1e-6), kind
    k2 = float((pi * tp.kl_estimate(pi.log(), ref.log(), "k2")).sum())
    assert k2 != pytest.approx(exact, abs=1e-3)  # k2 is biased


def test_aggregations_by_hand() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert tp.aggregate(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert tp.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert tp.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="mean"):
        tp.aggregate(loss, mask, "sum")


def test_token_rewards_put_the_score_on_the_last_token() -> None:
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = tp.token_rewards(torch.tensor([1.0, 0.5]), kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.01, -0.02, -0.03 + 1.0], [-0.05 + 0.5, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_masked_whiten_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # mean of 1, 2, 3, 10 = 4; sample variance (9 + 4 + 1 + 36) / 3 = 16.667, std 4.08248
    out = tp.masked_whiten(x, mask)
    torch.testing.assert_close(out, torch.tensor([[-0.734847, -0.489898, -0.244949], [1.469694, 0.0, 0.0]]), atol=1e-5, rtol=0)


# Six tokens; clip_low 0.2, clip_high 0.28, c = 3:
#   A     r     -A r   -A clip(r, 0.8, 1.28)   L1     dual bound -A c   L
#   1    1.5   -1.5    -1.28                   -1.28   -                 -1.28  (clipped: no gradient)
#   1    0.5   -0.5    -0.8                    -0.5    -                 -0.5   (gradient -A r = -0.5)
#  -1    1.5    1.5     1.28                    1.5    3                  1.5   (gradient 1.5)
#  -1    0.5    0.5     0.8                     0.8    3                  0.8   (clipped)
#  -1    5.0    5.0     1.28                    5.0    3                  3.0   (dual clip: no gradient)
#   1    1.1   -1.1    -1.1                    -1.1    -                 -1.1   (gradient -1.1)
# token mean = (-1.28 - 0.5 + 1.5 + 0.8 + 3 - 1.1) / 6 = 2.42 / 6
ADV = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
RATIO = [1.5, 0.5, 1.5, 0.5, 5.0, 1.1]


def _terms(**kw):
    prox = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -3.0, -0.7]])
    logp = (prox + torch.tensor([RATIO]).log()).requires_grad_(True)
    mask = torch.ones(1, 6)
    terms = tp.policy_loss(logp, prox, torch.tensor([ADV]), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, **kw)
    terms.loss.backward()
    return terms, logp.grad


def test_policy_loss_clip_higher_and_dual_clip_by_hand() -> None:
    terms, grad = _terms()
    assert terms.loss.item() == pytest.approx(2.42 / 6, abs=1e-6)
    # d/d logp of -A r is -A r; zero where clipped or dual-clipped; / 6 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 1.5, 0.0, 0.0, -1.1]]) / 6, atol=1e-6, rtol=0)
    assert terms.clipfrac.item() == pytest.approx(5 / 6)
    assert terms.dual_clipfrac.item() == pytest.approx(1 / 6)
    # approx KL = mean((r - 1) - log r)
    expected_kl = sum((r - 1) - math.log(r) for r in RATIO) / 6
    assert terms.approx_kl.item() == pytest.approx(expected_kl, abs=1e-6)


def test_policy_loss_behaviour_weight_by_hand() -> None:
    prox = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -3.0, -0.7]])
    # w = min(exp(prox - behaviour), 4): exp(0) = 1, exp(ln 2) = 2, exp(ln 0.5) = 0.5, then 1, exp(ln 10) capped to 4, 1
    behaviour = prox - torch.tensor([[0.0, math.log(2), math.log(0.5), 0.0, math.log(10), 0.0]])
    terms, grad = _terms(behaviour_logp=behaviour, is_cap=4.0)
    per_token = [-1.28, -0.5, 1.5, 0.8, 3.0, -1.1]
    weights = [1.0, 2.0, 0.5, 1.0, 4.0, 1.0]
    assert terms.loss.item() == pytest.approx(sum(w * v for w, v in zip(weights, per_token)) / 6, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5 * 2, 1.5 * 0.5, 0.0, 0.0, -1.1]]) / 6, atol=1e-6, rtol=0)
    assert terms.is_capped.item() == pytest.approx(1 / 6)
    assert terms.is_weight.item() == pytest.approx(sum(weights) / 6)


def test_dual_clip_bound_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        tp.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2, clip_ratio_c=1.0)


def test_value_loss_clipped_and_huber_by_hand() -> None:
    mask = torch.ones(1, 2)
    returns = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[2.0, 0.0]])
    # unclipped: 0.5 * 2^2 = 2 and 0.5 * 1^2 = 0.5; mean 1.25
    assert tp.value_loss(values, values, returns, mask).item() == pytest.approx(1.25)
    # old values 3 and 0, clip 0.5: token 0's clipped value 3 + clamp(-1, -0.5, 0.5) = 2.5 -> 0.5 * 6.25 = 3.125 > 2;
    # token 1's clipped value 0 + 0 = 0, the same 0.5
    old = torch.tensor([[3.0, 0.0]])
    assert tp.value_loss(values, old, returns, mask, clip=0.5).item() == pytest.approx((3.125 + 0.5) / 2)
    # Huber, delta 1: errors 2 and -1 -> 1 * (2 - 0.5) = 1.5 and 0.5 * 1 = 0.5
    assert tp.value_loss(values, values, returns, mask, huber_delta=1.0).item() == pytest.approx(1.0)


def test_entropy_from_logits() -> None:
    uniform = tp.entropy_from_logits(torch.zeros(2, 4))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(4)))
    peaked = tp.entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]]))
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


def test_k1_in_the_loss_is_refused_with_the_reason() -> None:
    from learner_node.config import GenerationConfig

    with pytest.raises(ValueError, match="zero in expectation"):
        GenerationConfig(kl_in_reward=False, kl_estimator="k1")
    assert GenerationConfig(kl_in_reward=False, kl_estimator="k3").kl_estimator == "k3"
    assert GenerationConfig(kl_in_reward=False, kl_estimator="k1", kl_coef=0.0).kl_coef == 0.0


def test_k3_and_the_ratio_are_clamped_as_verl_clamps_them() -> None:
    """verl's low_var_kl and policy loss: the log-ratio clamped to +-20 before exp, k3 to +-10 per token."""
    logp, ref = torch.tensor([-30.0, 0.0, -1.0]), torch.tensor([0.0, -30.0, 0.0])
    # log r = ref - logp = 30, -30, 1 -> clamped 20, -20, 1; k3 = e^log r - 1 - log r = 4.85e8, 19.0, e - 2 -> 10, 10, 0.718282
    assert tp.kl_estimate(logp, ref, "k3").tolist() == pytest.approx([10.0, 10.0, math.e - 2], abs=1e-6)
    # a token the policy now makes e^100 times likelier than the proximal policy did: r = e^20, not inf
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    terms = tp.policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2)
    assert float(terms.ratio.detach()[0, 0]) == pytest.approx(math.exp(20), rel=1e-5)
    terms.loss.backward()
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all()) and math.isfinite(float(terms.approx_kl))
