"""Generation-mode PPO in the learner: generate transitions -> a token-level batch -> one update.

Three parts, top to bottom:

- Packed forwards (`packed_hidden`, `response_logprobs`): prompts and responses of
  different lengths go one after another in rows as long as the longest sequence,
  position ids restarting at 0 for each, under a block-diagonal causal 4D mask (as
  the scoring path builds its own), so each sequence sees only itself and little
  compute goes to padding; several rows make one forward, up to a token budget. The LM head runs only at the positions
  that predict response tokens, in float32 (common.scoring.head_logits), in chunks
  recomputed in the backward pass so a 150k vocabulary never holds every
  position's logits at once.
- `build_generation_batch`: the same bootstrap and drop rules as the candidate
  rollout (learner_node/rollout.py), with a segment's turns kept in order as one
  chain of tokens for GAE.
- `generation_update`: the proximal and reference log-probabilities and the
  critic's token values with no gradient, per-token rewards with the KL penalty,
  GAE over each chain's tokens, the critic's epochs on cached features, then the
  clipped, dual-clipped, decoupled policy loss (learner_node/token_ppo.py).

The formulas and choices are in docs/design.md, "Generation: token-level PPO".
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from common import scoring
from common.segments import Segment, Transition
from common.shared_settings import PolicyStamp
from learner_node import ppo
from learner_node import token_ppo as tp
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.rollout import EpisodeReturns, Tally
from learner_node.update import _average_gradients, _mean_over_ranks, _world

log = logging.getLogger(__name__)

HEAD_CHUNK = 1024  # positions whose logits are computed at once


# --- packed forwards --------------------------------------------------------------------
def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sequence indices into rows of at most `budget` tokens, in order (a longer sequence gets a row alone)."""
    rows: list[list[int]] = []
    used = budget + 1
    for i, n in enumerate(lengths):
        if used + n > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def packed_hidden(decoder: Any, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], budget: int) -> list[torch.Tensor]:
    """The decoder's last hidden state at `positions[i]` of each sequence i, [len(positions[i]), width].

    Sequences are packed into rows as long as the longest of them (so a row's attention costs
    about what its longest sequence's own does: a row of many sequences under a dense mask would
    cost its length squared), position ids restarting at 0 for each and a block-diagonal causal
    mask keeping each to itself; as many rows as fit in `budget` tokens go through one forward.
    Gradients flow if enabled."""
    device = next(decoder.parameters()).device
    use_bool, dtype = scoring._mask_value(decoder)
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    rows = pack([len(s) for s in sequences], max([len(s) for s in sequences], default=1))
    width = max([sum(len(sequences[i]) for i in row) for row in rows], default=1)
    per_forward = max(1, budget // width)
    for first in range(0, len(rows), per_forward):
        group = rows[first : first + per_forward]
        length = max(sum(len(sequences[i]) for i in row) for row in group)
        ids = torch.zeros(len(group), length, dtype=torch.long, device=device)
        pos = torch.zeros(len(group), length, dtype=torch.long, device=device)
        allowed = torch.zeros(len(group), 1, length, length, dtype=torch.bool, device=device)
        for b, row in enumerate(group):
            start = 0
            for i in row:
                n = len(sequences[i])
                ids[b, start : start + n] = torch.tensor(list(sequences[i]), device=device)
                pos[b, start : start + n] = torch.arange(n, device=device)
                allowed[b, 0, start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
                start += n
            for pad in range(start, length):  # padding attends to itself only, so its softmax stays finite
                allowed[b, 0, pad, pad] = True
        hidden = decoder(
            input_ids=ids, position_ids=pos, attention_mask=scoring._attention_mask(allowed, use_bool, dtype), use_cache=False
        ).last_hidden_state
        for b, row in enumerate(group):
            start = 0
            for i in row:
                out[i] = hidden[b, start + torch.tensor(list(positions[i]), dtype=torch.long, device=device)]
                start += len(sequences[i])
    return out


def _logprob_entropy(
    head: Any, post: scoring.LogitTransform, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = post(scoring.head_logits(head, hidden)) / temps.unsqueeze(-1)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def head_logprobs(
    head: Any, post: scoring.LogitTransform, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T) at each position, in chunks;
    with gradients on, each chunk's logits are recomputed in the backward pass instead of kept."""
    logps, ents = [], []
    for start in range(0, hidden.shape[0], HEAD_CHUNK):
        args = (hidden[start : start + HEAD_CHUNK], targets[start : start + HEAD_CHUNK], temps[start : start + HEAD_CHUNK])
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_logprob_entropy, head, post, *args, use_reentrant=False)
        else:
            lp, ent = _logprob_entropy(head, post, *args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def response_logprobs(
    model: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperatures: Sequence[float], budget: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per response token: log pi(token | prompt, earlier tokens) with the logits divided by the sample's
    temperature (the distribution the actor sampled from before top-p), and that distribution's entropy."""
    decoder, head, post = scoring.model_parts(model)
    device = next(model.parameters()).device
    sequences = [list(p) + list(r[:-1]) for p, r in zip(prompts, responses)]  # the last token predicts nothing we score
    positions = [range(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(prompts, responses)]
    hidden = packed_hidden(decoder, sequences, positions, budget)
    flat = torch.cat(hidden)
    targets = torch.tensor([t for r in responses for t in r], device=device)
    temps = torch.tensor([t for r, temp in zip(responses, temperatures) for t in [temp] * len(r)], dtype=torch.float32, device=device)
    logp, ent = head_logprobs(head, post, flat, targets, temps)
    sizes = [len(r) for r in responses]
    return list(logp.split(sizes)), list(ent.split(sizes))


# --- from segments to a batch --------------------------------------------------------------
@dataclass
class Chain:
    """Consecutive turns of one segment, trained as one sequence of tokens for GAE."""

    samples: list[int]  # indices into the batch, in order
    next_prompt: list[int] | None  # the prompt after the last turn, whose value bootstraps it; None: the episode ended


@dataclass
class GenerationBatch(Tally):
    prompts: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    behaviour: list[list[float]] = field(default_factory=list)  # per token, of the distribution sampled from (top-p included)
    temperatures: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    dones: list[bool] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)
    chains: list[Chain] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.responses)


def build_generation_batch(
    segments: list[Segment],
    current_version: int,
    max_policy_lag: int,
    episodes: EpisodeReturns | None = None,
    expected: PolicyStamp | None = None,
    vocab_size: int | None = None,
) -> GenerationBatch:
    """Generate transitions -> a batch. Bootstrap rules as the candidate rollout's: a segment closed by `done`
    ends its chain; one with a next observation bootstraps from that prompt's value; a truncated one with
    none drops its last turn (counted) and bootstraps from that turn's prompt. A turn that is stale, from
    a version ahead, greedy or from another run or adapter is dropped and counted, and cuts the chain
    there (the part before bootstraps from the dropped turn's prompt). So is a turn holding a token id
    outside the learner's vocabulary (`vocab_size`: an actor serving another model would crash the update);
    a next prompt holding one counts as no successor."""
    out = GenerationBatch()
    episodes = episodes if episodes is not None else EpisodeReturns()
    for seg in segments:
        out.episodic_returns += episodes.add(seg)
        out.stored += len(seg.transitions)
        transitions = list(seg.transitions)
        next_prompt: list[int] | None = None
        if not seg.done:
            if seg.next_obs is not None and seg.next_obs.get("prompt_ids") and _in_vocabulary(seg.next_obs["prompt_ids"], vocab_size):
                next_prompt = list(seg.next_obs["prompt_ids"])
            else:  # truncated with no successor: the last turn has no observed successor
                out.dropped_truncated += 1
                next_prompt = list(transitions[-1].obs["prompt_ids"])
                transitions = transitions[:-1]
        chain: list[int] = []
        for t in transitions:
            reason = _dropped(t, current_version, max_policy_lag, expected)
            if reason is None and not (
                _in_vocabulary(t.obs["prompt_ids"], vocab_size) and _in_vocabulary((t.generation or {})["response_ids"], vocab_size)
            ):
                reason = "token_ids"
            if reason is not None:
                if reason == "stale":
                    out.dropped_stale += 1
                else:
                    out.dropped_mismatched += 1
                    out.mismatched[reason] += 1
                if chain:
                    out.chains.append(Chain(chain, list(t.obs["prompt_ids"])))
                chain = []
                continue
            chain.append(len(out.responses))
            gen = t.generation or {}
            out.prompts.append(list(t.obs["prompt_ids"]))
            out.responses.append(list(gen["response_ids"]))
            out.behaviour.append([float(x) for x in gen["logprobs"]])
            out.temperatures.append(float(gen["temperature"]))
            out.rewards.append(float(t.reward))
            out.dones.append(bool(t.done))
            out.lags.append(current_version - t.policy_version)
        if chain:
            out.chains.append(Chain(chain, None if seg.done else next_prompt))
    return out


def _in_vocabulary(ids: list[int], vocab_size: int | None) -> bool:
    return vocab_size is None or max(ids, default=0) < vocab_size


def _dropped(t: Transition, current_version: int, max_policy_lag: int, expected: PolicyStamp | None) -> str | None:
    """Why the learner must not train on generate transition `t`, or None."""
    lag = current_version - t.policy_version
    if lag < 0:
        return "version_ahead"
    if lag > max_policy_lag:
        return "stale"
    if t.generation is None or not t.generation.get("response_ids"):
        return "generation"
    if t.generation.get("temperature", 1.0) == 0:
        return "greedy"  # a deterministic behaviour policy: no ratio to take
    if expected is not None and t.policy is not None:
        try:
            stamp = PolicyStamp.from_wire(t.policy)
        except ValueError:
            return "stamp"
        # temperature and top-p are the sample's own; normalisation is for candidates
        return stamp.disagreement(expected, t.policy_version, ("run", "lora_rank"))
    return None


def split_by_mode(segments: list[Segment]) -> tuple[list[Segment], list[Segment]]:
    """(candidate segments, generate segments). A segment holding both kinds is cut where the kind changes;
    the part before a change ends truncated with no successor (its last transition is dropped and
    counted): a value of one kind cannot bootstrap the other."""
    scoring_segments: list[Segment] = []
    generate_segments: list[Segment] = []
    for seg in segments:
        runs: list[list[Transition]] = []
        for t in seg.transitions:
            if runs and (runs[-1][-1].mode == "generate") == (t.mode == "generate"):
                runs[-1].append(t)
            else:
                runs.append([t])
        for k, run in enumerate(runs):
            last = k == len(runs) - 1
            # The observation after the last turn bootstraps it only if it is of the same kind (a step's state
            # cannot be valued by the token critic, nor a prompt's by the candidate critic): else, as at a change.
            follows = seg.next_obs if last and _is_generate_obs(seg.next_obs) == (run[0].mode == "generate") else None
            cut = not last or (seg.next_obs is not None and follows is None)
            part = Segment(
                seg_id=seg.seg_id if len(runs) == 1 else f"{seg.seg_id}/{k}",
                task_id=seg.task_id,
                seq=seg.seq,
                reason="mode_change" if cut else seg.reason,
                done=seg.done and last,
                truncated=True if cut else seg.truncated,
                next_obs=follows,
                transitions=run,
                closed_ms=seg.closed_ms,
            )
            (generate_segments if run[0].mode == "generate" else scoring_segments).append(part)
    return scoring_segments, generate_segments


def _is_generate_obs(obs: dict[str, Any] | None) -> bool | None:
    """Whether an observation is a generate turn's ({prompt_ids, ...}); None for none."""
    return None if obs is None else "prompt_ids" in obs


# --- the update ------------------------------------------------------------------------------
def generation_update(
    lp: LearnerPolicy,
    policy_opt: torch.optim.Optimizer,
    value_opt: torch.optim.Optimizer,
    batch: GenerationBatch,
    cfg: UpdateConfig,
    gen: GenerationConfig,
    train_policy: bool = True,
    update_index: int = 0,
) -> dict[str, float]:
    """One token-level PPO update on a generation batch; metrics under `generation/...`.

    The policy is `lp.model` (adapter on), the reference `lp.base()` (adapter off, or the frozen
    copy). With `gen.advantage` gae, `lp.token_value_head` maps the base's hidden state before each
    response token to that token's value (its optimizer is `value_opt`) and `train_policy` off trains
    only it (the critic's warm-up); with grpo each response's reward is its advantage and there is no
    critic. With several processes each rank takes its share of every minibatch and gradients are
    averaged before each step, as in ppo_update."""
    rank, world = _world()
    model = lp.model
    gen_rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + update_index)
    n = len(batch)
    sizes = [len(r) for r in batch.responses]
    metrics: dict[str, float] = {}

    grpo = gen.advantage == "grpo"
    # --- with no gradient: proximal and reference log-probabilities ---
    with torch.no_grad():
        prox, _ = response_logprobs(model, batch.prompts, batch.responses, batch.temperatures, gen.micro_batch_tokens)
        with lp.base() as base:  # adapter off: the reference policy
            ref, _ = response_logprobs(base, batch.prompts, batch.responses, batch.temperatures, gen.micro_batch_tokens)
        kls = [tp.kl_estimate(p, r, gen.kl_estimator) for p, r in zip(prox, ref)]
    mask = _padded([torch.ones(s) for s in sizes])
    metrics["generation/kl_ref"] = float(torch.cat(kls).mean()) if n else math.nan
    metrics["generation/response_length"] = sum(sizes) / max(n, 1)
    metrics["generation/reward_mean"] = sum(batch.rewards) / max(n, 1)
    metrics["generation/tokens"] = float(sum(sizes))
    metrics["generation/group_relative"] = float(grpo)
    if grpo:
        if not train_policy:  # the warm-up trains only the critic, and GRPO has none: nothing to train yet
            return metrics
        # GRPO: the driver reported each response's group-relative advantage as its reward (rewards/group.py);
        # every token of the response gets it as it is: no critic, no GAE, no whitening over the batch
        b_adv = _padded([torch.full((s,), r) for s, r in zip(sizes, batch.rewards)])
    else:
        b_adv = _critic(lp, value_opt, batch, cfg, gen, kls, mask, gen_rng, metrics)
        if not train_policy:
            return metrics

    # --- policy: epochs over minibatches of responses, micro-batches packed by tokens ---
    b_prox, b_behav, b_ref = _padded(prox), _padded([torch.tensor(b) for b in batch.behaviour]), _padded(ref)
    decoupled = cfg.objective == "decoupled"
    b_old = b_prox if decoupled else b_behav
    on_policy = [i for i, lag in enumerate(batch.lags) if lag == 0]
    metrics["generation/on_policy_logprob_dev"] = (
        float(max(float((prox[i].cpu() - b_behav[i, : sizes[i]]).abs().max()) for i in on_policy)) if on_policy else math.nan
    )
    params = [p for p in model.parameters() if p.requires_grad]
    figures: dict[str, list[float]] = collections.defaultdict(list)
    first_ratio_dev = None
    steps, stopped = 0, False
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(n, generator=gen_rng)
        for start in range(0, n, cfg.policy_minibatch):
            mb = perm[start : start + cfg.policy_minibatch].tolist()
            mine = mb[rank::world]
            policy_opt.zero_grad()
            mb_tokens, mb_kl = sum(sizes[i] for i in mb), 0.0
            for micro in pack([len(batch.prompts[i]) + sizes[i] for i in mine], gen.micro_batch_tokens):
                ids = [mine[k] for k in micro]
                with lp.checkpointing():
                    logp, ent = response_logprobs(
                        model,
                        [batch.prompts[i] for i in ids],
                        [batch.responses[i] for i in ids],
                        [batch.temperatures[i] for i in ids],
                        gen.micro_batch_tokens,
                    )
                m = mask[ids]
                new = _padded(logp, mask.shape[1])
                terms = tp.policy_loss(
                    new,
                    b_old[ids],
                    b_adv[ids],
                    m,
                    gen.clip_low,
                    gen.clip_high,
                    gen.clip_ratio_c,
                    b_behav[ids] if decoupled else None,
                    cfg.behaviour_weight_cap,
                    gen.loss_aggregation,
                )
                entropy = _padded(ent, mask.shape[1])
                loss = terms.loss - gen.ent_coef * tp.aggregate(entropy, m, gen.loss_aggregation)
                if not gen.kl_in_reward and gen.kl_coef:
                    loss = loss + gen.kl_coef * tp.aggregate(tp.kl_estimate(new, b_ref[ids], gen.kl_estimator), m, gen.loss_aggregation)
                (loss * _share(mask, ids, mb, gen.loss_aggregation)).backward()
                if first_ratio_dev is None:
                    first_ratio_dev = float(((terms.ratio.detach() - 1).abs() * m).max())
                mb_kl += float(terms.approx_kl) * float(m.sum()) / mb_tokens
                for key, value in (
                    ("policy_loss", terms.loss),
                    ("clipfrac", terms.clipfrac),
                    ("dual_clipfrac", terms.dual_clipfrac),
                    ("behaviour_weight", terms.is_weight),
                    ("behaviour_weight_capped", terms.is_capped),
                    ("entropy", tp.masked_mean(entropy, m)),
                ):
                    figures[key].append(float(value.detach()))
            _average_gradients(params)
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            policy_opt.step()
            steps += 1
            mb_kl = _mean_over_ranks(mb_kl * world)  # each rank summed its tokens' share of the whole minibatch
            figures["approx_kl"].append(mb_kl)
            if cfg.target_kl and mb_kl > cfg.target_kl:
                stopped = True
                break
        if stopped:
            break
    metrics.update({f"generation/{k}": _mean(v) for k, v in figures.items()})
    metrics["generation/first_minibatch_ratio_dev"] = first_ratio_dev if first_ratio_dev is not None else math.nan
    metrics["generation/optimizer_steps"] = float(steps)
    metrics["generation/early_stop"] = float(stopped)
    return metrics


def _critic(
    lp: LearnerPolicy,
    value_opt: torch.optim.Optimizer,
    batch: GenerationBatch,
    cfg: UpdateConfig,
    gen: GenerationConfig,
    kls: list[torch.Tensor],
    mask: torch.Tensor,
    gen_rng: torch.Generator,
    metrics: dict[str, float],
) -> torch.Tensor:
    """GAE's part of an update: the critic's token values on the frozen base's features, per-token rewards
    (the KL to the reference in them if so set), GAE over each chain's tokens, then the critic's epochs on the
    cached features; the whitened advantages [B, T]."""
    rank, world = _world()
    value_head = lp.token_value_head
    device = next(value_head.parameters()).device
    n = len(batch)
    sizes = [len(r) for r in batch.responses]
    with torch.no_grad():
        sequences = [p + r[:-1] for p, r in zip(batch.prompts, batch.responses)]
        positions = [range(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(batch.prompts, batch.responses)]
        boot_prompts = [c.next_prompt for c in batch.chains if c.next_prompt is not None]
        with lp.base() as base:  # adapter off: the critic's frozen features
            decoder = scoring.model_parts(base)[0]
            features = [h.float() for h in packed_hidden(decoder, sequences, positions, gen.micro_batch_tokens)]
            boot_features = packed_hidden(decoder, boot_prompts, [[len(p) - 1] for p in boot_prompts], gen.micro_batch_tokens)
        values = [value_head(f) for f in features]
        boot_values = iter([float(value_head(f.float())[0]) for f in boot_features])

        # --- per-token rewards (KL to the reference in the reward) and GAE over each chain's tokens ---
        advantages: list[torch.Tensor] = [torch.empty(0)] * n
        returns: list[torch.Tensor] = [torch.empty(0)] * n
        for chain in batch.chains:
            rewards, dones = [], []
            for i in chain.samples:
                r = -gen.kl_coef * kls[i] if gen.kl_in_reward else torch.zeros(sizes[i])
                r = r.clone()
                r[-1] += batch.rewards[i]
                d = torch.zeros(sizes[i], dtype=torch.bool)
                d[-1] = batch.dones[i]
                rewards.append(r)
                dones.append(d)
            chain_values = torch.cat([values[i].cpu() for i in chain.samples])
            next_value = next(boot_values) if chain.next_prompt is not None else 0.0
            adv, ret = ppo.gae(torch.cat(rewards), chain_values, torch.cat(dones), next_value, gen.gamma, gen.gae_lambda)
            for i, a, r in zip(chain.samples, adv.split([sizes[i] for i in chain.samples]), ret.split([sizes[i] for i in chain.samples])):
                advantages[i], returns[i] = a, r
    b_adv = tp.masked_whiten(_padded(advantages), mask)
    b_ret, b_values = _padded(returns), _padded([v.cpu() for v in values])
    metrics["generation/explained_variance"] = ppo.explained_variance(b_values[mask.bool()], b_ret[mask.bool()])

    # --- critic: value epochs on the cached features ---
    value_params = list(value_head.parameters())
    v_losses = []
    for _ in range(cfg.value_epochs):
        perm = torch.randperm(n, generator=gen_rng)
        for start in range(0, n, cfg.value_minibatch):
            mb = perm[start : start + cfg.value_minibatch].tolist()
            idx = mb[rank::world]
            value_opt.zero_grad()
            loss = torch.zeros(())
            if idx:
                new_values = _padded([value_head(features[i].to(device)) for i in idx], mask.shape[1])
                loss = tp.value_loss(
                    new_values, b_values[idx], b_ret[idx], mask[idx], gen.value_clip, gen.value_huber_delta, gen.loss_aggregation
                )
                (cfg.vf_coef * loss * _share(mask, idx, mb, gen.loss_aggregation)).backward()
            _average_gradients(value_params)
            torch.nn.utils.clip_grad_norm_(value_params, cfg.max_grad_norm)
            value_opt.step()
            v_losses.append(_mean_over_ranks(float(loss.detach()) * _share(mask, idx, mb, gen.loss_aggregation)))
    metrics["generation/value_loss"] = _mean(v_losses)
    return b_adv


def _share(mask: torch.Tensor, ids: list[int], minibatch: list[int], aggregation: str) -> float:
    """The part of a minibatch's aggregated loss that `ids` carry, so that the parts (over micro-batches and
    ranks) add up to the minibatch's loss: by tokens for token-mean, by responses otherwise. Each rank
    averages gradients over the ranks, so a rank's part is scaled by the number of ranks."""
    _, world = _world()
    if aggregation == "token-mean":
        return world * float(mask[ids].sum()) / max(float(mask[minibatch].sum()), 1.0)
    return world * len(ids) / max(len(minibatch), 1)


def _padded(rows: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Right-padded [B, width] on the CPU from tensors of different lengths (0 after each), gradients kept; `width`
    defaults to the longest row. A micro-batch's rows are padded to the whole batch's width, so that they line
    up with the batch's old log-probs, advantages and mask sliced to the same responses."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    if not rows:
        return torch.zeros(0, width)
    return torch.stack([torch.nn.functional.pad(r.float().cpu(), (0, width - len(r))) for r in rows])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
