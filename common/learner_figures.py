"""The learner's latest figures in Redis: one hash the learner overwrites after each update.

Written by the learner (losses, version, and its cumulative, checkpointed
counters under `counters/...`); read by the broker's status and Prometheus
endpoint, the demo's progress line and the reliability ledger. The key and
its encoding live here only (the key's name: common/segments.py), and so do
the prefixes an update's figures carry by the kind of policy it trained.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import redis

from common.segments import RedisKeys

COUNTER_PREFIX = "counters/"
# An update's figures are named `<prefix>/<figure>` by the kind of transition it trained (learner_node/update.py's
# PolicyBatch.prefix): candidate choices, and generated responses (token-level PPO). Candidates first: the order
# in which `update_figure` looks.
UPDATE_PREFIXES = {"candidates": "losses", "generation": "generation"}
CANDIDATES, GENERATION = UPDATE_PREFIXES["candidates"], UPDATE_PREFIXES["generation"]
# What `ppoz status` shows of the last update, as the learner names them (a figure an update did not have is left out:
# GRPO has no value_loss).
LAST_UPDATE_FIGURES = ("policy_loss", "value_loss", "entropy", "approx_kl", "kl_ref", "clipfrac")


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


def update_figure(figures: Mapping[str, float], name: str) -> float:
    """An update's figure `name` (policy_loss, ...): the candidate update's if it has one, else the generation
    update's; NaN if neither."""
    for prefix in UPDATE_PREFIXES.values():
        value = figures.get(f"{prefix}/{name}")
        if value is not None:
            return value
    return math.nan


def last_update(figures: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """The last update's LAST_UPDATE_FIGURES by kind of policy ("candidates", "generation"), each kind the
    figures hold; a figure that is not there (or not a number) is left out."""
    out: dict[str, dict[str, float]] = {}
    for kind, prefix in UPDATE_PREFIXES.items():
        found = {name: figures[f"{prefix}/{name}"] for name in LAST_UPDATE_FIGURES if f"{prefix}/{name}" in figures}
        found = {name: value for name, value in found.items() if not math.isnan(value)}
        if found:
            out[kind] = found
    return out
