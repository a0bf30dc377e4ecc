"""The PPO math of both kinds of policy, in one place: tensors in, tensors out. No sockets, no Redis, no model.

In the spirit of verl's `trainer/ppo/core_algos.py`: every choice a config names is a pure function in a
registry here, with its formula, and docs/design.md gives the sources. Shapes: every per-token tensor is
[B, T] (B samples right-padded to T tokens) with a `mask` [B, T], 1 on the tokens trained on. A choice among
candidates is a sample of one token (T = 1): its log-probability is the chosen candidate's, and the same
functions give exactly the per-sample PPO of CleanRL.

Registries (names validated against common/options.py, importable without torch):
- ADVANTAGE_ESTIMATORS: every advantage estimator a config can name (gae, grpo, rloo).
- KL_ESTIMATORS: per-token estimates of KL(pi || pi_ref) from the sampled token (k1, k2, k3).
- LOSS_AGGREGATIONS: a [B, T] loss to a scalar (token-mean, seq-mean-token-sum, seq-mean-token-mean).
- POLICY_LOSSES: the per-token surrogate (clipped; dual-clip), before the decoupled behaviour weight.
Advantages: the learner runs `gae` over a sequence of steps with its critic. The group-relative estimators
(GROUP_ESTIMATORS: grpo, rloo) need a prompt's whole group, which only the driver holds: the drivers apply them
(dataset_driver/group_advantage.py) and each response's advantage reaches the learner as its reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

LOG_RATIO_CLAMP = 20.0  # verl's bound on a log-ratio before exp (core_algos.py): exp must not overflow to inf
K3_CLAMP = 10.0  # verl's bound on the k3 estimate of one token


# --- advantages ----------------------------------------------------------------------------------
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: float | torch.Tensor,
    gamma: float,
    lam: float,
    ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns of a sequence of steps (Schulman et al. 2016).

    delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)
    A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
    `dones[t]` is true when the episode ended with step t: its reward is kept and nothing is bootstrapped
    after it. `next_value` values the observation after the last step (0 when it ended with done).
    A step is a choice among candidates, or one token of a response.

    Several sequences packed end to end: `ends` [T] (bool) marks each one's last step, and `next_value` holds
    one value per marked step, in order: V(s_{t+1}) of a marked step is its `next_value`, not the following
    sequence's first value, and A_{t+1} does not reach back across it. Without `ends` the one sequence ends at
    its last step. The recursion runs as a scan (`reverse_linear_scan`): about 20 tensor operations for any T,
    where a step-by-step loop is T Python iterations of a dozen kernels each (docs/design.md)."""
    steps = rewards.shape[0]
    if ends is None:
        ends = torch.zeros(steps, dtype=torch.bool, device=rewards.device)
        if steps:
            ends[-1] = True
    ends = ends.to(device=rewards.device, dtype=torch.bool)
    not_done = 1.0 - dones.to(rewards.dtype)
    following = torch.empty_like(values)
    following[:-1] = values[1:]
    boot = torch.as_tensor(next_value, dtype=rewards.dtype, device=rewards.device)
    following[ends] = boot.reshape(-1) if boot.dim() else boot
    deltas = rewards + gamma * following * not_done - values
    decay = gamma * lam * not_done * (~ends).to(rewards.dtype)
    advantages = reverse_linear_scan(deltas, decay)
    return advantages, advantages + values


