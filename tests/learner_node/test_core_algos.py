"""PPO math against hand-computed vectors."""

import math

import pytest
import torch

from common import options
from learner_node import core_algos


def candidate_loss(new, old, adv, behaviour_logp=None, is_cap=math.inf):
    """The candidate path's loss: one token per sample, CleanRL's symmetric clip of 0.2, no dual clip."""
    return core_algos.policy_loss(
        new, old, adv, torch.ones_like(adv), core_algos.ClipRange(0.2, 0.2), behaviour_logp, is_cap, kind="clipped"
    )


def test_every_registry_holds_exactly_the_names_configs_accept():
    assert tuple(core_algos.KL_ESTIMATORS) == options.KL_ESTIMATORS
    assert tuple(core_algos.LOSS_AGGREGATIONS) == options.LOSS_AGGREGATIONS
    assert tuple(core_algos.ADVANTAGE_ESTIMATORS) == options.ADVANTAGE_ESTIMATORS
    assert set(core_algos.GROUP_ESTIMATORS) < set(core_algos.ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown policy loss 'gspo'"):
        core_algos.policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), core_algos.ClipRange(0.2, 0.2), kind="gspo"
        )


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
    adv, ret = core_algos.gae(rewards, values, torch.tensor([False, False, False]), 1.0, gamma, lam)
    assert adv.tolist() == pytest.approx([a0, a1, a2])
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.4, a2 + 0.3])
    # done on the LAST step: its reward is kept, nothing bootstrapped after it
    adv, _ = core_algos.gae(rewards, values, torch.tensor([False, False, True]), 123.0, gamma, lam)
    assert adv[2] == pytest.approx(2.0 - 0.3)
    # done in the MIDDLE (step 1): the recursion stops there, step 2 starts a new episode
    adv, _ = core_algos.gae(rewards, values, torch.tensor([False, True, False]), 1.0, gamma, lam)
    assert adv[2] == pytest.approx(d2)
    assert adv[1] == pytest.approx(0.0 - 0.4)
    assert adv[0] == pytest.approx(d0 + 0.72 * (0.0 - 0.4))


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    rewards = torch.tensor([1.0, 1.0, 1.0])
    values = torch.tensor([0.2, 0.1, 0.0])
    adv, ret = core_algos.gae(rewards, values, torch.tensor([False, False, True]), 0.0, 0.5, 1.0)
    assert ret.tolist() == pytest.approx([1 + 0.5 + 0.25, 1 + 0.5, 1.0])


def naive_gae(rewards, values, dones, next_value, gamma, lam):
    """The recursion step by step on Python floats: the reference the scan is checked against."""
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        following = values[t + 1] if t + 1 < len(rewards) else next_value
        not_done = 0.0 if dones[t] else 1.0
        last = rewards[t] + gamma * following * not_done - values[t] + gamma * lam * not_done * last
        advantages[t] = last
    return advantages


def test_reverse_linear_scan_by_hand():
    # y_t = x_t + d_t y_{t+1}: y_4 = 5; y_3 = 4 + 0.5*5 = 6.5; y_2 = 3 + 0*6.5 = 3; y_1 = 2 + 2*3 = 8; y_0 = 1 + 1*8 = 9
    y = core_algos.reverse_linear_scan(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([1.0, 2.0, 0.0, 0.5, 7.0]))
    assert y.tolist() == [9.0, 8.0, 3.0, 6.5, 5.0]  # the last decay reaches past the end: it counts for nothing
    assert core_algos.reverse_linear_scan(torch.zeros(0), torch.zeros(0)).tolist() == []
    assert core_algos.reverse_linear_scan(torch.tensor([2.0]), torch.tensor([0.9])).tolist() == [2.0]


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 64, 1000, 5003])
def test_gae_equals_the_step_by_step_recursion(steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    rewards = torch.randn(steps, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(steps, generator=gen, dtype=torch.float64)
    dones = torch.rand(steps, generator=gen) < 0.01  # episodes end here and there, mid-sequence too
    adv, ret = core_algos.gae(rewards, values, dones, 0.7, 0.99, 0.95)
    expected = naive_gae(rewards.tolist(), values.tolist(), dones.tolist(), 0.7, 0.99, 0.95)
    assert adv.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert (ret - values).tolist() == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_gae_over_a_long_undiscounted_sequence_neither_overflows_nor_loses_the_far_rewards() -> None:
    # gamma = lam = 1 over 131,072 tokens: A_0 is the whole sum of rewards (here one at the very end), V = 0
    steps = 131_072
    rewards = torch.zeros(steps, dtype=torch.float64)
    rewards[-1] = 1.0
    adv, _ = core_algos.gae(rewards, torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.bool), 0.0, 1.0, 1.0)
    assert torch.equal(adv, torch.ones(steps, dtype=torch.float64))
    # gamma * lam = 0.5: 0.5 ** 131071 underflows; the scan keeps the near terms exact and the far ones at 0
    adv, _ = core_algos.gae(rewards, torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.bool), 0.0, 1.0, 0.5)
    assert adv[-1] == 1.0 and adv[-11] == pytest.approx(0.5**10) and adv[0] == 0.0 and torch.isfinite(adv).all()


