"""The learner's figure names, declared once in common/learner_figures.py: the keys they make are the ones the
learner has always written to Redis and TensorBoard, which `ppoz status`, `ppoz train`, the demo, the ledger and
users' dashboards read."""

from __future__ import annotations

import math

from common.learner_figures import (
    CANDIDATES,
    GENERATION,
    Chart,
    Latest,
    LearnerCounter,
    UpdateFigure,
    counters,
    last_update,
    mismatched_counter,
)


def test_the_names_make_the_keys_the_learner_has_always_written() -> None:
    assert [c.key for c in Chart] == [
        "charts/episodic_return",
        "charts/episodes",
        "charts/policy_lag",
        "charts/SPS",
        "charts/policy_version",
        "charts/dropped_stale",
        "charts/dropped_truncated",
        "charts/dropped_unscorable_next_obs",
        "charts/dropped_mismatched",
        "charts/dropped_nonfinite",
        "charts/discarded_updates",
    ]
    assert (CANDIDATES, GENERATION) == ("losses", "generation")
    assert UpdateFigure.POLICY_LOSS.of(CANDIDATES) == "losses/policy_loss"
    assert UpdateFigure.KL_REF.of(GENERATION) == "generation/kl_ref"
    assert f"{GENERATION}/{UpdateFigure.CLIPFRAC}" == "generation/clipfrac"  # a name formats as its plain value
    assert [str(f) for f in Latest] == ["updates", "version", "transitions", "time"]
    assert LearnerCounter.TRANSITIONS_TRAINED.key == "counters/transitions_trained"
    assert mismatched_counter("run") == "mismatched_run"
    assert all(type(k) is str for k in (Chart.SPS.key, UpdateFigure.ENTROPY.of(GENERATION), LearnerCounter.DROPPED_STALE.key))


def test_a_name_finds_its_figure_among_plain_keys() -> None:
    figures = {"version": 3.0, "losses/policy_loss": 0.5, "counters/transitions_trained": 64.0, "counters/mismatched_run": 2.0}
    assert figures[Latest.VERSION] == 3.0
    assert counters(figures) == {"transitions_trained": 64, "mismatched_run": 2}
    assert counters(figures)[LearnerCounter.TRANSITIONS_TRAINED] == 64


def test_the_last_update_is_read_by_kind_without_falling_back_from_one_kind_to_the_other() -> None:
    figures = {"losses/policy_loss": 0.5, "generation/value_loss": 0.25, "generation/kl_ref": math.nan}
    assert last_update(figures) == {"candidates": {"policy_loss": 0.5}, "generation": {"value_loss": 0.25}}
    assert last_update({"version": 1.0}) == {}
