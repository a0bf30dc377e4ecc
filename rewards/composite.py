"""One reward from several sources: a weighted sum, then optional normalisation and clipping.

Components, each named as in the config table:
    rule_score   the reward function (rewards/functions.py)
    rm_score     the local reward model (rewards/reward_model.py), or a reward service's (rewards/service/)
    judge_score  the LLM judge (rewards/judge.py), or a reward service's, in [0, 1]

    [train]
    weights = { rm_score = 0.7, rule_score = 0.3 }
    reward_normalise = "running"   # none | running: (r - mean) / std over every reward so far
    reward_clip = 5.0              # |r| <= clip after normalisation; 0: no clipping

A response whose component cannot be computed (the reward function or the reward model raised
RewardError, the judge's reply was unreadable or its request failed) gets no reward: `Scored.reward`
is None and `error` says why. The driver then leaves that turn out of training; it never becomes a 0.

Every number on its way to a reward is held to `max_abs_reward` (common.protocol.reward_problem, the
rule the broker holds a feedback's reward to): each component's value, the weighted sum, and the reward
after normalisation. One that is not finite or is past the bound leaves its response unrewarded, the
error naming the component, the value and the record; it is never clipped into a reward (`clip` bounds
good rewards; a NaN or a 1e300 is a bug, and clipped it would still be trained on). Each unrewarded
response is counted in `CompositeReward.unrewarded` by `component/reason` and logged with its record.

The reward function is a user's code: each call runs on a worker thread with a deadline
(`reward_fn_timeout_s`, RewardFnRunner), so one that never returns, or raises SystemExit, costs that
response its reward and nothing more.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.protocol import DEFAULT_MAX_ABS_REWARD, is_reward_bound, reward_problem
from rewards.config import DEFAULT_REWARD_FN_TIMEOUT_S
from rewards.functions import RewardError, RewardFn, as_score, bound_reason

log = logging.getLogger(__name__)

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
        """Take a batch in; a value that is not finite is left out (one NaN would make every later reward NaN)."""
        values = [v for v in values if math.isfinite(v)]
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


@dataclass
class _Call:
    """One call of the reward function, handed to its worker thread."""

    kwargs: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    raised: BaseException | None = None
    trace: str = ""


STOP_POLL_S = 0.1  # how often a wait on the reward function looks whether the run is stopping


class RewardFnRunner:
    """Calls a user's reward function one call at a time on a worker thread of its own, each call with a deadline.

    Why a thread and not a process: a function loaded from `path/to/file.py:function` lives in a module a
    child process cannot import by name, closures and lambdas do not pickle, a function may keep state
    (a cache, a loaded checker) that a pool of processes would hold once per process, and a process per call
    would import torch again each time. A thread cannot be killed, though: a call past its deadline is
    abandoned. Its thread is left to finish on its own (a daemon: it never holds the process at exit), the
    response gets no reward, and the next call starts on a fresh thread, so a hung call holds no lock of the
    scorer. The one place the function may then run twice at once is beside such an abandoned call.

    Anything the function raises, SystemExit and KeyboardInterrupt included, fails that call alone:
    RewardError (for those two, with the traceback logged). The scorer goes on. `call` itself is for one
    caller at a time: CompositeReward calls it under its lock."""

    def __init__(self, fn: RewardFn, timeout_s: float = DEFAULT_REWARD_FN_TIMEOUT_S) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"`reward_fn_timeout_s` must be a positive number of seconds, got {timeout_s}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.abandoned = 0  # calls given up on past their deadline
        self._stopping = threading.Event()  # set by `stop`: the run is ending, no call is waited for any more
        self._calls: queue.SimpleQueue[_Call | None] | None = None  # the current worker's; None: none started yet

    def call(self, **kwargs: Any) -> Any:
        """The function's result; RewardError when it raised anything, did not return within `timeout_s`, or the
        run is stopping (`stop`)."""
        if self._stopping.is_set():
            raise RewardError("the run is stopping: the reward function was not called", reason="stopped")
        if self._calls is None:
            self._calls = self._start_worker()
        call = _Call(kwargs)
        self._calls.put(call)
        deadline = time.monotonic() + self.timeout_s
        # Waited for in short slices, so that `stop` (SIGTERM) ends a wait on a hung function within one slice.
        while not call.done.wait(min(STOP_POLL_S, max(0.0, deadline - time.monotonic()))):
            if self._stopping.is_set() or time.monotonic() >= deadline:
                self._calls.put(None)  # the abandoned worker ends once (if ever) its call returns
                self._calls = None
                self.abandoned += 1
                if self._stopping.is_set():
                    raise RewardError("the run is stopping: the reward function's call was abandoned", reason="stopped")
                raise RewardError(
                    f"the reward function did not return within {self.timeout_s:g} s (reward_fn_timeout_s); the call was abandoned",
                    reason="timed_out",
                )
        if call.raised is None:
            return call.result
        if isinstance(call.raised, RewardError):  # the function's own refusal, as it worded it
            raise RewardError(str(call.raised), reason=call.raised.reason)
        if not isinstance(call.raised, Exception):  # SystemExit, KeyboardInterrupt, GeneratorExit: worth a traceback in the log
            log.error(
                "the reward function raised %s; that response goes unrewarded and scoring goes on\n%s",
                type(call.raised).__name__,
                call.trace,
            )
        raise RewardError(f"the reward function raised {type(call.raised).__name__}: {call.raised}", reason="raised")

    def stop(self) -> None:
        """The run is ending: a call in progress is abandoned within STOP_POLL_S, and later calls fail at once."""
        self._stopping.set()

    def _start_worker(self) -> queue.SimpleQueue[_Call | None]:
        calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(calls,), name="reward-fn", daemon=True).start()
        return calls

    def _serve(self, calls: queue.SimpleQueue[_Call | None]) -> None:
        while (call := calls.get()) is not None:
            try:
                call.result = self.fn(**call.kwargs)
            except BaseException as e:  # noqa: BLE001 - a user's SystemExit must fail its response, not end this thread unseen
                call.raised, call.trace = e, traceback.format_exc()
            call.done.set()


class CompositeReward:
    """The weighted sum of the configured components, normalised and clipped as configured."""

    WARNINGS_PER_REASON = 20  # then each further unrewarded response of that reason is logged at DEBUG only

    def __init__(
        self,
        weights: Mapping[str, float],
        reward_fn: RewardFn | None = None,
        reward_model: Any = None,  # RewardModel, RemoteRewardModel: score(pairs) -> a float (from a service: or a RewardError) per pair
        judge: Any = None,  # rewards.judge.Judge: judge_many(items) -> list[Verdict]
        normalise: str = "none",
        clip: float = 0.0,
        max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
        reward_fn_timeout_s: float = DEFAULT_REWARD_FN_TIMEOUT_S,
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
        if not is_reward_bound(max_abs_reward):
            raise ValueError(f"reward `max_abs_reward` must be a positive finite number, got {max_abs_reward}")
        self.weights = {name: float(w) for name, w in weights.items() if w != 0}
        self.reward_fn, self.reward_model, self.judge = reward_fn, reward_model, judge
        self.normalise, self.clip = normalise, clip
        self.max_abs_reward = max_abs_reward
        self.moments = RunningMoments()
        self.runner = RewardFnRunner(reward_fn, reward_fn_timeout_s) if reward_fn is not None else None
        # Why responses went unrewarded, by `component/reason` (rule_score/timed_out, rm_score/not_finite,
        # weighted_sum/out_of_range, judge_score/no_verdict, ...): the driver's summary reads it.
        self.unrewarded: Counter[str] = Counter()
        self._counted = threading.Lock()
        # Batches may be scored from several threads at once (dataset_driver/scorer.py BatchingScorer) so that a judge's
        # requests overlap; the reward function (a user's, maybe not thread-safe), the reward model and the
        # running moments take one batch at a time.
        self._serial = threading.Lock()

    def stop(self) -> None:
        """The run is ending (SIGTERM): a reward function's call in progress is abandoned at once and no other is
        made, so a hung function cannot hold the scorer's threads, and the process, at exit."""
        if self.runner is not None:
            self.runner.stop()

    def score(self, items: Sequence[Item], raw: bool = False) -> list[Scored]:
        """Each item's reward; `raw`: the weighted sum as it is, neither normalised (nor counted in the
        running moments) nor clipped (a validation figure that reads the same across a run)."""
        components: list[dict[str, float]] = [{} for _ in items]
        extras: list[dict[str, float]] = [{} for _ in items]
        errors = [""] * len(items)
        with self._serial:  # one batch at a time (see __init__); the judge's requests overlap
            if "rule_score" in self.weights and self.runner is not None:
                for i, item in enumerate(items):
                    try:  # by keyword, as verl calls it
                        result = self.runner.call(
                            data_source=item.data_source,
                            solution_str=item.response,
                            ground_truth=item.ground_truth,
                            extra_info=dict(item.extra_info),
                        )
                        score = as_score(result, item.where or "reward function", self.max_abs_reward)
                    except RewardError as e:  # its own, a result out of range, a timeout, anything it raised
                        errors[i] = self._refuse(item, "rule_score", e.reason, str(e))
                        continue
                    components[i]["rule_score"], extras[i] = score.reward, score.extra
            if "rm_score" in self.weights:
                todo = [i for i in range(len(items)) if not errors[i]]  # a response already without a reward costs nothing more
                try:
                    values = self.reward_model.score([(items[i].prompt, items[i].response) for i in todo])
                except RewardError as e:  # a reward service that does not answer, a response over the model's limit
                    values = []
                    for i in todo:
                        errors[i] = self._refuse(items[i], "rm_score", e.reason, str(e))
                for i, value in zip(todo, values):
                    if isinstance(value, RewardError):  # a row the reward service refused (rewards/service/)
                        errors[i] = self._refuse(items[i], "rm_score", value.reason, str(value))
                    else:
                        errors[i] = self._bounded(items[i], "rm_score", float(value))
                        if not errors[i]:
                            components[i]["rm_score"] = float(value)
        if "judge_score" in self.weights:
            todo = [i for i in range(len(items)) if not errors[i]]
            verdicts = self.judge.judge_many([(items[i].prompt, items[i].response, items[i].ground_truth) for i in todo])
            for i, verdict in zip(todo, verdicts):
                if verdict.reward is None:
                    errors[i] = self._refuse(items[i], "judge_score", "no_verdict", verdict.error)
                else:
                    errors[i] = self._bounded(items[i], "judge_score", verdict.reward)
                    if not errors[i]:
                        components[i]["judge_score"] = verdict.reward
        totals: list[float | None] = [None] * len(items)
        for i in range(len(items)):
            if not errors[i]:
                total = sum(w * components[i][name] for name, w in self.weights.items())
                errors[i] = self._bounded(items[i], "weighted_sum", total)  # weights can carry a sum past the bound
                totals[i] = None if errors[i] else total
        rewards = totals if raw else self._normalised(totals)
        for i, reward in enumerate(rewards):
            if reward is not None and not errors[i]:
                errors[i] = self._bounded(items[i], "normalised", reward)  # cannot fail today; the bound holds whatever normalising becomes
        return [Scored(None if errors[i] else rewards[i], components[i], extras[i], errors[i]) for i in range(len(items))]

    def _normalised(self, totals: list[float | None]) -> list[float | None]:
        # Every total here passed _bounded: finite, so the clip below never meets a NaN (max/min with NaN give the bound).
        if self.normalise == "running":
            with self._serial:
                self.moments.update([t for t in totals if t is not None])
                mean, std = self.moments.mean, self.moments.std
            totals = [None if t is None else (t - mean) / (std + 1e-8) for t in totals]
        if self.clip:
            totals = [None if t is None else max(-self.clip, min(self.clip, t)) for t in totals]
        return totals

    def _bounded(self, item: Item, what: str, value: float) -> str:
        """ "" when `value` may stand as `what` (a component, the weighted sum); else why not, counted and logged."""
        problem = reward_problem(value, self.max_abs_reward)
        return self._refuse(item, what, bound_reason(value), f"{what} {problem}") if problem else ""

    def _refuse(self, item: Item, what: str, reason: str, error: str) -> str:
        """Count and log one response left unrewarded; its error, naming the record."""
        key = f"{what}/{reason}"
        named = _named(item, error)
        with self._counted:
            self.unrewarded[key] += 1
            seen = self.unrewarded[key]
        if seen <= self.WARNINGS_PER_REASON:
            last = " (further ones of this kind: DEBUG only, counted)" if seen == self.WARNINGS_PER_REASON else ""
            log.warning("unrewarded (%s): %s%s", key, named, last)
        else:
            log.debug("unrewarded (%s): %s", key, named)
        return named
