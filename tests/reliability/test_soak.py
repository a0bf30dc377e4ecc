"""The soak as users run it (`ppoz soak`), on the CI budget: 200 emulators for one minute against real processes."""

from __future__ import annotations

import json

import pytest

from tests.processes import ppoz
from tools.reliability.soak import ProcessLogs, Report, Window, format_report, percentile, summarise


@pytest.mark.slow
@pytest.mark.timeout(1260)  # past the soak's timeout below, so its output is shown
def test_soak_200_clients_one_minute_no_errors_bounded_memory_ledger_balanced(tmp_path):
    # The soak's start, its minute, the ledger settled and its stop: 116 s alone on the 2-core VM, 210 s beside two
    # spinners (bin/test --busy 2), which the suite's 300 s per-test timeout barely covered. 1,200 s: x10.
    # Its latency drift is the soak's figure (docs/reliability.md), not this test's: beside two spinners and another
    # worker's tests the second half's p99 once came out 2.02x the first's (limit 2), the steps per 15 s falling from
    # 2,373 to 469 as that worker's load rose. `inf` turns the rule off here; test_the_pass_rule_names_each_failure
    # keeps it tested.
    soak = ["soak", "--clients", "200", "--minutes", "1", "--window-s", "15", "--latency-drift", "inf"]
    run = ppoz(*soak, "--json", "--keep", str(tmp_path), timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["failures"] == []
    assert report["error_count"] == 0
    assert report["ledger_balanced"], report["ledger"]
    # What it served and how fast is the soak's report (docs/reliability.md), not this test's: a count per unit of
    # time fails on a busy machine. Here: it stepped, every step was acknowledged, and it reported its four windows.
    assert report["steps"] > 0 and report["acknowledged"] == report["steps"]
    assert len(report["windows"]) == 4
    assert set(report["rss_growth_mb"]) == {"broker", "actor", "learner", "redis"}
    assert set(report["latency_ratio"]) == {"p50", "p99"} and all(ratio > 0 for ratio in report["latency_ratio"].values())
    for name in ("broker", "actor", "learner"):
        assert (tmp_path / f"{name}.log").exists()


def report_with(**changes) -> Report:
    report = Report(
        clients=2,
        seconds=60,
        steps=10,
        acknowledged=10,
        ledger="balanced",
        ledger_balanced=True,
        rss_growth_mb={"broker": 5.0},
        latency_ratio={"p50": 1.0, "p99": 1.2},
        limits={"rss_growth_mb": 100.0, "latency_drift": 2.0},
    )
    for key, value in changes.items():
        setattr(report, key, value)
    return report


def test_the_pass_rule_names_each_failure():
    assert report_with().failures() == []
    assert "client errors" in report_with(error_count=3, errors=["Timeout: x"]).failures()[0]
    assert "ledger not balanced" in report_with(ledger_balanced=False).failures()[0]
    assert "broker resident memory grew by 150 MB" in report_with(rss_growth_mb={"broker": 150.0}).failures()[0]
    assert "p99 of the second half is 2.50x" in report_with(latency_ratio={"p50": 1.0, "p99": 2.5}).failures()[0]
    assert "no step" in report_with(steps=0).failures()[0]
    assert "FAIL" in format_report(report_with(steps=0)) and "PASS" in format_report(report_with())


def test_memory_growth_and_latency_drift_leave_out_the_first_window():
    report = Report(clients=1, seconds=40, limits={"rss_growth_mb": 100.0, "latency_drift": 2.0})
    # The learner's warm-up lasts until its third update (optimizer state, backward buffers, full rollouts): here the second window.
    report.windows = [
        Window(10, 5, 0, 0, 1, 1, 1, {"broker": 100.0, "learner": 500.0}, learner_version=2),
        Window(20, 5, 0, 0, 1, 1, 1, {"broker": 150.0, "learner": 700.0}, learner_version=3),
        Window(30, 5, 0, 0, 1, 1, 1, {"broker": 160.0, "learner": 710.0}, learner_version=3),
        Window(40, 5, 0, 0, 1, 1, 1, {"broker": 170.0, "learner": 730.0}, learner_version=5),
    ]
    # Warm-up latencies (first 10 s) are slow and ignored; after it, 25-40 s is twice 10-25 s.
    latencies = [(t, 500.0) for t in range(10)] + [(t, 10.0) for t in range(10, 25)] + [(t, 20.0) for t in range(25, 40)]
    summarise(report, latencies)
    assert report.rss_growth_mb == {"broker": 70.0, "learner": 30.0}  # from the end of each one's warm-up to the end
    assert report.latency_ratio == {"p50": 2.0, "p99": 2.0}
    # A learner that never updated is measured from the first window: its growth is not hidden.
    for window in report.windows:
        window.learner_version = 0
    report.rss_growth_mb = {}
    summarise(report, latencies)
    assert report.rss_growth_mb["learner"] == 230.0


def test_percentile():
    assert percentile([], 0.5) != percentile([], 0.5)  # nan
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile(list(range(100)), 0.99) == 99


def test_the_stacks_output_goes_to_a_log_file_per_process_named_as_the_report_names_it(tmp_path):
    with ProcessLogs(tmp_path) as logs:  # the supervisor's lines: the component's name, right-aligned, then " | "
        print(f"{'actor-0':>8} | loaded the model", file=logs, flush=True)
        print(f"{'learner':>8} | update 1 | loss 0.5", file=logs, flush=True)
    assert (tmp_path / "actor.log").read_text() == "loaded the model\n"
    assert (tmp_path / "learner.log").read_text() == "update 1 | loss 0.5\n"
    assert (tmp_path / "broker.log").read_text() == ""  # a quiet process's file is there too
