"""The learner's figures: their names, declared once here, and the one Redis hash the learner overwrites after
each update.

Written by the learner (an update's figures, its version, and its cumulative, checkpointed counters under
`counters/...`); read by the broker's status and Prometheus endpoint, `ppoz status`, `ppoz train`'s progress
line, the demo's and the reliability ledger; the learner's TensorBoard log has the same names. The key and its
encoding live here only (the key's name: common/segments.py), and so does every figure's name:

- `Latest`: the learner's own (`updates`, `version`, ...), named as they are;
- `Chart`: an update's figures about its data (returns, lag, what was dropped), `charts/<name>`;
- `UpdateFigure`: an update's figures of one kind of policy (losses, KL, clip fractions), `<prefix>/<name>`
  with the prefix of the kind it trained (`UPDATE_PREFIXES`);
- `LearnerCounter`: the cumulative counters, `counters/<name>` (and `counters/mismatched_<reason>`);
- `CyclePhase`: the seconds the learner spent in each part of its loop, `cycle/<name>_s`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum

import redis

from common.segments import RedisKeys

CHARTS = "charts"
COUNTER_PREFIX = "counters/"
CYCLE_PREFIX = "cycle/"
# An update's figures are named `<prefix>/<figure>` by the kind of transition it trained (learner_node/update.py's
# PolicyBatch.prefix): candidate choices, and generated responses (token-level PPO).
UPDATE_PREFIXES = {"candidates": "losses", "generation": "generation"}
CANDIDATES, GENERATION = UPDATE_PREFIXES["candidates"], UPDATE_PREFIXES["generation"]


class Latest(StrEnum):
    """The learner's own figures, written with every update's: named as they are."""

    UPDATES = "updates"
    VERSION = "version"
    TRANSITIONS = "transitions"  # trained by the last update
    TIME = "time"  # of the last write, seconds since the epoch


class Chart(StrEnum):
    """An update's figures about the data it trained on, named `charts/<name>` (`key`)."""

    EPISODIC_RETURN = "episodic_return"
    EPISODES = "episodes"
    POLICY_LAG = "policy_lag"
    SPS = "SPS"
    POLICY_VERSION = "policy_version"
    DROPPED_STALE = "dropped_stale"
    DROPPED_TRUNCATED = "dropped_truncated"
    DROPPED_UNSCORABLE_NEXT_OBS = "dropped_unscorable_next_obs"
    DROPPED_MISMATCHED = "dropped_mismatched"
    DROPPED_NONFINITE = "dropped_nonfinite"  # a discarded update's: its transitions
    DISCARDED_UPDATES = "discarded_updates"

    @property
    def key(self) -> str:
        return f"{CHARTS}/{self.value}"


class UpdateFigure(StrEnum):
    """An update's figures of one kind of policy (learner_node/update.py; the batch's own: rollout.py, token_update.py),
    named `<prefix>/<name>` (`of`) with the kind's prefix (`UPDATE_PREFIXES`)."""

    POLICY_LOSS = "policy_loss"
    VALUE_LOSS = "value_loss"
    ENTROPY = "entropy"
    APPROX_KL = "approx_kl"
    KL_REF = "kl_ref"
    CLIPFRAC = "clipfrac"
    DUAL_CLIPFRAC = "dual_clipfrac"
    BEHAVIOUR_WEIGHT = "behaviour_weight"
    BEHAVIOUR_WEIGHT_CAPPED = "behaviour_weight_capped"
    EXPLAINED_VARIANCE = "explained_variance"
    FIRST_MINIBATCH_RATIO_DEV = "first_minibatch_ratio_dev"
    OPTIMIZER_STEPS = "optimizer_steps"
    EARLY_STOP = "early_stop"
    KL_COEF = "kl_coef"
    KL_BEHAVIOUR = "kl_behaviour"  # candidates
    ON_POLICY_LOGPROB_DEV = "on_policy_logprob_dev"
    RESPONSE_LENGTH = "response_length"  # generation: mean tokens per response
    REWARD_MEAN = "reward_mean"  # generation
    TOKENS = "tokens"  # generation: response tokens in the batch
    GROUP_RELATIVE = "group_relative"  # generation: 1 with grpo or rloo advantages, 0 with gae

    def of(self, prefix: str) -> str:
        return f"{prefix}/{self.value}"


