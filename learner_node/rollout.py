"""From trajectory segments to a training batch: bootstrap rules, GAE, staleness filter.

Bootstrap rules for a segment (docs/design.md, "Learner"):
- closed by `done`: the episode ended with its last transition; nothing is bootstrapped.
- carries `next_obs` (closed by length, by the orphan-step rule, or truncated with
  the next observation known): bootstrap from V(next_obs).
- truncated with nothing after it (detach, expiry without a pending step): the
  last transition has no observed successor, so it is not trained on (counted as
  `dropped_truncated`); its observation's value bootstraps the transition before it.
- carries a `next_obs` the critic cannot score (the critic gives None: it tokenizes to
  nothing, or runs past the model's positions; a client's feedback sends it, checked by
  the broker for types and sizes only): as if truncated with nothing after it, counted
  in `dropped_truncated` and, of those, in `dropped_unscorable_next_obs`.
Transitions whose behaviour policy is more than `max_policy_lag` versions old are
dropped after GAE (they still shape their neighbours' targets) and counted
(`dropped_stale`); so are transitions from a version ahead of the learner's, which
only another run of the learner can have produced (`dropped_mismatched`). Stale
transitions within the lag are trained on: the decoupled objective corrects for
their behaviour policy (learner_node/core_algos.py).

`CandidateBatch` is how learner_node/update.py's one PPO update scores a rollout: each choice is a
sample of one token.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.learner_figures import CANDIDATES, UpdateFigure
from common.segments import CandidateObservation, Segment, Transition
from common.shared_settings import PolicyStamp
from learner_node import core_algos
from learner_node.config import UpdateConfig
from learner_node.update import Forward, LossSettings, Targets, ppo_update
from models.scoring import ScoringError

if TYPE_CHECKING:
    from learner_node.policy import LearnerPolicy


STALE = "stale"  # a transition's reason to be dropped when its behaviour policy is past the lag bound


@dataclass
class Tally:
    """What a batch took from its segments and what it left out, and why: the learner's counters and the ledger."""

    episodic_returns: list[float] = field(default_factory=list)
    dropped_stale: int = 0
    dropped_truncated: int = 0
    dropped_unscorable_next_obs: int = 0  # of dropped_truncated: the segment's next observation could not be scored
    unscorable_reason: str = ""  # why the last of those could not be (the learner logs it)
    dropped_mismatched: int = 0
    mismatched: collections.Counter[str] = field(default_factory=collections.Counter)  # by the field that disagreed
    stored: int = 0  # transitions in the segments taken

    def count_dropped(self, reason: str) -> None:
        """One transition left out: STALE (older than the lag bound), or by what disagreed (a field of its stamp,
        a version ahead, ...)."""
        if reason == STALE:
            self.dropped_stale += 1
        else:
            self.dropped_mismatched += 1
            self.mismatched[reason] += 1


@dataclass
class Rollout(Tally):
    """Flat per-transition training data (b_ tensors) of candidate choices, and what was left out."""

    obs: list[CandidateObservation] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    probs: list[list[float]] = field(default_factory=list)  # the behaviour policy over every candidate
    versions: list[int] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)  # versions between the behaviour policy and the learner's, 0: on-policy
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    seg_ids: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.actions)


class EpisodeReturns:
    """Undiscounted episode returns, across segment boundaries and rollouts.

    A task's episode spans as many segments as it has steps / segment_len, and Kea's never
    end with `done`: they end when the emulator detaches (the segment is closed truncated).
    So the running sum is kept per task until the episode ends with a `done` or `truncated`
    transition or a truncated segment; a truncated episode counts with the return it had.
    At most `max_tasks` running sums are kept (the least recently seen task is forgotten).
    """

    def __init__(self, max_tasks: int = 100_000) -> None:
        self.running: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.max_tasks = max_tasks

    def add(self, seg: Segment) -> list[float]:
        """The returns of the episodes this segment ends (segments of one task in order)."""
        total = self.running.pop(seg.task_id, 0.0)
        ended, open_steps = [], 0
        for t in seg.transitions:
            total += float(t.reward)
            open_steps += 1
            if t.done or t.truncated:
                ended.append(total)
                total, open_steps = 0.0, 0
        if seg.truncated and open_steps:  # detached or expired mid-episode
            ended.append(total)
        elif open_steps:
            self.running[seg.task_id] = total
            if len(self.running) > self.max_tasks:
                self.running.popitem(last=False)
        return ended


