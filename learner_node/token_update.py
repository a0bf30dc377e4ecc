"""Generation-mode PPO in the learner: generate transitions -> a token-level batch -> one update.

Two parts, top to bottom:

- `build_generation_batch`: the same bootstrap and drop rules as the candidate
  rollout (learner_node/rollout.py), with a segment's turns kept in order as one
  chain of tokens for GAE.
- `GenerationUpdate`: the batch as the one PPO update (learner_node/update.py) takes
  it: the proximal and reference log-probabilities and the critic's token values
  with no gradient, per-token rewards with the KL penalty and GAE over each chain's
  tokens (`targets`), then each micro-batch's packed forward with gradients
  (learner_node/packed_forward.py).

The formulas and choices are in docs/design.md, "Generation: token-level PPO".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.learner_figures import GENERATION, UpdateFigure
from common.segments import GenerateObservation, Observation, Segment, Transition
from common.shared_settings import PolicyStamp
from learner_node import core_algos
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.packed_forward import logprobs_of_hidden, pack, packed_hidden, response_hidden, response_logprobs
from learner_node.policy import LearnerPolicy
from learner_node.rollout import STALE, EpisodeReturns, Tally, policy_disagreement
from learner_node.update import Forward, LossSettings, Targets, ppo_update
from models import scoring


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

    def pop(self) -> list[int]:
        """Take the last sample back out of the batch; its prompt."""
        for column in (self.responses, self.behaviour, self.temperatures, self.rewards, self.dones, self.lags):
            column.pop()
        return self.prompts.pop()


def build_generation_batch(
    segments: list[Segment],
    current_version: int,
    max_policy_lag: int,
    episodes: EpisodeReturns | None = None,
    expected: PolicyStamp | None = None,
    vocab_size: int | None = None,
    position_limit: int | None = None,
) -> GenerationBatch:
    """Generate transitions -> a batch. Bootstrap rules as the candidate rollout's: a segment closed by `done`
    ends its chain; one with a next observation bootstraps from that prompt's value; a truncated one with
    none drops its last turn (counted) and bootstraps from that turn's prompt. A turn that is stale, from
    a version ahead, greedy or from another run or adapter is dropped and counted, and cuts the chain
    there (the part before bootstraps from the dropped turn's prompt). So is a turn holding a token id
    outside the learner's vocabulary (`vocab_size`: an actor serving another model would crash the update).
    A prompt to bootstrap from that the critic cannot score (a token id outside the vocabulary, or more
    tokens than the model's `position_limit`) counts as no successor: the turn before it is dropped as a
    truncated segment's last turn, counted in `dropped_truncated` and `dropped_unscorable_next_obs`."""
    out = GenerationBatch()
    episodes = episodes if episodes is not None else EpisodeReturns()
    for seg in segments:
        out.episodic_returns += episodes.add(seg)
        out.stored += len(seg.transitions)
        transitions = list(seg.transitions)
        next_prompt: list[int] | None = None
        if not seg.done:
            given = seg.next_obs.prompt_ids if isinstance(seg.next_obs, GenerateObservation) else None
            why = _unscorable(given, vocab_size, position_limit) if given else None
            if given and why is None:
                next_prompt = list(given)
            else:  # truncated with no successor: the last turn has no observed successor
                if why is not None:
                    out.dropped_unscorable_next_obs += 1
                    out.unscorable_reason = why
                out.dropped_truncated += 1
                next_prompt = list(transitions[-1].generate_obs.prompt_ids)
                transitions = transitions[:-1]
        chain: list[int] = []
        for t in transitions:
            reason = _dropped(t, current_version, max_policy_lag, expected)
            if reason is None and not (
                _in_vocabulary(t.generate_obs.prompt_ids, vocab_size) and _in_vocabulary(t.response.response_ids, vocab_size)
            ):
                reason = "token_ids"
            if reason is not None:
                out.count_dropped(reason)
                if chain:
                    boot: list[int] = list(t.generate_obs.prompt_ids)
                    why = _unscorable(boot, vocab_size, position_limit)
                    if why is not None:  # it cannot bootstrap the turn before, which then has no successor: dropped too
                        out.dropped_unscorable_next_obs += 1
                        out.unscorable_reason = why
                        out.dropped_truncated += 1
                        boot = out.pop()
                        chain.pop()
                    if chain:
                        out.chains.append(Chain(chain, boot))
                chain = []
                continue
            chain.append(len(out.responses))
            gen = t.response
            out.prompts.append(list(t.generate_obs.prompt_ids))
            out.responses.append(list(gen.response_ids))
            out.behaviour.append([float(x) for x in gen.logprobs])
            out.temperatures.append(float(gen.temperature))
            out.rewards.append(float(t.reward))
            out.dones.append(bool(t.done))
            out.lags.append(current_version - t.policy_version)
        if chain:
            out.chains.append(Chain(chain, None if seg.done else next_prompt))
    return out


def _in_vocabulary(ids: list[int], vocab_size: int | None) -> bool:
    return vocab_size is None or max(ids, default=0) < vocab_size


def _unscorable(prompt_ids: list[int], vocab_size: int | None, position_limit: int | None) -> str | None:
    """Why the critic cannot value a prompt (checked before any forward), or None."""
    if not _in_vocabulary(prompt_ids, vocab_size):
        return f"a prompt holds token id {max(prompt_ids)}, outside the model's vocabulary of {vocab_size}"
    if position_limit is not None and len(prompt_ids) > position_limit:
        return f"a prompt of {len(prompt_ids)} tokens, over the model's limit of {position_limit} positions"
    return None


def _dropped(t: Transition, current_version: int, max_policy_lag: int, expected: PolicyStamp | None) -> str | None:
    """Why the learner must not train on generate transition `t`, or None."""
    lag = current_version - t.policy_version
    if lag < 0:
        return "version_ahead"
    if lag > max_policy_lag:
        return STALE
    if t.generation is None or not t.generation.response_ids:
        return "generation"
    if t.generation.temperature == 0:
        return "greedy"  # a deterministic behaviour policy: no ratio to take
    # temperature and top-p are the sample's own; normalisation is for candidates
    return policy_disagreement(t, expected, ("run", "lora_rank"))


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


def _is_generate_obs(obs: Observation | None) -> bool | None:
    """Whether an observation is a generate turn's; None for none."""
    return None if obs is None else isinstance(obs, GenerateObservation)


# --- the update ------------------------------------------------------------------------------
class GenerationUpdate:
    """A generation batch as learner_node/update.py's `PolicyBatch`: each sample is a response of many tokens,
    scored by packed forwards; every per-token tensor at the batch's width, on the model's device.

    The policy is `lp.model` (adapter on), the reference `lp.base()` (adapter off, or the frozen copy). With
    `gen.advantage` gae, `lp.token_value_head` maps the base's hidden state before each response token to that
    token's value; with grpo or rloo each response's reward is its advantage (the driver's group-relative
    estimate, dataset_driver/group_advantage.py) and there is no critic."""

    prefix = GENERATION  # its figures' keys: generation/...

    def __init__(self, lp: LearnerPolicy, batch: GenerationBatch, gen: GenerationConfig) -> None:
        self.lp = lp
        self.batch = batch
        self.gen = gen
        self.layout = lp.generation_layout
        self.device = next(lp.model.parameters()).device
        self.sizes = [len(r) for r in batch.responses]
        self.width = max(self.sizes, default=0)
        self.features: list[torch.Tensor] = []
        self.ref = torch.zeros(0, self.width, device=self.device)

    def __len__(self) -> int:
        return len(self.batch)

    def padded(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """[len(rows), width] float32 on the model's device, each row right-padded with 0; gradients kept."""
        if not rows:
            return torch.zeros(0, self.width, device=self.device)
        out = torch.nn.utils.rnn.pad_sequence([r.float().to(self.device) for r in rows], batch_first=True)
        return torch.nn.functional.pad(out, (0, self.width - out.shape[1])) if out.shape[1] < self.width else out

    def targets(self, metrics: dict[str, float]) -> Targets:
        b, gen, n = self.batch, self.gen, len(self.batch)
        with torch.no_grad():
            prox, _ = response_logprobs(self.lp.model, b.prompts, b.responses, b.temperatures, gen.micro_batch_tokens, self.layout)
            with self.lp.base() as base:  # adapter off: the reference policy, and the critic's frozen features
                hidden = response_hidden(base, b.prompts, b.responses, gen.micro_batch_tokens, self.layout)
                ref, _ = logprobs_of_hidden(base, hidden, b.responses, b.temperatures)
            # GAE's critic values each token from the same states: one adapter-off forward serves both (kept for the
            # critic's epochs); GRPO and RLOO have no critic
            self.features = [h.float() for h in hidden] if gen.advantage == "gae" else []
            del hidden
        mask = self.padded([torch.ones(s) for s in self.sizes])
        b_prox, self.ref = self.padded(prox), self.padded(ref)
        behaviour = self.padded([torch.tensor(x) for x in b.behaviour])
        kl = core_algos.kl_estimate(b_prox, self.ref, gen.kl_estimator) * mask
        metrics[UpdateFigure.KL_REF] = float(core_algos.masked_mean(kl, mask)) if n else math.nan
        metrics[UpdateFigure.RESPONSE_LENGTH] = sum(self.sizes) / max(n, 1)
        metrics[UpdateFigure.REWARD_MEAN] = sum(b.rewards) / max(n, 1)
        metrics[UpdateFigure.TOKENS] = float(sum(self.sizes))
        metrics[UpdateFigure.GROUP_RELATIVE] = float(gen.advantage != "gae")
        on_policy = [i for i, lag in enumerate(b.lags) if lag == 0]
        metrics[UpdateFigure.ON_POLICY_LOGPROB_DEV] = float(((b_prox - behaviour).abs() * mask)[on_policy].max()) if on_policy else math.nan
        if gen.advantage != "gae":
            # GRPO / RLOO: the driver reported each response's group-relative advantage as its reward
            # (dataset_driver/group_advantage.py); every token of the response gets it as it is: no critic, no GAE, no whitening
            advantages = torch.tensor(b.rewards, device=self.device).unsqueeze(-1) * mask
            return Targets(mask, behaviour, b_prox, advantages)
        values, returns, advantages = self._critic_targets(kl, mask)
        return Targets(mask, behaviour, b_prox, core_algos.masked_whiten(advantages, mask), returns, values)

    @torch.no_grad()
    def _critic_targets(self, kl: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GAE's part: the critic's token values on the frozen base's features (`targets` keeps them for the critic's epochs),
        per-token rewards (the KL to the reference in them if so set: r_t = -beta KL_t + [t last] score), and
        GAE over each chain's tokens; (values, returns, advantages) [B, T]."""
        b, gen, value_head = self.batch, self.gen, self.lp.token_value_head
        boot_prompts = [c.next_prompt for c in b.chains if c.next_prompt is not None]
        with self.lp.base() as base:  # adapter off: the critic's frozen features (the responses' came with the reference's)
            decoder = scoring.model_parts(base)[0]
            boot_features = packed_hidden(decoder, boot_prompts, [[len(p) - 1] for p in boot_prompts], gen.micro_batch_tokens, self.layout)
        values = self.padded([value_head(f) for f in self.features])
        boot_values = iter([value_head(f.float())[0] for f in boot_features])
        rewards = -gen.kl_coef * kl if gen.kl_in_reward else torch.zeros_like(mask)
        last = torch.tensor(self.sizes, device=self.device) - 1
        rows = torch.arange(len(b), device=self.device)
        rewards[rows, last] += torch.tensor(b.rewards, device=self.device)
        dones = torch.zeros_like(mask, dtype=torch.bool)
        dones[rows, last] = torch.tensor(b.dones, device=self.device)
        # Every chain (a segment's turns in order: one sequence of tokens) packed end to end, in one GAE scan.
        rows_list: list[int] = []
        cols_list: list[int] = []
        ends_at: list[int] = []
        next_values: list[torch.Tensor | float] = []
        for chain in b.chains:
            start = len(rows_list)
            for i in chain.samples:
                rows_list += [i] * self.sizes[i]
                cols_list += range(self.sizes[i])
            next_value = next(boot_values) if chain.next_prompt is not None else 0.0  # taken in order either way
            if len(rows_list) > start:
                ends_at.append(len(rows_list) - 1)
                next_values.append(next_value)
        advantages, returns = torch.zeros_like(mask), torch.zeros_like(mask)
        if rows_list:
            rows_, cols = torch.tensor(rows_list, device=self.device), torch.tensor(cols_list, device=self.device)
            ends = torch.zeros(len(rows_list), dtype=torch.bool, device=self.device)
            ends[ends_at] = True
            boot = torch.stack([torch.as_tensor(v, dtype=mask.dtype, device=self.device) for v in next_values])
            adv, ret = core_algos.gae(
                rewards[rows_, cols], values[rows_, cols], dones[rows_, cols], boot, gen.gamma, gen.gae_lambda, ends=ends
            )
            advantages[rows_, cols], returns[rows_, cols] = adv, ret
        return values, returns, advantages

    def micro_batches(self, ids: list[int]) -> list[list[int]]:
        """Packed by tokens: as many responses (with their prompts) as fit in `micro_batch_tokens`."""
        lengths = [len(self.batch.prompts[i]) + self.sizes[i] for i in ids]
        return [[ids[k] for k in row] for row in pack(lengths, self.gen.micro_batch_tokens)]

    def forward(self, ids: list[int]) -> Forward:
        b = self.batch
        with self.lp.checkpointing():
            logp, ent = response_logprobs(
                self.lp.model,
                [b.prompts[i] for i in ids],
                [b.responses[i] for i in ids],
                [b.temperatures[i] for i in ids],
                self.gen.micro_batch_tokens,
                self.layout,
            )
        new = self.padded(logp)
        return Forward(new, self.padded(ent), core_algos.kl_estimate(new, self.ref[ids], self.gen.kl_estimator))

    def values(self, ids: list[int]) -> torch.Tensor:
        return self.padded([self.lp.token_value_head(self.features[i]) for i in ids])


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
    """The one PPO update (learner_node/update.py) on a generation batch; metrics under `generation/...`.
    `value_opt` trains `lp.token_value_head` (GAE only)."""
    return ppo_update(
        GenerationUpdate(lp, batch, gen),
        lp.trainable_parameters(),
        policy_opt,
        list(lp.token_value_head.parameters()),
        value_opt,
        LossSettings.generation(cfg, gen),
        train_policy,
        update_index,
    )
