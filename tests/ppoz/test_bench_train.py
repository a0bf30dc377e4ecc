"""`ppoz bench train`'s pure parts: the legs' order, the medians, the ratio, reading a leg's output.
No test here installs trl or runs a leg (each takes minutes of CPU)."""

from __future__ import annotations

import argparse

import pytest

from ppoz.bench.train import LegRun, add_arguments, first_time_at, last_json, leg_order, pins, ratio, summarise


def run(samples: int, seconds: float, val_after: float | None = 0.5, first: float | None = None, cpu: float = 20.0) -> LegRun:
    return LegRun(samples, seconds, 0.04, val_after, first, wall_s=10.0, cpu_s=cpu, peak_rss_mb=400.0)


def test_legs_alternate_each_repeat_reversed():
    assert leg_order(["ppoz", "trl"], 3) == ["ppoz", "trl", "trl", "ppoz", "ppoz", "trl"]
    assert leg_order(["trl"], 2) == ["trl", "trl"]


def test_summary_is_medians_with_min_and_max():
    figures = summarise([run(100, 10.0, 0.2, cpu=10.0), run(300, 10.0, 0.8, first=40.0), run(200, 10.0, None, first=20.0)])
    assert figures["responses_per_s"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert figures["val_after"] == {"median": 0.5, "min": 0.2, "max": 0.8}  # the run without a validation is left out
    assert figures["first_at_0.7_s"] == {"median": 30.0, "min": 20.0, "max": 40.0} and figures["reached_target"] == 2
    assert figures["cores"]["min"] == 1.0 and figures["cores"]["max"] == 2.0
    assert summarise([run(10, 1.0)])["first_at_0.7_s"] is None


def test_ratio_of_the_median_rates_needs_both_legs():
    result = {"ppoz": summarise([run(300, 10.0)]), "trl": summarise([run(100, 10.0), run(50, 10.0), run(150, 10.0)])}
    assert ratio(result) == pytest.approx(3.0)
    assert ratio({"ppoz": result["ppoz"]}) is None


def test_a_legs_summary_is_its_last_json_line_and_ppoz_first_time_is_from_its_progress_rows():
    lines = ["ppoz train: 10 responses", '{"samples": 1}', "  learner | {not json", '{"samples": 2, "seconds": 1.0}', "bye"]
    assert last_json(lines) == {"samples": 2, "seconds": 1.0}
    assert last_json(["no summary"]) is None
    rows = [{"time": 5.0, "reward_mean": None}, {"time": 10.0, "reward_mean": 0.69}, {"time": 15.0, "reward_mean": 0.7}]
    assert first_time_at(rows) == 15.0
    assert first_time_at(rows[:2]) is None


def test_the_trl_environment_is_pinned_to_this_ones_packages():
    lines = pins().splitlines()
    assert any(line.lower().startswith("torch==") for line in lines)
    assert any(line.lower().startswith("transformers==") for line in lines)
    assert not any(line.lower().startswith("ppoz==") for line in lines)


def test_options_and_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.seconds, args.repeats, args.legs, args.trl_threads, args.json) == (306.0, 3, "ppoz,trl", 0, False)