def build_rollout(
    segments: list[Segment],
    value_of: Callable[[list[CandidateObservation]], Sequence[float | None]],
    gamma: float,
    lam: float,
    current_version: int,
    max_policy_lag: int,
    episodes: EpisodeReturns | None = None,
    expected: PolicyStamp | None = None,
) -> Rollout:
    """Turn decoded segments into a Rollout; `value_of(observations)` is the critic (no gradients), None for an
    observation it cannot score: a segment's `next_obs` so valued ends it as if truncated with no successor
    (counted `dropped_unscorable_next_obs`); a transition's own observation, which the actor scored, must be scored.

    `episodes` carries episode returns across calls (the learner keeps one); by default a fresh
    one, so an episode's return counts only if it starts and ends within these segments.
    `expected`: the learner's own policy stamp; a stamped transition that disagrees with it
    is dropped and counted by the field that differs (unstamped ones are taken as they are)."""
    out = Rollout()
    episodes = episodes if episodes is not None else EpisodeReturns()
    # One critic call for every observation and bootstrap observation of the batch.
    wanted: list[CandidateObservation] = []
    for seg in segments:
        wanted += [t.candidate_obs for t in seg.transitions]
        if seg.next_obs is not None and not seg.done:
            wanted.append(candidate_next_obs(seg))
    values = value_of(wanted) if wanted else []
    cursor = 0
    for seg in segments:
        out.episodic_returns += episodes.add(seg)
        transitions = seg.transitions
        n = len(transitions)
        out.stored += n
        seg_values = _scored(values[cursor : cursor + n], seg)
        cursor += n
        next_value: float | None = None
        if seg.done:
            next_value = 0.0
        elif seg.next_obs is not None:
            next_value = values[cursor]
            cursor += 1
            if next_value is None:  # a next observation the critic cannot score: no successor known
                out.dropped_unscorable_next_obs += 1
        if next_value is None:  # truncated with no successor: drop the last transition, bootstrap from its observation
            out.dropped_truncated += 1
            transitions, next_value, seg_values = transitions[:-1], seg_values[-1], seg_values[:-1]
            n -= 1
            if n == 0:
                continue
        rewards = torch.tensor([float(t.reward) for t in transitions])
        dones = torch.tensor([bool(t.done) for t in transitions])
        b_values = torch.tensor(seg_values, dtype=torch.float32)
        advantages, returns = core_algos.gae(rewards, b_values, dones, next_value, gamma, lam)
        for t, adv, ret, v in zip(transitions, advantages.tolist(), returns.tolist(), seg_values):
            lag = current_version - t.policy_version
            reason = "version_ahead" if lag < 0 else policy_disagreement(t, expected)
            if reason is None and lag > max_policy_lag:
                reason = STALE
            if reason is not None:
                out.count_dropped(reason)
                continue
            out.obs.append(t.candidate_obs)
            out.actions.append(t.action)
            out.logprobs.append(float(t.logprob))
            out.probs.append([float(p) for p in t.probs])
            out.versions.append(t.policy_version)
            out.lags.append(lag)
            out.advantages.append(adv)
            out.returns.append(ret)
            out.values.append(float(v))
            out.seg_ids.append(seg.seg_id)
    return out


def candidate_next_obs(seg: Segment) -> CandidateObservation:
    """A candidate segment's next observation (TypeError for a generate turn's: learner_node/token_update.py's
    `split_by_mode` gives a candidate segment none of those)."""
    if not isinstance(seg.next_obs, CandidateObservation):
        raise TypeError(f"segment {seg.seg_id} of choices among candidates has no candidate observation after it")
    return seg.next_obs


def _scored(values: Sequence[float | None], seg: Segment) -> list[float]:
    """The critic's values of a segment's own observations, which must all have been scored."""
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise ScoringError(f"the critic could not score transition {missing[0]} of segment {seg.seg_id}, which an actor scored")
    return [float(v) for v in values if v is not None]


def policy_disagreement(t: Transition, expected: PolicyStamp | None, compared: tuple[str, ...] = PolicyStamp.COMPARED) -> str | None:
    """Why the learner must not train on `t`: the first of the `compared` fields where its policy stamp differs
    from the learner's own (`expected`), or "stamp" for a stamp it cannot read; None if they agree, or if either
    is missing (an unstamped transition is taken as it is)."""
    if expected is None or t.policy is None:
        return None
    try:
        stamp = PolicyStamp.from_wire(t.policy)
    except ValueError:
        return "stamp"
    return stamp.disagreement(expected, t.policy_version, compared)


