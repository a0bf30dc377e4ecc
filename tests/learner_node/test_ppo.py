"""PPO math against hand-computed vectors."""

import math

import pytest
import torch

from learner_node import ppo


def test_gae_bootstraps_and_cuts_at_done_by_hand():
    rewards = torch.tensor([1.0, 0.0, 2.0])
    values = torch.tensor([0.5, 0.4, 0.3])
    gamma, lam = 0.9, 0.8
    # no done: bootstrap from next_value = 1.0
    d2 = 2.0 + 0.9 * 1.0 - 0.3  # 2.6
    d1 = 0.0 + 0.9 * 0.3 - 0.4  # -0.13
    d0 = 1.0 + 0.9 * 0.4 - 0.5  # 0.86
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    adv, ret = ppo.gae(rewards, values, torch.tensor([False, False, False]), 1.0, gamma, lam)
    assert adv.tolist() == pytest.approx([a0, a1, a2])
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.4, a2 + 0.3])
    # done on the LAST step: its reward is kept, nothing bootstrapped after it
    adv, _ = ppo.gae(rewards, values, torch.tensor([False, False, True]), 123.0, gamma, lam)
    assert adv[2] == pytest.approx(2.0 - 0.3)
    # done in the MIDDLE (step 1): the recursion stops there, step 2 starts a new episode
    adv, _ = ppo.gae(rewards, values, torch.tensor([False, True, False]), 1.0, gamma, lam)
    assert adv[2] == pytest.approx(d2)
    assert adv[1] == pytest.approx(0.0 - 0.4)
    assert adv[0] == pytest.approx(d0 + 0.72 * (0.0 - 0.4))


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    rewards = torch.tensor([1.0, 1.0, 1.0])
    values = torch.tensor([0.2, 0.1, 0.0])
    adv, ret = ppo.gae(rewards, values, torch.tensor([False, False, True]), 0.0, 0.5, 1.0)
    assert ret.tolist() == pytest.approx([1 + 0.5 + 0.25, 1 + 0.5, 1.0])


def test_advantage_normalisation_is_over_the_batch():
    b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = ppo.normalise_advantages(b)
    assert out.mean() == pytest.approx(0.0, abs=1e-6) and out.std() == pytest.approx(1.0, abs=1e-5)
    assert ppo.normalise_advantages(torch.tensor([5.0])).tolist() == [0.0]


def test_policy_loss_clips_and_reports_by_hand():
    new = torch.log(torch.tensor([0.6, 0.3]))
    old = torch.log(torch.tensor([0.4, 0.3]))
    adv = torch.tensor([1.0, -2.0])
    terms = ppo.policy_loss(new, old, adv, clip_coef=0.2)
    # ratio 1.5 -> clipped to 1.2 for the positive advantage; ratio 1 for the other
    expected = (-(1.0 * 1.2) + -(-2.0 * 1.0)) / 2
    assert float(terms.pg_loss) == pytest.approx(expected)
    assert terms.ratio.tolist() == pytest.approx([1.5, 1.0])
    assert float(terms.clipfrac) == pytest.approx(0.5)
    assert float(terms.approx_kl) == pytest.approx(((0.5 - math.log(1.5)) + 0) / 2)


def test_ratio_one_gives_plain_policy_gradient():
    logp = torch.log(torch.tensor([0.2, 0.5], requires_grad=False)).requires_grad_()
    terms = ppo.policy_loss(logp, logp.detach(), torch.tensor([1.0, 3.0]), 0.2)
    terms.pg_loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.5, -1.5])
    assert float(terms.approx_kl) == 0.0 and float(terms.clipfrac) == 0.0


