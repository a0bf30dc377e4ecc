"""One PPO update, for both kinds of policy: the critic's epochs, then the policy's, with gradient accumulation.

Read top to bottom like CleanRL's update; the loss terms are in learner_node/core_algos.py. What differs between
choosing among candidates and generating a response is how a batch is built and how log-probabilities,
entropies and values are computed for it: that is the `PolicyBatch` interface, implemented by
`rollout.CandidateBatch` (a sample is one choice: one "token") and `generation.GenerationUpdate` (a sample is
a response of many tokens). Everything else (epochs, a fresh permutation each, minibatches, micro-batches,
each micro-batch's share of its minibatch's loss, gradient clipping, the target-KL stop, distributed
averaging, metrics) is `ppo_update` and `minibatch_epochs`, here, once.

Every per-token tensor of an update is [B, T] at the batch's one width T, on the model's device, from the
start (`Targets`): a micro-batch's forward returns its rows at that width, so nothing is re-padded between
steps and nothing moves between devices except figures.

With several processes (accelerate / torch.distributed), each rank takes its share of every minibatch and
gradients are averaged across ranks before each optimizer step, so an update equals the one-process update
on the same batch. Parameters sharded by FSDP2 (learner_node/sharding.py: DTensors) have their gradients
reduce-scattered by FSDP itself in each backward; only the others are averaged here.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common.learner_figures import CyclePhase, UpdateFigure
from learner_node import core_algos, gradients
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.cycle import CycleClock
from learner_node.sharding import Lockstep


class NonFiniteUpdate(RuntimeError):
    """The update would put a non-finite number into the weights (`what` says where it showed first).

    Raised before the optimizer step that would apply it, or right after a step that made a parameter
    non-finite; the caller restores the weights and optimizer states it held before the update
    (learner_node/worker.py) so that nothing of the update is kept. Every rank raises it at the same
    step: the figures, the gradient norm and the parameters it checks are the same on every rank
    (gradients and figures are reduced over ranks before they are checked)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _all_finite(params: list[torch.nn.Parameter]) -> bool:
    """Whether every element of `params` is finite: one max-abs norm per tensor (NaN and inf propagate into it),
    computed by one foreach kernel instead of two tensor ops per parameter. Empty tensors have no max-abs norm.

    Of a parameter FSDP2 shards (a DTensor) each rank checks its own shard, and the ranks then agree in one
    all-reduce, so that every rank gives the same answer (and raises at the same step)."""
    local = [p.to_local() for p in params if isinstance(p, DTensor)]
    finite = _finite([p for p in params if not isinstance(p, DTensor)]) and _finite(local)
    if local:
        flag = torch.tensor([float(finite)], device=local[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        finite = bool(flag.item())
    return finite


def _finite(tensors: list[torch.Tensor]) -> bool:
    filled = tuple(t for t in tensors if t.numel())
    if not filled:
        return True
    norms = torch._foreach_norm(filled, float("inf"))
    return bool(torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms])).all())


def _require_finite(name: str, values: torch.Tensor) -> None:
    if not bool(torch.isfinite(values).all()):
        bad = values[~torch.isfinite(values)]
        raise NonFiniteUpdate(f"{name} hold {bad.numel()} non-finite values (first {float(bad[0])}) before any step")


@dataclass
class Targets:
    """What an update trains towards, computed once with no gradient: [B, T] on the model's device."""

    mask: torch.Tensor  # 1 on the tokens trained on
    behaviour_logp: torch.Tensor  # log mu: the actor's, as it sampled
    prox_logp: torch.Tensor  # log pi_prox: the learner's weights as the update starts
    advantages: torch.Tensor
    returns: torch.Tensor | None = None  # None: no critic (GRPO)
    old_values: torch.Tensor | None = None


@dataclass
class Forward:
    """One micro-batch through the policy, gradients on: [b, T] each, at the batch's width."""

    logp: torch.Tensor  # of the sampled token (the chosen candidate)
    entropy: torch.Tensor  # of the distribution it was sampled from
    kl_ref: torch.Tensor  # KL(pi || pi_ref) per token: exact over candidates, an estimator over a vocabulary


class PolicyBatch(Protocol):
    """How one kind of policy builds its batch and scores it; `ppo_update` does the rest."""

    prefix: str  # of its metrics' keys: "losses" (candidates), "generation" (common/learner_figures.UPDATE_PREFIXES)

    def __len__(self) -> int: ...

    def targets(self, metrics: dict[str, float]) -> Targets:
        """Proximal log-probs, advantages, returns and old values, with no gradient; adds its own figures."""
        ...

    def micro_batches(self, ids: list[int]) -> list[list[int]]:
        """`ids` (a rank's share of a minibatch) cut into groups that go through one forward and backward."""
        ...

    def forward(self, ids: list[int]) -> Forward: ...

    def values(self, ids: list[int]) -> torch.Tensor:
        """The critic's values of samples `ids`, [b, T], gradients on (on cached features: no model forward)."""
        ...


