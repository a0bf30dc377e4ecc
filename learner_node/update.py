"""One PPO update over a rollout: the critic on cached features, then the policy with gradient accumulation.

Read top to bottom like CleanRL's update; the loss terms are in learner_node/ppo.py.
With several processes (accelerate / torch.distributed), each rank takes its
share of every minibatch and gradients are averaged across ranks before each
optimizer step, so an update equals the one-process update on the same batch.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from learner_node import ppo
from learner_node.config import UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.rollout import Rollout

log = logging.getLogger(__name__)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _average_gradients(params: list[torch.nn.Parameter]) -> None:
    rank, world = _world()
    if world == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world


def _mean_over_ranks(value: float) -> float:
    rank, world = _world()
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def ppo_update(
    lp: LearnerPolicy,
    policy_opt: torch.optim.Optimizer,
    value_opt: torch.optim.Optimizer,
    rollout: Rollout,
    cfg: UpdateConfig,
    train_policy: bool = True,
    kl_coef: float | None = None,
    features: torch.Tensor | None = None,
    update_index: int = 0,
) -> dict[str, float]:
    """Train critic and policy on one rollout; returns the metrics under their usual slash keys.

    `features`: the critic features of the rollout's observations, if the caller has them already
    (the worker computed them for GAE); otherwise they are computed here. `update_index` seeds
    this update's minibatch permutations (the same on every rank, different every update).
    The model stays in eval mode throughout: no dropout in the proximal, reference or new log-probs."""
    rank, world = _world()
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + update_index)
    kl_coef = cfg.kl_coef if kl_coef is None else kl_coef
    items = [lp.tokenize(o) for o in rollout.obs]
    n = len(items)
    b_actions = torch.tensor(rollout.actions)
    b_logprobs = torch.tensor(rollout.logprobs)
    b_advantages = ppo.normalise_advantages(torch.tensor(rollout.advantages))
    b_returns = torch.tensor(rollout.returns)
    b_values = torch.tensor(rollout.values)
    device = next(lp.value_head.parameters()).device
    metrics: dict[str, float] = {}
    # Explained variance of the values the targets were built with (before this update fits the critic).
    metrics["losses/explained_variance"] = ppo.explained_variance(b_values, b_returns)

    # --- critic: features of the frozen base, computed once ----------------------------------
    if features is None:
        features = lp.features(items)
    value_params = list(lp.value_head.parameters())
    v_losses = []
    for _ in range(cfg.value_epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.value_minibatch):
            mb_inds = perm[start : start + cfg.value_minibatch]
            mine = mb_inds[rank::world]
            value_opt.zero_grad()
            v_loss = torch.zeros(())
            if len(mine):
                newvalue = lp.value_head(features[mine.to(device)]).cpu()
                v_loss = ppo.value_loss(newvalue, b_values[mine], b_returns[mine], cfg.value_clip or None)
                # This rank's mean, weighted so the average over ranks is the minibatch mean.
                (cfg.vf_coef * v_loss * len(mine) * world / len(mb_inds)).backward()
            _average_gradients(value_params)
            torch.nn.utils.clip_grad_norm_(value_params, cfg.max_grad_norm)
            value_opt.step()
            v_losses.append(_mean_over_ranks(float(v_loss.detach()) * len(mine) * world / len(mb_inds)))
    metrics["losses/value_loss"] = sum(v_losses) / max(len(v_losses), 1)

    if not train_policy:
        return metrics

    # --- the proximal policy: the learner's weights as the update starts ---------------------
    # (every rank scores the whole rollout: each takes a different share of every minibatch)
    with torch.no_grad():
        prox_all = [logp.cpu() for start in range(0, n, cfg.micro_batch) for logp in lp.logp_all(items[start : start + cfg.micro_batch])]
    b_proxlogprobs = torch.stack([logp[a] for logp, a in zip(prox_all, b_actions.tolist(), strict=True)])
    kl_behaviour = [float(ppo.kl_behaviour(torch.tensor(mu), logp)) for mu, logp in zip(rollout.probs, prox_all, strict=True)]
    metrics["losses/kl_behaviour"] = _mean(kl_behaviour)
    # Actor and learner must score the same function: on transitions the current weights chose,
    # the learner's log-prob equals the actor's (to float rounding). A gap here is a defect, not staleness.
    on_policy = [i for i, lag in enumerate(rollout.lags) if lag == 0]
    metrics["losses/on_policy_logprob_dev"] = (
        float((b_proxlogprobs[on_policy] - b_logprobs[on_policy]).abs().max()) if on_policy else math.nan
    )
    decoupled = cfg.objective == "decoupled"
    b_old = b_proxlogprobs if decoupled else b_logprobs  # what the ratio, the clipping and target-KL measure against

    # --- policy: recomputed candidate distributions, gradients through the adapter ------------
    ref_logp = lp.reference_logp_all(items)
    policy_params = lp.trainable_parameters()
    pg_losses, entropies, kls, approx_kls, clipfracs, weights, capped = [], [], [], [], [], [], []
    first_ratio_dev = None
    optimizer_steps = 0
    stopped_early = False
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.policy_minibatch):
            mb_inds = perm[start : start + cfg.policy_minibatch]
            mine = mb_inds[rank::world]
            policy_opt.zero_grad()
            mb_kl = 0.0
            for micro_start in range(0, len(mine), cfg.micro_batch):
                micro = mine[micro_start : micro_start + cfg.micro_batch].tolist()
                logp_all = lp.logp_all([items[i] for i in micro])
                newlogprob = torch.stack([logp[b_actions[i]] for logp, i in zip(logp_all, micro, strict=True)]).cpu()
                entropy = torch.stack([ppo.entropy(logp) for logp in logp_all]).cpu()
                kl_ref = torch.stack([ppo.kl_to_reference(logp, ref_logp[i]) for logp, i in zip(logp_all, micro, strict=True)]).cpu()
                terms = ppo.policy_loss(
                    newlogprob,
                    b_old[micro],
                    b_advantages[micro],
                    cfg.clip_coef,
                    b_logprobs[micro] if decoupled else None,
                    cfg.behaviour_weight_cap,
                )
                loss = terms.pg_loss - cfg.ent_coef * entropy.mean() + kl_coef * kl_ref.mean()
                # Each micro-batch's mean, weighted to a mean over the whole minibatch (all ranks).
                (loss * len(micro) * world / len(mb_inds)).backward()
                if first_ratio_dev is None:
                    first_ratio_dev = float((terms.ratio.detach() - 1).abs().max())
                mb_kl += float(terms.approx_kl) * len(micro) / max(len(mine), 1)
                pg_losses.append(float(terms.pg_loss.detach()))
                entropies.append(float(entropy.detach().mean()))
                kls.append(float(kl_ref.detach().mean()))
                clipfracs.append(float(terms.clipfrac))
                weights.append(float(terms.is_weight.mean()))
                capped.append(float(terms.is_capped))
            _average_gradients(policy_params)
            torch.nn.utils.clip_grad_norm_(policy_params, cfg.max_grad_norm)
            policy_opt.step()
            optimizer_steps += 1
            mb_kl = _mean_over_ranks(mb_kl)
            approx_kls.append(mb_kl)
            # Checked per optimizer step, after the step: no accumulated gradient is thrown away.
            if cfg.target_kl and mb_kl > cfg.target_kl:
                stopped_early = True
                break
        if stopped_early:
            break
    metrics.update(
        {
            "losses/policy_loss": _mean(pg_losses),
            "losses/entropy": _mean(entropies),
            "losses/kl_ref": _mean(kls),
            "losses/approx_kl": _mean(approx_kls),
            "losses/clipfrac": _mean(clipfracs),
            "losses/behaviour_weight": _mean(weights),
            "losses/behaviour_weight_capped": _mean(capped),
            "losses/first_minibatch_ratio_dev": first_ratio_dev if first_ratio_dev is not None else math.nan,
            "losses/optimizer_steps": optimizer_steps,
            "losses/early_stop": float(stopped_early),
            "losses/kl_coef": kl_coef,
        }
    )
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
