"""Generation-mode PPO in the learner: generate transitions -> a token-level batch -> one update.

Three parts, top to bottom:

- Packed forwards (`packed_hidden`, `response_logprobs`): prompts and responses of
  different lengths go one after another in rows as long as the longest sequence,
  position ids restarting at 0 for each; transformers builds the mask of packed
  sequences from those position ids (block-causal, sliding windows included), so
  each sequence sees only itself and little compute goes to padding; several rows
  make one forward, up to a token budget. `check_layout` proves at start-up that
  this gives the model's own log-probabilities, or falls back to one right-padded
  sequence per row. The LM head runs only at the positions
  that predict response tokens, in float32 (models.scoring.head_logits), in chunks
  recomputed in the backward pass so a 150k vocabulary never holds every
  position's logits at once.
- `build_generation_batch`: the same bootstrap and drop rules as the candidate
  rollout (learner_node/rollout.py), with a segment's turns kept in order as one
  chain of tokens for GAE.
- `GenerationUpdate`: the batch as the one PPO update (learner_node/update.py) takes
  it: the proximal and reference log-probabilities and the critic's token values
  with no gradient, per-token rewards with the KL penalty and GAE over each chain's
  tokens (`targets`), then each micro-batch's packed forward with gradients.

The formulas and choices are in docs/design.md, "Generation: token-level PPO".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from common.learner_figures import GENERATION
from common.segments import Segment, Transition
from common.shared_settings import PolicyStamp
from learner_node import core_algos
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.rollout import EpisodeReturns, Tally
from learner_node.update import Forward, LossSettings, Targets, ppo_update
from models import scoring

log = logging.getLogger(__name__)

HEAD_CHUNK = 1024  # positions whose logits are computed at once
# Logits of a chunk up to this many values (4 MB in float32) are kept for the backward pass: recomputing them
# saves no memory worth having and costs the checkpoint's machinery on every small forward.
KEEP_LOGITS = 1 << 20


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


def fill_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices in rows of at most `capacity` tokens, longest first, each into the first row it fits
    (first-fit decreasing: at most 11/9 of the fewest rows possible, plus one); a longer sequence gets a row alone."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


LAYOUTS = ("packed", "padded")  # how a forward lays out sequences of different lengths (check_layout picks one)


def packed_hidden(
    decoder: Any, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], budget: int, layout: str = "packed"
) -> list[torch.Tensor]:
    """The decoder's last hidden state at `positions[i]` of each sequence i, [len(positions[i]), width].

    `packed`: sequences go one after another in rows as long as the longest of them (`fill_rows`), with position ids that
    restart at 0 for each and no attention mask: from position ids alone transformers builds the mask of
    packed sequences itself (block-causal, with each layer's sliding window, for eager and sdpa attention;
    varlen kernels for flash-attention), so each sequence sees only itself, as the model would score it
    alone. A row as long as the longest sequence keeps a row's attention at about what its longest
    sequence's own costs (one long row of many sequences under a dense mask would cost its length squared).
    `padded`: one sequence per row, right-padded to the longest sequence given, under a 2D padding mask: what
    every model accepts, and what packing saves (`ppoz bench update`). As many rows as fit in `budget` tokens go through one forward.
    Gradients flow if enabled."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    device = next(decoder.parameters()).device
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    longest = max([len(s) for s in sequences], default=1)
    rows = fill_rows([len(s) for s in sequences], longest) if layout == "packed" else [[i] for i in range(len(sequences))]
    per_forward = max(1, budget // longest)
    for first in range(0, len(rows), per_forward):
        group = rows[first : first + per_forward]
        # packed: as long as the group's fullest row; padded: every row as long as the call's longest sequence, as a
        # trainer without packing holds its batch (right-padded to its longest, micro-batches sliced from it)
        length = max(sum(len(sequences[i]) for i in row) for row in group) if layout == "packed" else longest
        # Built on the host as lists and copied once per tensor: a tensor op per sequence costs more than
        # the forward itself on short responses (the arithmetic demo's 2 tokens).
        ids: list[list[int]] = []
        pos: list[list[int]] = []
        mask: list[list[int]] = []
        gather: list[int] = []  # each sequence's scored positions in the forward's flattened [rows * length]
        order: list[int] = []
        for b, row in enumerate(group):
            row_ids: list[int] = []
            row_pos: list[int] = []
            for i in row:
                start = b * length + len(row_ids)
                gather.extend(start + q for q in positions[i])
                order.append(i)
                row_ids.extend(sequences[i])
                row_pos.extend(range(len(sequences[i])))
            pad = length - len(row_ids)
            mask.append([1] * len(row_ids) + [0] * pad)
            ids.append(row_ids + [0] * pad)
            pos.append(row_pos + list(range(pad)))  # padding: a sequence of its own, never read
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if layout == "packed":
            hidden = decoder(input_ids=input_ids, position_ids=torch.tensor(pos, dtype=torch.long, device=device), use_cache=False)
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=torch.tensor(mask, dtype=torch.long, device=device), use_cache=False)
        states = hidden.last_hidden_state
        scored = states.reshape(-1, states.shape[-1])[torch.tensor(gather, dtype=torch.long, device=device)]
        for i, h in zip(order, scored.split([len(positions[i]) for i in order])):
            out[i] = h
    return out