def test_packed_sequences_are_each_their_own_gae() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths, boots = [5, 1, 9, 3], [0.4, -1.0, 0.0, 2.5]  # a length-1 sequence, and a sequence whose next value is 0
    parts = [(torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen) < 0.2) for n in lengths]
    ends = torch.cat([torch.arange(n) == n - 1 for n in lengths])
    rewards, values, dones = (torch.cat([part[k] for part in parts]) for k in range(3))
    adv, ret = core_algos.gae(rewards, values, dones, torch.tensor(boots), 0.9, 0.8, ends=ends)
    expected = sum((naive_gae(r.tolist(), v.tolist(), d.tolist(), boot, 0.9, 0.8) for (r, v, d), boot in zip(parts, boots)), [])
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    assert ret.tolist() == pytest.approx([a + v for a, v in zip(expected, values.tolist())], abs=1e-5)


def test_advantage_normalisation_is_over_the_batch():
    b = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    out = core_algos.masked_whiten(b, torch.ones(4, 1))
    assert out.mean() == pytest.approx(0.0, abs=1e-6) and out.std() == pytest.approx(1.0, abs=1e-5)
    assert core_algos.masked_whiten(torch.tensor([[5.0]]), torch.ones(1, 1)).tolist() == [[0.0]]


def test_policy_loss_clips_and_reports_by_hand():
    new = torch.log(torch.tensor([0.6, 0.3]))
    old = torch.log(torch.tensor([0.4, 0.3]))
    adv = torch.tensor([1.0, -2.0])
    terms = candidate_loss(new, old, adv)
    # ratio 1.5 -> clipped to 1.2 for the positive advantage; ratio 1 for the other
    expected = (-(1.0 * 1.2) + -(-2.0 * 1.0)) / 2
    assert float(terms.loss) == pytest.approx(expected)
    assert terms.ratio.tolist() == pytest.approx([1.5, 1.0])
    assert float(terms.clipfrac) == pytest.approx(0.5)
    assert float(terms.approx_kl) == pytest.approx(((0.5 - math.log(1.5)) + 0) / 2)


def test_ratio_one_gives_plain_policy_gradient():
    logp = torch.log(torch.tensor([0.2, 0.5], requires_grad=False)).requires_grad_()
    terms = candidate_loss(logp, logp.detach(), torch.tensor([1.0, 3.0]))
    terms.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.5, -1.5])
    assert float(terms.approx_kl) == 0.0 and float(terms.clipfrac) == 0.0