class CandidateBatch:
    """A rollout of choices among candidates, as learner_node/update.py's `PolicyBatch`: each choice is one
    token (T = 1) whose log-probability is the chosen candidate's, whose entropy and KL to the reference are
    exact over its candidates, and whose value is the critic's on the frozen base's features."""

    prefix = CANDIDATES  # its figures' keys: losses/...

    def __init__(self, lp: LearnerPolicy, rollout: Rollout, micro_batch: int, features: torch.Tensor | None = None) -> None:
        """`features`: the critic features of the rollout's observations, if the caller has them already (the worker
        computed them for GAE); otherwise they are computed here."""
        self.lp = lp
        self.rollout = rollout
        self.micro_batch = micro_batch
        self.items = [lp.tokenize(o) for o in rollout.obs]
        self.device = next(lp.value_head.parameters()).device
        self.features = (features if features is not None else lp.features(self.items)).to(self.device)
        self.actions = torch.tensor(rollout.actions, device=self.device)
        self.ref_logp: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.rollout)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(-1)

    def targets(self, metrics: dict[str, float]) -> Targets:
        r = self.rollout
        mask = torch.ones(len(r), 1, device=self.device)
        behaviour = self._column(r.logprobs)
        # The proximal policy: the learner's weights as the update starts, and the reference (every rank scores the
        # whole rollout: each takes a different share of every minibatch). Both a micro-batch at a time, as the
        # update's own forwards: a rollout's observations in one forward would hold all their activations at once.
        with torch.no_grad():
            prox_all, self.ref_logp = [], []
            for start in range(0, len(r), self.micro_batch):
                chunk = self.items[start : start + self.micro_batch]
                prox_all += self.lp.logp_all(chunk)
                self.ref_logp += self.lp.reference_logp_all(chunk)
        prox = torch.stack([logp[a] for logp, a in zip(prox_all, r.actions, strict=True)]).unsqueeze(-1).float()
        kl_behaviour = [
            float(core_algos.kl_behaviour(torch.tensor(mu, device=logp.device), logp)) for mu, logp in zip(r.probs, prox_all, strict=True)
        ]
        metrics[UpdateFigure.KL_BEHAVIOUR] = sum(kl_behaviour) / len(kl_behaviour) if kl_behaviour else math.nan
        # Actor and learner must score the same function: on transitions the current weights chose, the learner's
        # log-prob equals the actor's (to float rounding). A gap here is a defect, not staleness.
        on_policy = [i for i, lag in enumerate(r.lags) if lag == 0]
        metrics[UpdateFigure.ON_POLICY_LOGPROB_DEV] = float((prox[on_policy] - behaviour[on_policy]).abs().max()) if on_policy else math.nan
        return Targets(
            mask=mask,
            behaviour_logp=behaviour,
            prox_logp=prox,
            advantages=core_algos.masked_whiten(self._column(r.advantages), mask),
            returns=self._column(r.returns),
            old_values=self._column(r.values),
        )

    def micro_batches(self, ids: list[int]) -> list[list[int]]:
        return [ids[start : start + self.micro_batch] for start in range(0, len(ids), self.micro_batch)]

    def forward(self, ids: list[int]) -> Forward:
        with self.lp.checkpointing():  # with gradient checkpointing on, a micro-batch keeps a layer's activations at a time
            logp_all = self.lp.logp_all([self.items[i] for i in ids])
        return Forward(
            logp=torch.stack([logp[self.actions[i]] for logp, i in zip(logp_all, ids, strict=True)]).unsqueeze(-1).float(),
            entropy=torch.stack([core_algos.entropy(logp) for logp in logp_all]).unsqueeze(-1).float(),
            kl_ref=torch.stack([core_algos.kl_exact(logp, self.ref_logp[i]) for logp, i in zip(logp_all, ids, strict=True)])
            .unsqueeze(-1)
            .float(),
        )

    def values(self, ids: list[int]) -> torch.Tensor:
        return self.lp.value_head(self.features[ids]).float().unsqueeze(-1)


def candidate_update(
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
    """The one PPO update (learner_node/update.py) on a rollout of choices; metrics under `losses/...`."""
    return ppo_update(
        CandidateBatch(lp, rollout, cfg.micro_batch, features),
        lp.trainable_parameters(),
        policy_opt,
        list(lp.value_head.parameters()),
        value_opt,
        LossSettings.candidates(cfg, kl_coef),
        train_policy,
        update_index,
    )
