"""The ledger read from a real Redis: which side is missing, and settling on progress instead of a fixed deadline."""

from __future__ import annotations

import threading
import time

from common.learner_figures import COUNTER_PREFIX, latest_key, write_latest
from tests.learner_node.test_resume import write_segments
from tools.reliability.ledger import read_ledger, settle_ledger


def report(redis_client, key_prefix: str, stored: int, trained: int, stale: int = 0, truncated: int = 0, nonfinite: int = 0) -> None:
    """What the learner publishes after an update (common/learner_figures.py)."""
    counters = {
        "transitions_stored": stored,
        "transitions_trained": trained,
        "dropped_stale": stale,
        "dropped_truncated": truncated,
        "dropped_nonfinite": nonfinite,
    }
    write_latest(redis_client, key_prefix, {"updates": 1, **{COUNTER_PREFIX + k: v for k, v in counters.items()}})


def test_without_the_learners_figures_the_ledger_names_the_missing_side(redis_client, key_prefix):
    ledger = read_ledger(redis_client, key_prefix, acknowledged=0)
    assert not ledger.learner_reported
    assert not ledger.balanced  # unknown counters are not zeros, even when nothing was acknowledged
    said = str(ledger)
    assert "learner" in said and "missing" in said and latest_key(key_prefix) in said
    assert "trained 0" not in said  # no zeros made up for the side that did not report


def test_the_learners_counters_and_the_unread_stream(redis_client, key_prefix):
    write_segments(redis_client, key_prefix, 3)
    report(redis_client, key_prefix, stored=10, trained=7, stale=2, truncated=1)
    ledger = read_ledger(redis_client, key_prefix, acknowledged=10)
    assert (ledger.stored, ledger.trained, ledger.dropped_stale, ledger.dropped_truncated) == (10, 7, 2, 1)
    assert ledger.in_stream == 3 and not ledger.balanced
    redis_client.delete(f"{key_prefix}:segments")
    assert read_ledger(redis_client, key_prefix, acknowledged=10).balanced
    assert not read_ledger(redis_client, key_prefix, acknowledged=11).balanced


def test_transitions_of_a_discarded_non_finite_update_balance_the_ledger_as_dropped(redis_client, key_prefix):
    report(redis_client, key_prefix, stored=16, trained=8, nonfinite=8)
    ledger = read_ledger(redis_client, key_prefix, acknowledged=16)
    assert ledger.dropped_nonfinite == 8 and ledger.balanced and "non-finite 8" in str(ledger)


def test_settling_gives_up_only_when_the_ledger_stops_moving(redis_client, key_prefix):
    report(redis_client, key_prefix, stored=0, trained=0)
    stop = threading.Event()

    # One transition every 0.2 s: 20 in about 4 s, twice the stall limit. The limit was 0.8 s for 10 transitions, so
    # a worker held 0.6 s by a loaded machine looked stalled; 2 s is 10 times the cadence.
    def slow_learner() -> None:
        for n in range(1, 21):
            if stop.wait(0.2):
                return
            report(redis_client, key_prefix, stored=n, trained=n)

    worker = threading.Thread(target=slow_learner)
    worker.start()
    try:
        started = time.monotonic()
        ledger = settle_ledger(redis_client, key_prefix, acknowledged=20, stall_s=2.0, poll_s=0.05)
        assert ledger.balanced, str(ledger)
        assert time.monotonic() - started > 3.0  # it waited past the stall limit because the ledger kept moving
    finally:
        stop.set()
        worker.join(10)  # it sees `stop` within its 0.2 s wait; x50
    # Nothing moves any more: one acknowledged feedback too many is reported after the stall limit, not waited for.
    started = time.monotonic()
    ledger = settle_ledger(redis_client, key_prefix, acknowledged=11, stall_s=0.5, poll_s=0.05)
    assert not ledger.balanced and 0.5 <= time.monotonic() - started < 5  # the 0.5 s limit, and 4.5 s for a loaded machine
