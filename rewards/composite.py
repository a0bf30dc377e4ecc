"""One reward from several sources: a weighted sum, then optional normalisation and clipping.

Components, each named as in the config table:
    rule_score   the reward function (rewards/functions.py)
    rm_score     the local reward model (rewards/reward_model.py), or a reward service's (rewards/service.py)
    judge_score  the LLM judge (rewards/judge.py), or a reward service's, in [0, 1]

    [train.reward]
    weights = { rm_score = 0.7, rule_score = 0.3 }
    normalise = "running"   # none | running: (r - mean) / std over every reward so far
    clip = 5.0              # |r| <= clip after normalisation; 0: no clipping

A response whose component cannot be computed (the reward function or the reward model raised
RewardError, the judge's reply was unreadable or its request failed) gets no reward: `Scored.reward`
is None and `error` says why. The driver then leaves that turn out of training; it never becomes a 0.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rewards.functions import RewardError, RewardFn, as_score

COMPONENTS = ("rule_score", "rm_score", "judge_score")
NORMALISATIONS = ("none", "running")


@dataclass(frozen=True)
class Item:
    """One response to score, with its record's fields."""

    prompt: str  # the prompt as text (chat messages as `role: content` lines)
    response: str
    ground_truth: Any = None
    data_source: str = "default"
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    where: str = ""  # the record, for errors


@dataclass(frozen=True)
class Scored:
    reward: float | None  # None: no reward could be computed (see `error`)
    components: dict[str, float]
    extra: dict[str, float] = field(default_factory=dict)  # figures a reward function reported
    error: str = ""


def prompt_text(prompt: str | Sequence[Mapping[str, str]]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _named(item: Item, error: str) -> str:
    """The error with the record it concerns, once."""
    return error if not item.where or error.startswith(item.where) else f"{item.where}: {error}"


class RunningMoments:
    """Mean and variance of every value seen (Chan et al.'s parallel update, batch by batch)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, values: Sequence[float]) -> None:
        if not values:
            return
        n = len(values)
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        delta = mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0


class CompositeReward:
    """The weighted sum of the configured components, normalised and clipped as configured."""

    def __init__(
        self,
        weights: Mapping[str, float],
        reward_fn: RewardFn | None = None,
        reward_model: Any = None,  # rewards.reward_model.RewardModel: score(pairs) -> list[float]
        judge: Any = None,  # rewards.judge.Judge: judge_many(items) -> list[Verdict]
        normalise: str = "none",
        clip: float = 0.0,
    ) -> None:
        unknown = set(weights) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"reward weights name unknown components {sorted(unknown)}; known: {', '.join(COMPONENTS)}")
        if not any(w != 0 for w in weights.values()):
            raise ValueError("reward weights are all 0: nothing would be rewarded")
        sources = {"rule_score": reward_fn, "rm_score": reward_model, "judge_score": judge}
        missing = [name for name, w in weights.items() if w != 0 and sources[name] is None]
        if missing:
            what = {"rule_score": "a reward function", "rm_score": "a reward model", "judge_score": "a judge"}
            raise ValueError(f"reward weight {missing[0]} is set but {what[missing[0]]} is not configured")
        if normalise not in NORMALISATIONS:
            raise ValueError(f"reward `normalise` must be one of {', '.join(NORMALISATIONS)}, got {normalise!r}")
        if clip < 0:
            raise ValueError(f"reward `clip` must be >= 0 (0: none), got {clip}")
        self.weights = {name: float(w) for name, w in weights.items() if w != 0}
        self.reward_fn, self.reward_model, self.judge = reward_fn, reward_model, judge
        self.normalise, self.clip = normalise, clip
        self.moments = RunningMoments()
        # Batches may be scored from several threads at once (train/driver.py BatchingScorer) so that a judge's
        # requests overlap; the reward function (a user's, maybe not thread-safe), the reward model and the
        # running moments take one batch at a time.
        self._serial = threading.Lock()

    def score(self, items: Sequence[Item], raw: bool = False) -> list[Scored]:
        """Each item's reward; `raw`: the weighted sum as it is, neither normalised (nor counted in the
        running moments) nor clipped (a validation figure that reads the same across a run)."""
        components: list[dict[str, float]] = [{} for _ in items]
        extras: list[dict[str, float]] = [{} for _ in items]
        errors = [""] * len(items)
        with self._serial:  # one batch at a time (see __init__); the judge's requests overlap
            if "rule_score" in self.weights:
                for i, item in enumerate(items):
                    try:  # by keyword, as verl calls it
                        result = self.reward_fn(  # type: ignore[misc]
                            data_source=item.data_source,
                            solution_str=item.response,
                            ground_truth=item.ground_truth,
                            extra_info=dict(item.extra_info),
                        )
                        score = as_score(result, item.where or "reward function")
                    except RewardError as e:
                        errors[i] = _named(item, str(e))
                        continue
                    except Exception as e:  # noqa: BLE001 - a user's function failing on one record fails that record alone
                        errors[i] = _named(item, f"the reward function raised {type(e).__name__}: {e}")
                        continue
                    components[i]["rule_score"], extras[i] = score.reward, score.extra
            if "rm_score" in self.weights:
                todo = [i for i in range(len(items)) if not errors[i]]  # a response already without a reward costs nothing more
                try:
                    values = self.reward_model.score([(items[i].prompt, items[i].response) for i in todo])
                except RewardError as e:  # a reward service that does not answer, a response over the model's limit
                    values = []
                    for i in todo:
                        errors[i] = _named(items[i], str(e))
                for i, value in zip(todo, values):
                    components[i]["rm_score"] = float(value)
        if "judge_score" in self.weights:
            todo = [i for i in range(len(items)) if not errors[i]]
            verdicts = self.judge.judge_many([(items[i].prompt, items[i].response, items[i].ground_truth) for i in todo])
            for i, verdict in zip(todo, verdicts):
                if verdict.reward is None:
                    errors[i] = _named(items[i], verdict.error)
                else:
                    components[i]["judge_score"] = verdict.reward
        totals: list[float | None] = [
            None if errors[i] else sum(w * components[i][name] for name, w in self.weights.items()) for i in range(len(items))
        ]
        rewards = totals if raw else self._normalised(totals)
        return [Scored(rewards[i], components[i], extras[i], errors[i]) for i in range(len(items))]

    def _normalised(self, totals: list[float | None]) -> list[float | None]:
        if self.normalise == "running":
            with self._serial:
                self.moments.update([t for t in totals if t is not None])
                mean, std = self.moments.mean, self.moments.std
            totals = [None if t is None else (t - mean) / (std + 1e-8) for t in totals]
        if self.clip:
            totals = [None if t is None else max(-self.clip, min(self.clip, t)) for t in totals]
        return totals