def check_layout(model: Any, budget: int = 4096) -> str:
    """The first layout of LAYOUTS whose log-probabilities are the model's own, checked at start-up as the
    candidate path checks its scoring path (models/scoring.py, `select_path`): on probe prompts and responses
    of different lengths in one forward, one of them longer than the model's sliding window if it has one,
    against `model(input_ids).logits` of each sequence alone, in float32 (16-bit weights upcast for the check),
    to within scoring.FLOAT32_TOLERANCE. A model whose attention ignores the position ids' packing (or a
    transformers release that does not build the packed mask) fails it and gets `padded`."""
    vocab = model.get_output_embeddings().weight.shape[0]
    limit = scoring.position_limit(model) or 4096
    w = min(scoring.sliding_window(model.config) or 8, (limit - 8) // 2)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    # sequences (prompt + response - 1) of 2w + 4, w + 2 and w + 1 tokens: the first fills a row; the other two
    # share the next, the last starting mid-row and longer than the window, which must hold after position 0
    prompts, responses = [tokens(n) for n in (2 * w - 1, w - 2, w - 1)], [tokens(n) for n in (6, 5, 3)]
    temperatures = [1.0, 0.7, 1.3]
    errors: dict[str, float] = {}
    with scoring._float32(model), torch.inference_mode():
        device = next(model.parameters()).device
        own = []
        for p, r, t in zip(prompts, responses, temperatures):
            logits = model(input_ids=torch.tensor([p + r], device=device)).logits[0, len(p) - 1 : -1].float() / t
            own.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r, device=device).unsqueeze(-1)).squeeze(-1))
        for layout in LAYOUTS:
            try:
                got, _ = response_logprobs(model, prompts, responses, temperatures, max(budget, 6 * w), layout)
                errors[layout] = max(float((g.float() - o).abs().max()) for g, o in zip(got, own))
            except Exception as e:  # a model that rejects this layout's inputs
                log.info("generation layout %s unavailable on this model: %s", layout, e)
                errors[layout] = math.inf
            if errors[layout] <= scoring.FLOAT32_TOLERANCE:
                log.info("generation layout %s (checked against model(input_ids).logits: max diff %.2e)", layout, errors[layout])
                return layout
            log.warning("generation layout %s differs from model(input_ids).logits on this model (%.2e); not used", layout, errors[layout])
    raise scoring.ScoringError(f"no generation layout reproduces this model's log-probabilities: {errors}")


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
        if torch.is_grad_enabled() and hidden.requires_grad and args[0].shape[0] * head.weight.shape[0] > KEEP_LOGITS:
            lp, ent = checkpoint(_logprob_entropy, head, post, *args, use_reentrant=False)
        else:
            lp, ent = _logprob_entropy(head, post, *args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def response_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperatures: Sequence[float],
    budget: int,
    layout: str = "packed",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per response token: log pi(token | prompt, earlier tokens) with the logits divided by the sample's
    temperature (the distribution the actor sampled from before top-p), and that distribution's entropy."""
    return logprobs_of_hidden(model, response_hidden(model, prompts, responses, budget, layout), responses, temperatures)


def response_hidden(
    model: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], budget: int, layout: str = "packed"
) -> list[torch.Tensor]:
    """The decoder's last hidden state before each response token, [len(response), width] per response: what the
    LM head scores it from, and what the critic values it from (`GenerationUpdate.targets`)."""
    decoder = scoring.model_parts(model)[0]
    sequences = [list(p) + list(r[:-1]) for p, r in zip(prompts, responses)]  # the last token predicts nothing we score
    positions = [range(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(prompts, responses)]
    return packed_hidden(decoder, sequences, positions, budget, layout)


def logprobs_of_hidden(
    model: Any, hidden: Sequence[torch.Tensor], responses: Sequence[Sequence[int]], temperatures: Sequence[float]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`response_logprobs` from `response_hidden`'s states: the LM head, the temperature, the log-softmax."""
    _, head, post = scoring.model_parts(model)
    device = next(model.parameters()).device
    flat = torch.cat(list(hidden))
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
            given = seg.next_obs.get("prompt_ids") if seg.next_obs is not None else None
            why = _unscorable(given, vocab_size, position_limit) if given else None
            if given and why is None:
                next_prompt = list(given)
            else:  # truncated with no successor: the last turn has no observed successor
                if why is not None:
                    out.dropped_unscorable_next_obs += 1
                    out.unscorable_reason = why
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
                    boot: list[int] = list(t.obs["prompt_ids"])
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
class GenerationUpdate:
    """A generation batch as learner_node/update.py's `PolicyBatch`: each sample is a response of many tokens,
    scored by packed forwards; every per-token tensor at the batch's width, on the model's device.

    The policy is `lp.model` (adapter on), the reference `lp.base()` (adapter off, or the frozen copy). With
    `gen.advantage` gae, `lp.token_value_head` maps the base's hidden state before each response token to that
    token's value; with grpo or rloo each response's reward is its advantage (the driver's group-relative
    estimate, rewards/group.py) and there is no critic."""

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
        metrics["kl_ref"] = float(core_algos.masked_mean(kl, mask)) if n else math.nan
        metrics["response_length"] = sum(self.sizes) / max(n, 1)
        metrics["reward_mean"] = sum(b.rewards) / max(n, 1)
        metrics["tokens"] = float(sum(self.sizes))
        metrics["group_relative"] = float(gen.advantage != "gae")
        on_policy = [i for i, lag in enumerate(b.lags) if lag == 0]
        metrics["on_policy_logprob_dev"] = float(((b_prox - behaviour).abs() * mask)[on_policy].max()) if on_policy else math.nan
        if gen.advantage != "gae":
            # GRPO / RLOO: the driver reported each response's group-relative advantage as its reward
            # (rewards/group.py); every token of the response gets it as it is: no critic, no GAE, no whitening
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