def test_decoupled_loss_clips_against_the_proximal_policy_and_weights_by_behaviour_by_hand():
    """Three stale transitions: mu the actor's (old) policy, prox the learner's at the update's start."""
    behaviour = torch.log(torch.tensor([0.2, 0.5, 0.1]))
    prox = torch.log(torch.tensor([0.4, 0.5, 0.6]))
    new = torch.log(torch.tensor([0.44, 0.4, 0.9])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0])
    terms = candidate_loss(new, prox, adv, behaviour_logp=behaviour, is_cap=5.0)
    # r = new / prox = 1.1, 0.8, 1.5;  w = prox / mu = 2, 1, 6 -> capped at 5
    assert terms.ratio.detach().tolist() == pytest.approx([1.1, 0.8, 1.5])
    assert float(terms.is_weight) == pytest.approx((2.0 + 1.0 + 5.0) / 3)  # the mean of w = 2, 1, 5
    assert float(terms.is_capped) == pytest.approx(1 / 3)
    # per transition max(-A r, -A clip(r)): -1.1; max(0.8, 0.8) = 0.8; max(-3.0, -2.4) = -2.4
    expected = (2.0 * -1.1 + 1.0 * 0.8 + 5.0 * -2.4) / 3
    assert float(terms.loss.detach()) == pytest.approx(expected)
    # approx KL and clip fraction are against prox, not behaviour: only the third is clipped (-A clip(r) > -A r)
    assert float(terms.clipfrac) == pytest.approx(1 / 3)
    k3 = [(r - 1) - math.log(r) for r in (1.1, 0.8, 1.5)]
    assert float(terms.approx_kl) == pytest.approx(sum(k3) / 3)
    # Gradients: d/dlogp of -w A r is -w A r where unclipped; zero where clipped (the third).
    terms.loss.backward()
    assert new.grad.tolist() == pytest.approx([-2.0 * 1.0 * 1.1 / 3, -1.0 * -1.0 * 0.8 / 3, 0.0])


def test_decoupled_loss_is_plain_ppo_when_prox_is_behaviour():
    """On-policy data (mu == prox) gives w = 1: the same loss and gradient as the plain surrogate."""
    old = torch.log(torch.tensor([0.4, 0.3, 0.2]))
    adv = torch.tensor([1.0, -2.0, 0.5])
    a = torch.log(torch.tensor([0.6, 0.3, 0.25])).requires_grad_()
    b = a.detach().clone().requires_grad_()
    plain = candidate_loss(a, old, adv)
    decoupled = candidate_loss(b, old, adv, behaviour_logp=old.clone(), is_cap=2.0)
    plain.loss.backward()
    decoupled.loss.backward()
    assert float(decoupled.loss.detach()) == pytest.approx(float(plain.loss.detach()))
    assert b.grad.tolist() == pytest.approx(a.grad.tolist())
    assert float(decoupled.is_weight) == pytest.approx(1.0)


def test_exact_kl_from_the_logged_behaviour_probabilities_by_hand():
    mu = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    pi = torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])
    kl = core_algos.kl_behaviour(mu, pi.log())
    # first: 0.5 log(0.5/0.25) + 0.5 log(1) + 0 (mu = 0 contributes nothing); second: identical -> 0
    assert kl.tolist() == pytest.approx([0.5 * math.log(2.0), 0.0], abs=1e-7)


def test_value_loss_with_and_without_clipping_by_hand():
    new, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0])
    assert float(core_algos.value_loss(new, old, ret, torch.ones(2))) == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    # clipped: v1 -> 0.7 (error 1.3^2=1.69 > 1), v2 -> 0.3 (0.09 > 0)
    assert float(core_algos.value_loss(new, old, ret, torch.ones(2), clip=0.2)) == pytest.approx(0.5 * (1.69 + 0.09) / 2)