class LearnerCounter(StrEnum):
    """The learner's cumulative counters, checkpointed with it, named `counters/<name>` (`key`)."""

    TRANSITIONS_STORED = "transitions_stored"
    TRANSITIONS_TRAINED = "transitions_trained"
    SEGMENTS_TRAINED = "segments_trained"
    DROPPED_STALE = "dropped_stale"
    DROPPED_TRUNCATED = "dropped_truncated"
    DROPPED_UNSCORABLE_NEXT_OBS = "dropped_unscorable_next_obs"  # of dropped_truncated
    DROPPED_MISMATCHED = "dropped_mismatched"  # and by the field that disagreed: `mismatched_counter`
    DROPPED_NONFINITE = "dropped_nonfinite"
    DISCARDED_UPDATES = "discarded_updates"
    MALFORMED_SEGMENTS = "malformed_segments"
    DUPLICATE_SEGMENTS = "duplicate_segments"
    VANISHED_SEGMENTS = "vanished_segments"

    @property
    def key(self) -> str:
        return counter_key(self.value)


class CyclePhase(StrEnum):
    """Where the learner's time goes, cumulative seconds since it started, named `cycle/<name>_s` (`key`):
    learner_node/cycle.py keeps them; `ppoz train`'s summary and `ppoz bench train` show their shares."""

    READ = "read"  # stream entries read and decoded
    IDLE = "idle"  # waiting for entries: reads that came back empty
    PREPARE = "prepare"  # a rollout's batches built, and the passes without gradients (proximal, reference, values)
    UPDATE = "update"  # the optimizer's passes, and the copy that can undo them
    CHECKPOINT = "checkpoint"  # what the checkpoints keep the loop waiting for (the copy; the write runs beside)
    PUBLISH = "publish"  # acknowledgements, figures and weights into Redis, and the announcement
    OTHER = "other"  # the rest of the loop: logging, TensorBoard

    @property
    def key(self) -> str:
        return f"{CYCLE_PREFIX}{self.value}_s"


def cycle_seconds(figures: Mapping[str, float]) -> dict[str, float]:
    """The learner's cumulative seconds by phase (`CyclePhase`) out of its figures; {} before its first update."""
    return {p.value: figures[p.key] for p in CyclePhase if p.key in figures}


MISMATCHED_PREFIX = "mismatched_"


def mismatched_counter(reason: str) -> str:
    """The counter of transitions dropped because their stamp's `reason` disagreed (run, temperature, ...)."""
    return f"{MISMATCHED_PREFIX}{reason}"


# What `ppoz status` shows of the last update, as the learner names them (a figure an update did not have is left out:
# GRPO has no value_loss).
LAST_UPDATE_FIGURES = (
    UpdateFigure.POLICY_LOSS,
    UpdateFigure.VALUE_LOSS,
    UpdateFigure.ENTROPY,
    UpdateFigure.APPROX_KL,
    UpdateFigure.KL_REF,
    UpdateFigure.CLIPFRAC,
)


def counter_key(name: str) -> str:
    return f"{COUNTER_PREFIX}{name}"


def latest_key(key_prefix: str) -> str:
    return RedisKeys(key_prefix).learner_latest


def write_latest(client: redis.Redis, key_prefix: str, figures: Mapping[str, float]) -> None:
    """The learner's latest figures, merged into what is there. An update's figures replace the last update's
    whole: a learner that trained the other kind of policy before leaves none of its figures to pass for the
    last update's (the counters and the version stay)."""
    key = latest_key(key_prefix)
    prefixes = tuple(f"{p}/" for p in UPDATE_PREFIXES.values())
    stale: list[bytes] = []
    if any(name.startswith(prefixes) for name in figures):
        names = {field: field.decode(errors="replace") for field in client.hkeys(key)}
        stale = [field for field, name in names.items() if name.startswith(prefixes) and name not in figures]
    with client.pipeline(transaction=True) as pipe:  # one MULTI: a reader never sees the figures half replaced
        if stale:
            pipe.hdel(key, *stale)
        pipe.hset(key, mapping=dict(figures))
        pipe.execute()


def read_latest(client: redis.Redis, key_prefix: str) -> dict[str, float]:
    """Every figure as a float; {} before the first update. Entries that are not numbers are skipped."""
    out = {}
    for key, value in client.hgetall(latest_key(key_prefix)).items():
        try:
            out[key.decode()] = float(value)
        except (UnicodeDecodeError, ValueError):
            continue
    return out


def counters(figures: Mapping[str, float]) -> dict[str, int]:
    """The learner's cumulative counters out of its figures (transitions_stored, transitions_trained, ...)."""
    return {k.removeprefix(COUNTER_PREFIX): int(v) for k, v in figures.items() if k.startswith(COUNTER_PREFIX)}


def last_update(figures: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """The last update's LAST_UPDATE_FIGURES by kind of policy ("candidates", "generation"), each kind the
    figures hold; a figure that is not there (or not a number) is left out."""
    out: dict[str, dict[str, float]] = {}
    for kind, prefix in UPDATE_PREFIXES.items():
        found = {str(name): figures[name.of(prefix)] for name in LAST_UPDATE_FIGURES if name.of(prefix) in figures}
        found = {name: value for name, value in found.items() if not math.isnan(value)}
        if found:
            out[kind] = found
    return out