def test_decoupled_loss_clips_against_the_proximal_policy_and_weights_by_behaviour_by_hand():
    """Three stale transitions: mu the actor's (old) policy, prox the learner's at the update's start."""
    behaviour = torch.log(torch.tensor([0.2, 0.5, 0.1]))
    prox = torch.log(torch.tensor([0.4, 0.5, 0.6]))
    new = torch.log(torch.tensor([0.44, 0.4, 0.9])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0])
    terms = ppo.policy_loss(new, prox, adv, clip_coef=0.2, mb_behavlogprob=behaviour, is_cap=5.0)
    # r = new / prox = 1.1, 0.8, 1.5;  w = prox / mu = 2, 1, 6 -> capped at 5
    assert terms.ratio.detach().tolist() == pytest.approx([1.1, 0.8, 1.5])
    assert terms.is_weight.tolist() == pytest.approx([2.0, 1.0, 5.0])
    assert float(terms.is_capped) == pytest.approx(1 / 3)
    # per transition max(-A r, -A clip(r)): -1.1; max(0.8, 0.8) = 0.8; max(-3.0, -2.4) = -2.4
    expected = (2.0 * -1.1 + 1.0 * 0.8 + 5.0 * -2.4) / 3
    assert float(terms.pg_loss.detach()) == pytest.approx(expected)
    # approx KL and clip fraction are against prox, not behaviour: only the third is outside [0.8, 1.2]
    assert float(terms.clipfrac) == pytest.approx(1 / 3)
    k3 = [(r - 1) - math.log(r) for r in (1.1, 0.8, 1.5)]
    assert float(terms.approx_kl) == pytest.approx(sum(k3) / 3)
    # Gradients: d/dlogp of -w A r is -w A r where unclipped; zero where clipped (the third).
    terms.pg_loss.backward()
    assert new.grad.tolist() == pytest.approx([-2.0 * 1.0 * 1.1 / 3, -1.0 * -1.0 * 0.8 / 3, 0.0])


def test_decoupled_loss_is_plain_ppo_when_prox_is_behaviour():
    """On-policy data (mu == prox) gives w = 1: the same loss and gradient as the plain surrogate."""
    old = torch.log(torch.tensor([0.4, 0.3, 0.2]))
    adv = torch.tensor([1.0, -2.0, 0.5])
    a = torch.log(torch.tensor([0.6, 0.3, 0.25])).requires_grad_()
    b = a.detach().clone().requires_grad_()
    plain = ppo.policy_loss(a, old, adv, 0.2)
    decoupled = ppo.policy_loss(b, old, adv, 0.2, mb_behavlogprob=old.clone(), is_cap=2.0)
    plain.pg_loss.backward()
    decoupled.pg_loss.backward()
    assert float(decoupled.pg_loss.detach()) == pytest.approx(float(plain.pg_loss.detach()))
    assert b.grad.tolist() == pytest.approx(a.grad.tolist())
    assert decoupled.is_weight.tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_exact_kl_from_the_logged_behaviour_probabilities_by_hand():
    mu = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    pi = torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])
    kl = ppo.kl_behaviour(mu, pi.log())
    # first: 0.5 log(0.5/0.25) + 0.5 log(1) + 0 (mu = 0 contributes nothing); second: identical -> 0
    assert kl.tolist() == pytest.approx([0.5 * math.log(2.0), 0.0], abs=1e-7)


def test_value_loss_with_and_without_clipping_by_hand():
    new, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0])
    assert float(ppo.value_loss(new, old, ret, None)) == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    # clipped: v1 -> 0.7 (error 1.3^2=1.69 > 1), v2 -> 0.3 (0.09 > 0)
    assert float(ppo.value_loss(new, old, ret, 0.2)) == pytest.approx(0.5 * (1.69 + 0.09) / 2)


def test_entropy_and_exact_kl_over_candidates():
    p = torch.tensor([[0.5, 0.25, 0.25]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert float(ppo.entropy(p.log())) == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.25 * 0 + 0.25 * math.log(0.25 / 0.5)
    assert float(ppo.kl_to_reference(p.log(), q.log())) == pytest.approx(kl)
    assert float(ppo.kl_to_reference(p.log(), p.log())) == pytest.approx(0.0)


def test_explained_variance_and_adaptive_kl():
    y = torch.tensor([1.0, 2.0, 3.0])
    assert ppo.explained_variance(y, y) == pytest.approx(1.0)
    assert math.isnan(ppo.explained_variance(y, torch.ones(3)))
    ctl = ppo.AdaptiveKLController(0.1, target=0.01, horizon=100)
    assert ctl.update(0.05, 10) == pytest.approx(0.1 * 1.02)  # KL too high: coefficient grows (error capped at 0.2)
    assert ppo.AdaptiveKLController(0.1, None).update(1.0, 10) == 0.1  # fixed
