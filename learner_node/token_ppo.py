"""Token-level PPO math for generated responses: KL estimators, per-token rewards, masked losses. Tensors only.

Shapes: every per-token tensor is [B, T] (B responses, right-padded to T tokens) with a
`mask` [B, T] that is 1 on response tokens and 0 on padding. Formulas and the choices
behind them are in docs/design.md, "Generation: token-level PPO". GAE over the tokens of
a segment's turns reuses learner_node/ppo.py's `gae` (one step per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.options import KL_ESTIMATORS, LOSS_AGGREGATIONS

LOG_RATIO_CLAMP = 20.0  # verl's bound on a log-ratio before exp (core_algos.py)
K3_CLAMP = 10.0  # verl's bound on the k3 estimate of one token


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """A per-token estimate of KL(pi || pi_ref) from the sampled token's log-probabilities under both.

    With log r = log pi_ref(a) - log pi(a) and a ~ pi (Schulman, "Approximating KL divergence", 2020):
        k1 = -log r                 unbiased, high variance, can be negative
        k2 = (log r)^2 / 2          biased, low variance, >= 0
        k3 = (r - 1) - log r        unbiased, low variance, >= 0
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        # as verl's low_var_kl: the log-ratio clamped to +-LOG_RATIO_CLAMP before exp (a token the reference all
        # but forbids would make r overflow) and the estimate to +-K3_CLAMP, so one such token cannot swamp a batch
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.expm1(log_r) - log_r).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where mask is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked positions; padding stays 0. A single position is only centred."""
    n = mask.sum()
    mean = masked_mean(x, mask)
    if n < 2:
        return (x - mean) * mask
    var = ((x - mean).square() * mask).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + eps) * mask


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """A [B, T] per-token loss to a scalar.

    token-mean:            sum of all tokens' losses / number of tokens (every token weighs the same; verl's default)
    seq-mean-token-sum:    mean over responses of each response's summed loss (long responses weigh more)
    seq-mean-token-mean:   mean over responses of each response's mean loss (every response weighs the same)
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    per_seq = (loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    has_tokens = (mask.sum(-1) > 0).to(loss.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL_t on every response token, plus the response's score on its last token.

    The KL-in-reward form of Ziegler et al. (2019) and InstructGPT, as verl's `use_kl_in_reward`:
        r_t = -beta * KL_t + [t = last] * score
    """
    rewards = -kl_coef * kl * mask
    last = (mask.sum(-1).long() - 1).clamp_min(0)
    rows = torch.arange(mask.shape[0])
    has_tokens = mask.sum(-1) > 0
    rewards[rows[has_tokens], last[has_tokens]] += scores[has_tokens].to(rewards.dtype)
    return rewards


@dataclass
class TokenPolicyTerms:
    loss: torch.Tensor
    ratio: torch.Tensor  # pi_theta / pi_prox per token
    approx_kl: torch.Tensor  # k3 of KL(pi_prox || pi_theta), token mean
    clipfrac: torch.Tensor  # tokens whose ratio left [1 - clip_low, 1 + clip_high], token mean
    dual_clipfrac: torch.Tensor  # tokens with A < 0 whose loss the dual-clip bound cut
    is_weight: torch.Tensor  # mean behaviour correction w over the tokens
    is_capped: torch.Tensor  # fraction of tokens whose w was cut at the cap


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = 3.0,
    behaviour_logp: torch.Tensor | None = None,
    is_cap: float = math.inf,
    aggregation: str = "token-mean",
) -> TokenPolicyTerms:
    """The clipped surrogate per token, with separate low/high clip ranges (DAPO's clip-higher), the
    dual-clip bound for negative advantages (Ye et al. 2020) and the decoupled behaviour correction.

        r_t  = pi_theta(a_t) / pi_prox(a_t)
        L1_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        L_t  = min(L1_t, -A_t c)   where A_t < 0 (c = clip_ratio_c > 1), else L1_t
        w_t  = min(pi_prox(a_t) / mu(a_t), is_cap), no gradient (1 without behaviour_logp)
        loss = aggregate(w_t L_t)
    """
    if clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c must be above 1, got {clip_ratio_c}")
    logratio = (logp - prox_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # as verl: exp must not overflow to inf
    ratio = logratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    l1 = torch.maximum(unclipped, clipped)
    bound = -advantages * clip_ratio_c
    per_token = torch.where(advantages < 0, torch.minimum(l1, bound), l1)
    if behaviour_logp is None:
        weight = torch.ones_like(prox_logp)
        capped = torch.zeros(())
    else:
        with torch.no_grad():
            raw = (prox_logp.detach() - behaviour_logp).exp()
            weight = raw.clamp(max=is_cap)
            capped = masked_mean((raw > is_cap).to(mask.dtype), mask)
    loss = aggregate(weight * per_token, mask, aggregation)
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1) - logratio, mask)
        clipfrac = masked_mean(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).to(mask.dtype), mask)
        dual = masked_mean(((advantages < 0) & (l1 > bound)).to(mask.dtype), mask)
        mean_weight = masked_mean(weight, mask)
    return TokenPolicyTerms(loss, ratio, approx_kl, clipfrac, dual, mean_weight, capped)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.0,
    huber_delta: float = 0.0,
    aggregation: str = "token-mean",
) -> torch.Tensor:
    """The critic's loss per token, aggregated as the policy's.

    f(e)  = e^2 / 2, or Huber with `huber_delta` > 0: e^2 / 2 for |e| <= d, d (|e| - d / 2) beyond
    L_t   = f(V_t - R_t)                                            clip = 0
    L_t   = max(f(V_t - R_t), f(V_old + clip(V_t - V_old, -clip, clip) - R_t))   clip > 0
    """

    def f(error: torch.Tensor) -> torch.Tensor:
        if huber_delta > 0:
            return torch.nn.functional.huber_loss(error, torch.zeros_like(error), reduction="none", delta=huber_delta)
        return 0.5 * error.square()

    loss = f(values - returns)
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, f(clipped - returns))
    return aggregate(loss, mask, aggregation)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