# The figures each loop sums over micro-batches and ranks (the keys its step returns).
CRITIC_FIGURES = (UpdateFigure.VALUE_LOSS,)
POLICY_FIGURES = (
    UpdateFigure.POLICY_LOSS,
    UpdateFigure.ENTROPY,
    UpdateFigure.KL_REF,
    UpdateFigure.APPROX_KL,
    UpdateFigure.CLIPFRAC,
    UpdateFigure.DUAL_CLIPFRAC,
    UpdateFigure.BEHAVIOUR_WEIGHT,
    UpdateFigure.BEHAVIOUR_WEIGHT_CAPPED,
)
# the figures that enter a loss: checked finite
LOSS_FIGURES = frozenset({UpdateFigure.VALUE_LOSS, UpdateFigure.POLICY_LOSS, UpdateFigure.ENTROPY, UpdateFigure.KL_REF})


@dataclass(frozen=True)
class LossSettings:
    """The update's settings, one set for both kinds of policy; `candidates` and `generation` map each config to it."""

    clip: core_algos.ClipRange
    policy_loss: str  # a name of core_algos.POLICY_LOSSES, as the config chose it
    aggregation: str
    ent_coef: float
    kl_coef: float  # of the KL to the reference in the loss (0: none, or it is in the reward)
    value_clip: float
    value_huber_delta: float
    update: UpdateConfig  # epochs, minibatch sizes, objective, behaviour_weight_cap, vf_coef, target_kl, max_grad_norm, seed

    @property
    def decoupled(self) -> bool:
        return self.update.objective == "decoupled"

    @classmethod
    def candidates(cls, cfg: UpdateConfig, kl_coef: float | None = None) -> LossSettings:
        """A choice among candidates: CleanRL's symmetric clip (no dual-clip bound), the exact KL over the candidates
        in the loss; the policy loss `cfg.policy_loss` (clipped by default)."""
        return cls(
            clip=core_algos.ClipRange(cfg.clip_coef, cfg.clip_coef),
            policy_loss=cfg.policy_loss,
            aggregation="token-mean",  # one token per sample: the mean over samples
            ent_coef=cfg.ent_coef,
            kl_coef=cfg.kl_coef if kl_coef is None else kl_coef,
            value_clip=cfg.value_clip or 0.0,
            value_huber_delta=0.0,
            update=cfg,
        )

    @classmethod
    def generation(cls, cfg: UpdateConfig, gen: GenerationConfig) -> LossSettings:
        """A generated response: clip-higher and the dual-clip bound, the KL in the loss only when it is not in the
        reward; the policy loss `gen.policy_loss` (dual-clip by default)."""
        return cls(
            clip=core_algos.ClipRange(gen.clip_low, gen.clip_high, gen.clip_ratio_c),
            policy_loss=gen.policy_loss,
            aggregation=gen.loss_aggregation,
            ent_coef=gen.ent_coef,
            kl_coef=0.0 if gen.kl_in_reward else gen.kl_coef,
            value_clip=gen.value_clip,
            value_huber_delta=gen.value_huber_delta,
            update=cfg,
        )