def test_entropy_and_exact_kl_over_candidates():
    p = torch.tensor([[0.5, 0.25, 0.25]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert float(core_algos.entropy(p.log())) == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.25 * 0 + 0.25 * math.log(0.25 / 0.5)
    assert float(core_algos.kl_exact(p.log(), q.log())) == pytest.approx(kl)
    assert float(core_algos.kl_exact(p.log(), p.log())) == pytest.approx(0.0)


def test_explained_variance_and_adaptive_kl():
    y = torch.tensor([1.0, 2.0, 3.0])
    assert core_algos.explained_variance(y, y) == pytest.approx(1.0)
    assert math.isnan(core_algos.explained_variance(y, torch.ones(3)))
    ctl = core_algos.AdaptiveKLController(0.1, target=0.01, horizon=100)
    assert ctl.update(0.05, 10) == pytest.approx(0.1 * 1.02)  # KL too high: coefficient grows (error capped at 0.2)
    assert core_algos.AdaptiveKLController(0.1, None).update(1.0, 10) == 0.1  # fixed


def test_kl_estimators_by_hand() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(0.25 / 0.5) = -0.693147; k1 = 0.693147, k2 = 0.480453 / 2, k3 = (0.5 - 1) + 0.693147
    assert core_algos.kl_estimate(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert core_algos.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert core_algos.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    with pytest.raises(ValueError, match="k4"):
        core_algos.kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_exact_kl() -> None:
    # pi = (0.7, 0.2, 0.1), ref = (0.4, 0.4, 0.2): KL(pi || ref) = sum pi log(pi / ref)
    pi, ref = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    exact = float((pi * (pi / ref).log()).sum())  # 0.7 ln 1.75 + 0.2 ln 0.5 + 0.1 ln 0.5 = 0.391731 - 0.138629 - 0.069315 = 0.183787
    assert exact == pytest.approx(0.183787, abs=1e-6)
    for kind in ("k1", "k3"):  # expectation over a ~ pi, taken exactly
        expected = float((pi * core_algos.kl_estimate(pi.log(), ref.log(), kind)).sum())
        assert expected == pytest.approx(exact, abs=1e-6), kind
    k2 = float((pi * core_algos.kl_estimate(pi.log(), ref.log(), "k2")).sum())
    assert k2 != pytest.approx(exact, abs=1e-3)  # k2 is biased


def test_aggregations_by_hand() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert core_algos.aggregate(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert core_algos.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert core_algos.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="mean"):
        core_algos.aggregate(loss, mask, "sum")


def test_masked_whiten_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # mean of 1, 2, 3, 10 = 4; sample variance (9 + 4 + 1 + 36) / 3 = 16.667, std 4.08248
    out = core_algos.masked_whiten(x, mask)
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
    terms = core_algos.policy_loss(logp, prox, torch.tensor([ADV]), mask, core_algos.ClipRange(0.2, 0.28, 3.0), **kw)
    terms.loss.backward()
    return terms, logp.grad


def test_policy_loss_clip_higher_and_dual_clip_by_hand() -> None:
    terms, grad = _terms()
    assert terms.loss.item() == pytest.approx(2.42 / 6, abs=1e-6)
    # d/d logp of -A r is -A r; zero where clipped or dual-clipped; / 6 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 1.5, 0.0, 0.0, -1.1]]) / 6, atol=1e-6, rtol=0)
    # clipfrac as verl counts it: the tokens where the clipped term won (-A clip(r) > -A r), the first and fourth;
    # not every ratio outside the range (5 of 6): a ratio below the range with A > 0 (the second) is not clipped
    assert terms.clipfrac.item() == pytest.approx(2 / 6)
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
        core_algos.ClipRange(0.2, 0.2, 1.0)


def test_value_loss_clipped_and_huber_by_hand() -> None:
    mask = torch.ones(1, 2)
    returns = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[2.0, 0.0]])
    # unclipped: 0.5 * 2^2 = 2 and 0.5 * 1^2 = 0.5; mean 1.25
    assert core_algos.value_loss(values, values, returns, mask).item() == pytest.approx(1.25)
    # old values 3 and 0, clip 0.5: token 0's clipped value 3 + clamp(-1, -0.5, 0.5) = 2.5 -> 0.5 * 6.25 = 3.125 > 2;
    # token 1's clipped value 0 + 0 = 0, the same 0.5
    old = torch.tensor([[3.0, 0.0]])
    assert core_algos.value_loss(values, old, returns, mask, clip=0.5).item() == pytest.approx((3.125 + 0.5) / 2)
    # Huber, delta 1: errors 2 and -1 -> 1 * (2 - 0.5) = 1.5 and 0.5 * 1 = 0.5
    assert core_algos.value_loss(values, values, returns, mask, huber_delta=1.0).item() == pytest.approx(1.0)


def test_entropy_over_a_vocabulary() -> None:
    uniform = core_algos.entropy(torch.log_softmax(torch.zeros(2, 4), -1))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(4)))
    peaked = core_algos.entropy(torch.log_softmax(torch.tensor([[100.0, 0.0, 0.0]]), -1))
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
    assert core_algos.kl_estimate(logp, ref, "k3").tolist() == pytest.approx([10.0, 10.0, math.e - 2], abs=1e-6)
    # a token the policy now makes e^100 times likelier than the proximal policy did: r = e^20, not inf
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    terms = core_algos.policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), core_algos.ClipRange(0.2, 0.2))
    assert float(terms.ratio.detach()[0, 0]) == pytest.approx(math.exp(20), rel=1e-5)
    terms.loss.backward()
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all()) and math.isfinite(float(terms.approx_kl))
