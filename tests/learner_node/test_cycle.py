"""The learner's cycle profile (learner_node/cycle.py): every second of its loop charged to one part of it, by hand
on a clock the test moves, and on a real learner reading a real Redis that has to wait for its rollout."""

from __future__ import annotations

import threading
import time

import pytest

from common.learner_figures import CyclePhase, cycle_seconds, read_latest
from learner_node.cycle import CycleClock
from tests.learner_node.test_pending import GROUP, make_learner
from tests.learner_node.test_resume import write_segments


class Hands:
    """A clock that moves only when the test says."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_every_second_is_charged_to_one_part_nested_parts_taken_out_of_the_outer():
    hands = Hands()
    clock = CycleClock(hands)
    hands.t += 1.0  # outside any part: other
    with clock.phase(CyclePhase.READ):
        hands.t += 2.0
        with clock.phase(CyclePhase.CHECKPOINT):  # a checkpoint begun between two reads
            hands.t += 4.0
        hands.t += 0.5
        with clock.phase(CyclePhase.READ):  # a read that came back empty: the wait was idle time
            hands.t += 8.0
            clock.recharge(CyclePhase.IDLE)
        hands.t += 0.25  # decoding what was read: read again
    with clock.phase(CyclePhase.UPDATE):
        hands.t += 16.0
        with clock.phase(CyclePhase.PREPARE):  # the passes without gradients, inside the update's call
            hands.t += 32.0
    figures = clock.figures()
    assert figures == {
        "cycle/read_s": 2.75,
        "cycle/idle_s": 8.0,
        "cycle/prepare_s": 32.0,
        "cycle/update_s": 16.0,
        "cycle/checkpoint_s": 4.0,
        "cycle/publish_s": 0.0,
        "cycle/other_s": 1.0,
    }
    assert sum(figures.values()) == hands.t - 100.0
    assert cycle_seconds({**figures, "updates": 3.0})["idle"] == 8.0  # as ppoz train's summary reads them
    clock.reset()
    hands.t += 5.0
    assert clock.figures()["cycle/other_s"] == 5.0 and sum(clock.figures().values()) == 5.0


def test_a_part_that_raises_is_still_charged_and_left():
    hands = Hands()
    clock = CycleClock(hands)
    with pytest.raises(ValueError), clock.phase(CyclePhase.UPDATE):
        hands.t += 3.0
        raise ValueError("a non-finite update")
    hands.t += 1.0
    assert clock.figures()["cycle/update_s"] == 3.0 and clock.figures()["cycle/other_s"] == 1.0


@pytest.mark.slow
def test_a_learner_waiting_for_half_its_rollout_shows_the_wait_as_idle(tiny_models, redis_url, redis_client, key_prefix, tmp_path):
    write_segments(redis_client, key_prefix, 2)  # half a rollout of 4
    learner = make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path)
    wait_s = 1.5
    stream = f"{key_prefix}:segments"

    def the_rest_later() -> None:
        deadline = time.monotonic() + 60  # the learner's first read: ms alone
        while redis_client.xpending(stream, GROUP)["pending"] < 2:  # the learner holds the first half: it waits now
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(wait_s)
        write_segments(redis_client, key_prefix, 2, first=2)

    writer = threading.Thread(target=the_rest_later, daemon=True)
    try:
        writer.start()
        learner.cycle.reset()
        started = time.perf_counter()
        assert learner.step() is not None
        took = time.perf_counter() - started
        writer.join(60)
        figures = cycle_seconds(read_latest(redis_client, key_prefix))  # the figures the update left in Redis
        assert set(figures) == {p.value for p in CyclePhase}
        # the learner read empty for at least the writer's wait, less one read's block (100 ms) that ended in data
        assert figures["idle"] >= wait_s - 0.2, figures
        assert figures["update"] > 0 and figures["prepare"] > 0 and figures["read"] > 0, figures
        assert sum(figures.values()) <= took + 0.01, (figures, took)  # charged once each: no second counted twice
        assert learner.counters["transitions_trained"] == 4
    finally:
        learner.close()
