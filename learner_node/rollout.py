"""From trajectory segments to a training batch: bootstrap rules, GAE, staleness filter.

Bootstrap rules for a segment (docs/design.md, "Learner"):
- closed by `done`: the episode ended with its last transition; nothing is bootstrapped.
- carries `next_obs` (closed by length, by the orphan-step rule, or truncated with
  the next observation known): bootstrap from V(next_obs).
- truncated with nothing after it (detach, expiry without a pending step): the
  last transition has no observed successor, so it is not trained on (counted as
  `dropped_truncated`); its observation's value bootstraps the transition before it.
Transitions whose behaviour policy is more than `max_policy_lag` versions old are
dropped after GAE (they still shape their neighbours' targets) and counted
(`dropped_stale`); so are transitions from a version ahead of the learner's, which
only another run of the learner can have produced (`dropped_mismatched`). Stale
transitions within the lag are trained on: the decoupled objective corrects for
their behaviour policy (learner_node/ppo.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common.segments import Segment, Transition
from common.shared_settings import PolicyStamp
from learner_node import ppo


@dataclass
class Tally:
    """What a batch took from its segments and what it left out, and why: the learner's counters and the ledger."""

    episodic_returns: list[float] = field(default_factory=list)
    dropped_stale: int = 0
    dropped_truncated: int = 0
    dropped_mismatched: int = 0
    mismatched: collections.Counter[str] = field(default_factory=collections.Counter)  # by the field that disagreed
    stored: int = 0  # transitions in the segments taken


@dataclass
class Rollout(Tally):
    """Flat per-transition training data (b_ tensors) of candidate choices, and what was left out."""

    obs: list[dict[str, Any]] = field(default_factory=list)
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
    value_of: Callable[[list[dict[str, Any]]], list[float]],
    gamma: float,
    lam: float,
    current_version: int,
    max_policy_lag: int,
    episodes: EpisodeReturns | None = None,
    expected: PolicyStamp | None = None,
) -> Rollout:
    """Turn decoded segments into a Rollout; `value_of(observations)` is the critic (no gradients).

    `episodes` carries episode returns across calls (the learner keeps one); by default a fresh
    one, so an episode's return counts only if it starts and ends within these segments.
    `expected`: the learner's own policy stamp; a stamped transition that disagrees with it
    is dropped and counted by the field that differs (unstamped ones are taken as they are)."""
    out = Rollout()
    episodes = episodes if episodes is not None else EpisodeReturns()
    # One critic call for every observation and bootstrap observation of the batch.
    wanted: list[dict[str, Any]] = []
    for seg in segments:
        wanted += [t.obs for t in seg.transitions]
        if seg.next_obs is not None and not seg.done:
            wanted.append(seg.next_obs)
    values = value_of(wanted) if wanted else []
    cursor = 0
    for seg in segments:
        out.episodic_returns += episodes.add(seg)
        transitions = seg.transitions
        n = len(transitions)
        out.stored += n
        seg_values = values[cursor : cursor + n]
        cursor += n
        if seg.done:
            next_value = 0.0
        elif seg.next_obs is not None:
            next_value = values[cursor]
            cursor += 1
        else:  # truncated with no successor: drop the last transition, bootstrap from its observation
            out.dropped_truncated += 1
            transitions, next_value, seg_values = transitions[:-1], seg_values[-1], seg_values[:-1]
            n -= 1
            if n == 0:
                continue
        rewards = torch.tensor([float(t.reward) for t in transitions])
        dones = torch.tensor([bool(t.done) for t in transitions])
        b_values = torch.tensor(seg_values, dtype=torch.float32)
        advantages, returns = ppo.gae(rewards, b_values, dones, next_value, gamma, lam)
        for t, adv, ret, v in zip(transitions, advantages.tolist(), returns.tolist(), seg_values):
            lag = current_version - t.policy_version
            reason = "version_ahead" if lag < 0 else _disagreement(t, expected)
            if reason is not None:
                out.dropped_mismatched += 1
                out.mismatched[reason] += 1
                continue
            if lag > max_policy_lag:
                out.dropped_stale += 1
                continue
            out.obs.append(t.obs)
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


def _disagreement(t: Transition, expected: PolicyStamp | None) -> str | None:
    """Why the learner must not train on `t` (a field of its stamp that differs), or None."""
    if expected is None or t.policy is None:
        return None
    try:
        stamp = PolicyStamp.from_wire(t.policy)
    except ValueError:
        return "stamp"
    return stamp.disagreement(expected, t.policy_version)