def ppo_update(
    batch: PolicyBatch,
    policy_params: list[torch.nn.Parameter],
    policy_opt: torch.optim.Optimizer,
    value_params: list[torch.nn.Parameter],
    value_opt: torch.optim.Optimizer,
    settings: LossSettings,
    train_policy: bool = True,
    update_index: int = 0,
    clock: CycleClock | None = None,
) -> dict[str, float]:
    """Train the critic, then (unless `train_policy` is off: the critic's warm-up) the policy on one batch;
    returns the metrics under `<batch.prefix>/...`. `update_index` seeds this update's minibatch permutations
    (the same on every rank, different every update). The model stays in eval mode throughout: no dropout in
    the proximal, reference or new log-probabilities. `clock`: the learner's cycle profile, where the passes without
    gradients that make the targets count as preparing the batch."""
    cfg = settings.update
    rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + update_index)
    metrics: dict[str, float] = {}
    with (clock or CycleClock()).phase(CyclePhase.PREPARE):
        t = batch.targets(metrics)
    n = len(batch)
    trained = t.mask.bool()
    # What the losses train towards, checked once before any step: a reward of 1e300 overflows here first.
    for name, values in (
        ("the advantages", t.advantages),
        ("the returns", t.returns),
        ("the behaviour log-probabilities", t.behaviour_logp),
    ):
        if values is not None:
            _require_finite(name, values[trained])

    if t.returns is not None:  # --- the critic, on cached features ---
        returns, old_values = t.returns, t.old_values if t.old_values is not None else t.returns
        metrics[UpdateFigure.EXPLAINED_VARIANCE] = core_algos.explained_variance(old_values[t.mask.bool()], returns[t.mask.bool()])

        def critic_step(ids: list[int], minibatch: list[int], weight: float = 1.0) -> dict[str, float]:
            loss = core_algos.value_loss(
                batch.values(ids),
                old_values[ids],
                returns[ids],
                t.mask[ids],
                settings.value_clip,
                settings.value_huber_delta,
                settings.aggregation,
            )
            share = core_algos.aggregation_share(t.mask, ids, minibatch, settings.aggregation)
            (cfg.vf_coef * loss * share * _world()[1] * weight).backward()
            return {UpdateFigure.VALUE_LOSS: float(loss.detach()) * share}

        figures, _, _ = minibatch_epochs(
            n, cfg.value_epochs, cfg.value_minibatch, rng, _whole, critic_step, CRITIC_FIGURES, value_params, value_opt, cfg.max_grad_norm
        )
        metrics.update(figures)
    if not train_policy:
        return _prefixed(batch.prefix, metrics)

    old = t.prox_logp if settings.decoupled else t.behaviour_logp  # what the ratio, the clipping and target-KL measure against
    first_ratio_dev: list[float] = []
    lockstep = Lockstep.of(policy_params)  # FSDP-sharded: every rank runs as many forwards (learner_node/sharding.py)

    def policy_step(ids: list[int], minibatch: list[int], weight: float = 1.0) -> dict[str, float]:
        f, padding = lockstep.run(lambda: batch.forward(ids))
        mask = t.mask[ids]
        terms = core_algos.policy_loss(
            f.logp,
            old[ids],
            t.advantages[ids],
            mask,
            settings.clip,
            t.behaviour_logp[ids] if settings.decoupled else None,
            cfg.behaviour_weight_cap,
            settings.aggregation,
            settings.policy_loss,
        )
        entropy = core_algos.aggregate(f.entropy, mask, settings.aggregation)
        kl_ref = core_algos.aggregate(f.kl_ref, mask, settings.aggregation)
        loss = terms.loss - settings.ent_coef * entropy
        if settings.kl_coef:
            loss = loss + settings.kl_coef * kl_ref
        share = core_algos.aggregation_share(t.mask, ids, minibatch, settings.aggregation)
        (loss * share * _world()[1] * weight + padding).backward()
        if not first_ratio_dev:
            first_ratio_dev.append(float(((terms.ratio.detach() - 1).abs() * mask).max()))
        tokens = core_algos.aggregation_share(t.mask, ids, minibatch, "token-mean")  # token means weigh by tokens
        return {
            UpdateFigure.POLICY_LOSS: float(terms.loss.detach()) * share,
            UpdateFigure.ENTROPY: float(entropy.detach()) * share,
            UpdateFigure.KL_REF: float(kl_ref.detach()) * share,
            UpdateFigure.APPROX_KL: float(terms.approx_kl) * tokens,
            UpdateFigure.CLIPFRAC: float(terms.clipfrac) * tokens,
            UpdateFigure.DUAL_CLIPFRAC: float(terms.dual_clipfrac) * tokens,
            UpdateFigure.BEHAVIOUR_WEIGHT: float(terms.is_weight) * tokens,
            UpdateFigure.BEHAVIOUR_WEIGHT_CAPPED: float(terms.is_capped) * tokens,
        }

    figures, steps, stopped = minibatch_epochs(
        n,
        cfg.update_epochs,
        cfg.policy_minibatch,
        rng,
        batch.micro_batches,
        policy_step,
        POLICY_FIGURES,
        policy_params,
        policy_opt,
        cfg.max_grad_norm,
        cfg.target_kl or None,
    )
    metrics.update(figures)
    metrics[UpdateFigure.FIRST_MINIBATCH_RATIO_DEV] = first_ratio_dev[0] if first_ratio_dev else math.nan
    metrics[UpdateFigure.OPTIMIZER_STEPS] = float(steps)
    metrics[UpdateFigure.EARLY_STOP] = float(stopped)
    metrics[UpdateFigure.KL_COEF] = settings.kl_coef
    return _prefixed(batch.prefix, metrics)


