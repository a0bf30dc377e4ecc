"""PPO math on tensors: returns, advantages and every loss term. No sockets, no Redis, no model.

Names follow CleanRL (b_ for whole-batch tensors, mb_ for a minibatch).
Conventions: `dones[t]` is true when the episode ended with transition t (its
reward is the last one; nothing is bootstrapped after it). `next_value` is the
value of the observation after the last transition of the segment, or 0 when
the segment ended with `done`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def gae(
    rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: float | torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns of one segment (Schulman et al. 2016).

    delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)
    A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
    The done flag of step t cuts the bootstrap and the recursion after step t:
    the terminal transition keeps its own reward (it is trained on, never dropped).
    """
    steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros((), dtype=rewards.dtype)
    for t in reversed(range(steps)):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        following = values[t + 1] if t + 1 < steps else torch.as_tensor(next_value, dtype=rewards.dtype)
        delta = rewards[t] + gamma * following * not_done - values[t]
        last = delta + gamma * lam * not_done * last
        advantages[t] = last
    return advantages, advantages + values


def normalise_advantages(b_advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whitened over the whole batch (not per minibatch: a minibatch of 1 would become 0)."""
    if b_advantages.numel() < 2:
        return b_advantages - b_advantages.mean()
    return (b_advantages - b_advantages.mean()) / (b_advantages.std() + eps)


@dataclass
class PolicyTerms:
    pg_loss: torch.Tensor
    logratio: torch.Tensor  # log pi_theta - log pi_prox
    ratio: torch.Tensor
    approx_kl: torch.Tensor  # KL(pi_prox || pi_theta), k3 estimator, on the minibatch's actions
    clipfrac: torch.Tensor
    is_weight: torch.Tensor  # the behaviour correction w of each transition (1 when prox is behaviour)
    is_capped: torch.Tensor  # fraction of transitions whose w was cut at the cap


def policy_loss(
    mb_newlogprob: torch.Tensor,
    mb_proxlogprob: torch.Tensor,
    mb_advantages: torch.Tensor,
    clip_coef: float,
    mb_behavlogprob: torch.Tensor | None = None,
    is_cap: float = math.inf,
) -> PolicyTerms:
    """The clipped surrogate, decoupled from the behaviour policy (docs/design.md, "Asynchronous PPO").

    Plain PPO (Schulman et al. 2017) when the proximal policy is the behaviour policy
    (`mb_behavlogprob` None). Otherwise the decoupled objective of Hilton et al. (2021),
    as AReaL (Fu et al. 2025) uses it for stale rollouts:

        r_t = pi_theta(a_t) / pi_prox(a_t)               the ratio the trust region clips
        w_t = min(pi_prox(a_t) / mu(a_t), is_cap)        behaviour correction, no gradient
        L   = -mean_t  w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)

    mu is the behaviour policy (the actor's weights, possibly several versions old) and
    pi_prox the learner's weights at the start of the update. Clipping against pi_prox
    keeps every stale sample inside the trust region (a sample whose mu-ratio already
    sat outside it would give no gradient), and w makes the expectation over mu an
    expectation over pi_prox; the cap (truncated importance sampling, as in IMPALA's
    V-trace) bounds its variance.
    """
    logratio = mb_newlogprob - mb_proxlogprob
    ratio = logratio.exp()
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    if mb_behavlogprob is None:
        weight = torch.ones_like(mb_proxlogprob)
        capped = torch.zeros(())
    else:
        with torch.no_grad():
            raw = (mb_proxlogprob.detach() - mb_behavlogprob).exp()
            weight = raw.clamp(max=is_cap)
            capped = (raw > is_cap).float().mean()
    pg_loss = (weight * torch.max(pg_loss1, pg_loss2)).mean()
    with torch.no_grad():
        # http://joschu.net/blog/kl-approx.html
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return PolicyTerms(pg_loss, logratio, ratio, approx_kl, clipfrac, weight, capped)


def kl_behaviour(behaviour_probs: torch.Tensor, logp_all: torch.Tensor) -> torch.Tensor:
    """KL(mu || pi), exact over the finite candidate set, from the behaviour probabilities the actor logged.

    Terms with mu(a) = 0 contribute 0 (the limit of p log p); how far the learner's policy
    has moved from the one that acted, which the ratio on the one chosen action only samples.
    """
    mu = behaviour_probs.to(logp_all.dtype)
    log_mu = torch.where(mu > 0, mu.clamp_min(torch.finfo(mu.dtype).tiny).log(), torch.zeros_like(mu))
    return (mu * (log_mu - logp_all)).sum(-1)


def value_loss(newvalue: torch.Tensor, b_values: torch.Tensor, b_returns: torch.Tensor, clip_coef: float | None) -> torch.Tensor:
    """0.5 * squared error, with PPO's value clipping when clip_coef is set."""
    v_loss_unclipped = (newvalue - b_returns) ** 2
    if clip_coef is None:
        return 0.5 * v_loss_unclipped.mean()
    v_clipped = b_values + torch.clamp(newvalue - b_values, -clip_coef, clip_coef)
    v_loss_clipped = (v_clipped - b_returns) ** 2
    return 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()


def entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """Entropy of a distribution over the candidates, from its log-probabilities."""
    return -(logp_all.exp() * logp_all).sum(-1)


def kl_to_reference(logp_all: torch.Tensor, ref_logp_all: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref), exact over the finite candidate set."""
    return (logp_all.exp() * (logp_all - ref_logp_all)).sum(-1)


def explained_variance(y_pred: torch.Tensor, y_true: torch.Tensor) -> float:
    var_y = float(y_true.var()) if y_true.numel() > 1 else 0.0
    return float("nan") if var_y == 0 else 1 - float((y_true - y_pred).var()) / var_y


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019): grows when KL exceeds its target, shrinks below it."""

    def __init__(self, init_coef: float, target: float | None, horizon: int = 10_000) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.target:
            error = max(-0.2, min(0.2, current_kl / self.target - 1))
            self.value *= 1 + error * n_steps / self.horizon
        return self.value