def reverse_linear_scan(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """y with y_t = x_t + decay_t * y_{t+1} (y past the end is 0), for a 1-D x.

    A Hillis-Steele scan (Blelloch 1990, "Prefix sums and their applications"): the pairs (decay, x) compose
    associatively, (a, u) after (b, v) = (a b, u + a v), so after the round with shift s each position holds
    the composition of the 2s steps from it (ceil(log2 T) rounds, each a few whole-tensor operations). No
    powers of gamma*lam are divided out, so nothing overflows: a product that underflows is a term that no
    longer counts."""
    y, a = x.clone(), decay.clone()
    shift = 1
    while shift < y.shape[0]:
        y[:-shift] = y[:-shift] + a[:-shift] * y[shift:]  # the right-hand side is evaluated before the write
        a[:-shift] = a[:-shift] * a[shift:]  # past the end it is never read again: t + shift >= T from here on
        shift *= 2
    return y


def grpo(rewards: Sequence[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Group-relative advantages of G responses to one prompt, from their rewards r_1..r_G (Shao et al. 2024,
    "DeepSeekMath", section 4.1.2, outcome supervision):

        A_i = (r_i - mean(r)) / (std(r) + eps)        every token of response i gets A_i

    with std the sample standard deviation (n - 1), as verl's `compute_grpo_outcome_advantage` takes it. With
    `scale_by_std` off only centred, A_i = r_i - mean(r) (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    Dr. GRPO): dividing by a group's std weighs prompts that are almost always (or never) solved the most."""
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def rloo(rewards: Sequence[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): each response against
    the mean of the others, A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean(r)); as verl's
    compute_rloo_outcome_advantage. An unbiased baseline: r_i is not in its own. No scaling (`scale_by_std` and
    `eps` are taken, as by every group estimator, and not used)."""
    n = len(rewards)
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


# Every advantage estimator a config names ([generation] advantage). gae: (rewards, values, dones, next_value,
# gamma, lam) tensors of a sequence of steps, with the learner's critic. The group estimators: (the rewards of
# one prompt's responses, scale_by_std, eps) floats, one advantage per response, in order.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {"gae": gae, "grpo": grpo, "rloo": rloo}
GROUP_ESTIMATORS = ("grpo", "rloo")  # over a prompt's group of responses: applied by the drivers, which hold the group


# --- masks and aggregations ----------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where mask is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked positions (std with n - 1, over the whole batch: a minibatch of one
    would whiten to 0); padding stays 0. A single position is only centred. The mean and std are torch's own
    over the masked values, so a full mask gives exactly (x - x.mean()) / (x.std() + eps), CleanRL's figure:
    the candidate path's numbers did not move when it joined the one update loop (docs/design.md)."""
    values = x[mask.bool()]
    if values.numel() == 0:
        return x * mask
    mean = values.mean()
    if values.numel() < 2:
        return (x - mean) * mask
    return (x - mean) / (values.std() + eps) * mask


def _token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(loss, mask)


def _seq_mean(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    has_tokens = (mask.sum(-1) > 0).to(per_seq.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1)


def _seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_mean((loss * mask).sum(-1), mask)


def _seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_mean((loss * mask).sum(-1) / mask.sum(-1).clamp_min(1), mask)


# token-mean:          sum of all tokens' losses / number of tokens (every token weighs the same; verl's default)
# seq-mean-token-sum:  mean over responses of each response's summed loss (long responses weigh more)
# seq-mean-token-mean: mean over responses of each response's mean loss (every response weighs the same)
LOSS_AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """A [B, T] per-token loss to a scalar, by the aggregation named `mode` (LOSS_AGGREGATIONS)."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode](loss, mask)


def aggregation_share(mask: torch.Tensor, part: list[int], whole: list[int], mode: str) -> float:
    """The share of `whole`'s aggregated loss that the samples `part` carry, so that the parts' losses, each
    aggregated over its own samples and scaled by its share, add up to the whole's: by tokens for
    token-mean, by samples for the per-sequence means. Gradient accumulation over micro-batches and
    averaging over ranks both rest on this."""
    if mode == "token-mean":
        return float(mask[part].sum()) / max(float(mask[whole].sum()), 1.0)
    return len(part) / max(len(whole), 1)


# --- KL estimators -------------------------------------------------------------------------------
# With log r = log pi_ref(a) - log pi(a) and a ~ pi (Schulman, "Approximating KL divergence", 2020):
#     k1 = -log r                 unbiased, high variance, can be negative
#     k2 = (log r)^2 / 2          biased, low variance, >= 0
#     k3 = (r - 1) - log r        unbiased, low variance, >= 0
def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    # as verl's low_var_kl: the log-ratio clamped before exp (a token the reference all but forbids would make
    # r overflow) and the estimate clamped, so that one such token cannot swamp a batch
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.expm1(log_r) - log_r).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """A per-token estimate of KL(pi || pi_ref) from the sampled token's log-probabilities under both."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](ref_logp - logp)


def kl_exact(logp_all: torch.Tensor, ref_logp_all: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref), exact over a finite candidate set (the last dimension)."""
    return (logp_all.exp() * (logp_all - ref_logp_all)).sum(-1)


def kl_behaviour(behaviour_probs: torch.Tensor, logp_all: torch.Tensor) -> torch.Tensor:
    """KL(mu || pi), exact over the finite candidate set, from the behaviour probabilities the actor logged.

    Terms with mu(a) = 0 contribute 0 (the limit of p log p); how far the learner's policy has moved from
    the one that acted, which the ratio on the one chosen action only samples."""
    mu = behaviour_probs.to(logp_all.dtype)
    log_mu = torch.where(mu > 0, mu.clamp_min(torch.finfo(mu.dtype).tiny).log(), torch.zeros_like(mu))
    return (mu * (log_mu - logp_all)).sum(-1)


def entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """Entropy of a distribution from its log-probabilities over the last dimension (candidates or vocabulary)."""
    return -(logp_all.exp() * logp_all).sum(-1)


# --- policy losses -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClipRange:
    """The trust region of the ratio: [1 - low, 1 + high] (DAPO's clip-higher when high > low), and the
    dual-clip bound c for negative advantages (None: no dual clip)."""

    low: float
    high: float
    dual_c: float | None = None

    def __post_init__(self) -> None:
        if self.dual_c is not None and self.dual_c <= 1:
            raise ValueError(f"clip_ratio_c must be above 1, got {self.dual_c}")


@dataclass
class Surrogate:
    per_token: torch.Tensor  # the loss of each token, before the behaviour weight and the aggregation
    clipped: torch.Tensor  # bool: tokens where the clipped term was the larger (verl's pg_clipfrac)
    dual_clipped: torch.Tensor  # bool: tokens with A < 0 whose loss the dual-clip bound cut (pg_clipfrac_lower)


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipRange) -> Surrogate:
    """L_t = max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high))          (Schulman et al. 2017)"""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    return Surrogate(torch.maximum(unclipped, clipped), clipped > unclipped, torch.zeros_like(ratio, dtype=torch.bool))


def _dual_clipped(ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipRange) -> Surrogate:
    """L_t = min(L1_t, -A_t c) where A_t < 0, else L1_t, with L1 the clipped surrogate (Ye et al. 2020): a token
    with a negative advantage whose ratio ran far above the region loses at most c |A_t|."""
    plain = _clipped(ratio, advantages, clip)
    if clip.dual_c is None:
        return plain
    bound = -advantages * clip.dual_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(plain.per_token, bound), plain.per_token)
    return Surrogate(per_token, plain.clipped, negative & (plain.per_token > bound))


POLICY_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, ClipRange], Surrogate]] = {
    "clipped": _clipped,
    "dual-clip": _dual_clipped,
}


@dataclass
class PolicyTerms:
    loss: torch.Tensor
    ratio: torch.Tensor  # pi_theta / pi_prox per token
    approx_kl: torch.Tensor  # k3 of KL(pi_prox || pi_theta), masked token mean (CleanRL's approx_kl)
    clipfrac: torch.Tensor  # tokens where clipping took effect, masked token mean, as verl counts pg_clipfrac
    dual_clipfrac: torch.Tensor  # tokens whose loss the dual-clip bound cut, masked token mean (pg_clipfrac_lower)
    is_weight: torch.Tensor  # mean behaviour correction w over the tokens
    is_capped: torch.Tensor  # fraction of tokens whose w was cut at the cap


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
    behaviour_logp: torch.Tensor | None = None,
    is_cap: float = math.inf,
    aggregation: str = "token-mean",
    kind: str = "dual-clip",
) -> PolicyTerms:
    """The surrogate `kind` (POLICY_LOSSES) per token, with the decoupled behaviour correction, aggregated.

        r_t  = pi_theta(a_t) / pi_prox(a_t)          the log-ratio clamped to +-20 first, as verl
        w_t  = min(pi_prox(a_t) / mu(a_t), is_cap)   no gradient; 1 without behaviour_logp
        loss = aggregate(w_t L_t(r_t, A_t))

    Plain PPO when the proximal policy is the behaviour policy (`behaviour_logp` None). Otherwise the decoupled
    objective of Hilton et al. (2021), as AReaL (Fu et al. 2025) uses it for stale rollouts: mu is the
    behaviour policy (the actor's weights, possibly several versions old) and pi_prox the learner's weights at
    the start of the update. Clipping against pi_prox keeps every stale sample inside the trust region, and w
    makes the expectation over mu one over pi_prox; the cap (truncated importance sampling, as IMPALA's
    V-trace) bounds its variance.
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; known: {', '.join(POLICY_LOSSES)}")
    logratio = (logp - prox_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = logratio.exp()
    surrogate = POLICY_LOSSES[kind](ratio, advantages, clip)
    if behaviour_logp is None:
        weight = torch.ones_like(prox_logp)
        capped = torch.zeros((), device=mask.device)
    else:
        with torch.no_grad():
            raw = (prox_logp.detach() - behaviour_logp).exp()
            weight = raw.clamp(max=is_cap)
            capped = masked_mean((raw > is_cap).to(mask.dtype), mask)
    loss = aggregate(weight * surrogate.per_token, mask, aggregation)
    with torch.no_grad():
        # http://joschu.net/blog/kl-approx.html
        approx_kl = masked_mean((ratio - 1) - logratio, mask)
        clipfrac = masked_mean(surrogate.clipped.to(mask.dtype), mask)
        dual = masked_mean(surrogate.dual_clipped.to(mask.dtype), mask)
        mean_weight = masked_mean(weight, mask)
    return PolicyTerms(loss, ratio, approx_kl, clipfrac, dual, mean_weight, capped)


# --- the critic ----------------------------------------------------------------------------------
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
    L_t   = f(V_t - R_t)                                                          clip = 0
    L_t   = max(f(V_t - R_t), f(V_old + clip(V_t - V_old, -clip, clip) - R_t))     clip > 0 (PPO's value clipping)
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