def minibatch_epochs(
    n: int,
    epochs: int,
    minibatch: int,
    rng: torch.Generator,
    micro_batches: Callable[[list[int]], list[list[int]]],
    step: Callable[[list[int], list[int], float], dict[str, float]],
    figure_keys: tuple[str, ...],
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    target_kl: float | None = None,
) -> tuple[dict[str, float], int, bool]:
    """The loop both the critic and the policy train in: `epochs` passes over the n samples in a fresh
    permutation each, one optimizer step per minibatch. Each rank takes every world-th sample of a minibatch
    and cuts its share into `micro_batches`; `step(micro, minibatch, weight)` runs one micro-batch's forward and
    backward, its loss scaled to its share of the minibatch's loss (and by `weight`, 1 but for padding passes),
    and returns its figures (`figure_keys`) so scaled. With FSDP-sharded `params` every rank runs as many
    forwards and backwards as the rank with the most micro-batches (`_padding`). The figures of a minibatch are
    summed over micro-batches and ranks (so each is the minibatch's own), and averaged over minibatches. With
    `target_kl`, the epochs stop once a minibatch's "approx_kl" exceeds it, checked after its step (no accumulated
    gradient is thrown away).

    Returns (figures, optimizer steps, whether the target-KL stop ended the epochs)."""
    try:
        rank, world = _world()
        sharded = world > 1 and Lockstep.of(params).root is not None  # a LoRA model's trained parameters are whole
        totals: dict[str, float] = collections.defaultdict(float)
        steps = 0
        for _ in range(epochs):
            perm = torch.randperm(n, generator=rng)
            for start in range(0, n, minibatch):
                mb = perm[start : start + minibatch].tolist()
                optimizer.zero_grad()
                gradients.clear(params)
                parts = dict.fromkeys(figure_keys, 0.0)  # a rank with no share of this minibatch sends zeros
                micros = micro_batches(mb[rank::world])
                for micro in micros:
                    for key, value in step(micro, mb, 1.0).items():
                        parts[key] += value
                    gradients.accumulate(params)
                for _ in range(_padding(micro_batches, mb, len(micros), world) if sharded else 0):
                    step(mb[:1], mb, 0.0)  # its figures are left out: its loss is weighed 0
                    gradients.accumulate(params)
                gradients.average(params)
                grad_norm = gradients.clip(params, max_grad_norm)
                figures = _sum_over_ranks(parts, params[0].device if params else torch.device("cpu"))
                # Nothing non-finite is applied: a NaN loss or gradient stops the update before its step, and a
                # step that overflowed a parameter (finite gradient, absurd scale) right after it.
                losses = {key: value for key, value in figures.items() if key in LOSS_FIGURES}
                if not all(math.isfinite(value) for value in losses.values()):
                    raise NonFiniteUpdate(f"the loss is not finite at optimizer step {steps + 1} ({losses})")
                if not bool(torch.isfinite(grad_norm)):
                    raise NonFiniteUpdate(f"the gradient norm is {float(grad_norm)} at optimizer step {steps + 1}")
                optimizer.step()
                gradients.clear(params)
                steps += 1
                if params and not _all_finite(params):
                    raise NonFiniteUpdate(f"a parameter became non-finite at optimizer step {steps} (gradient norm {float(grad_norm):g})")
                for key, value in figures.items():
                    totals[key] += value
                if target_kl and figures.get(UpdateFigure.APPROX_KL, 0.0) > target_kl:
                    return {k: v / steps for k, v in totals.items()}, steps, True
        return {k: v / max(steps, 1) for k, v in totals.items()}, steps, False
    finally:
        gradients.clear(params)  # no float32 gradient sum outlives its update: not past a raise, nor a target-KL stop


_world = gradients.rank_and_world


def _whole(ids: list[int]) -> list[list[int]]:
    """The critic trains on cached features: a rank's share of a minibatch is one micro-batch."""
    return [ids] if ids else []


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    """The figures under their published names (common/learner_figures.py), plain strings."""
    return {f"{prefix}/{key}": value for key, value in metrics.items()}


def _padding(micro_batches: Callable[[list[int]], list[list[int]]], mb: list[int], mine: int, world: int) -> int:
    """How many micro-batch passes this rank, with `mine` micro-batches of minibatch `mb`, runs besides them so
    that every rank runs as many as the busiest one: FSDP2 reduce-scatters each block's gradients in every
    backward, a collective that every rank must enter the same number of times, or the ranks wait on each other
    for ever (within a pass, `sharding.Lockstep` matches the forwards). A padding pass is one sample of the
    minibatch with its loss weighed 0: zero gradients, no figures. Every rank cuts every rank's share itself
    (`micro_batches` depends on the samples alone), so no collective is needed to agree on the count."""
    return max(len(micro_batches(mb[r::world])) for r in range(world)) - mine


def _sum_over_ranks(parts: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each rank's figures summed over the ranks: every rank holds the same keys in the same order, so one
    all-reduce of one vector, on the parameters' device (NCCL reduces only there)."""
    _, world = _world()
    if world == 1:
        return parts
    t = torch.tensor(list(parts.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(parts, t.tolist(), strict=True))
