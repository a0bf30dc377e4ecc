"""The learner's latest figures in Redis: one hash the learner overwrites after each update.

Written by the learner (losses, version, and its cumulative, checkpointed
counters under `counters/...`); read by the broker's status and Prometheus
endpoint, the demo's progress line and the reliability ledger. The key and
its encoding live here only (the key's name: common/segments.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

from common.segments import RedisKeys

COUNTER_PREFIX = "counters/"


def latest_key(key_prefix: str) -> str:
    return RedisKeys(key_prefix).learner_latest


def write_latest(client: redis.Redis, key_prefix: str, figures: Mapping[str, float]) -> None:
    client.hset(latest_key(key_prefix), mapping=dict(figures))


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
