"""`ppoz bench train`'s pure parts: the tasks, the legs' order, the medians, the ratio, reading a leg's output,
a process tree's memory. No test here installs trl or runs a leg (each takes minutes of CPU)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tools.bench.ppoz_vs_trl import LegRun, add_arguments, first_time_at, last_json, leg_order, ratio, summarise, tree_rss_kb
from tools.bench.train_tasks import TASKS, repeat_score, say, train_repeat_rows, val_repeat_rows
from tools.bench.trl_env import pins


def run(samples: int, seconds: float, val_after: float | None = 0.5, first: float | None = None, cpu: float = 20.0) -> LegRun:
    return LegRun(samples, 10 * samples, seconds, 0.04, val_after, first, wall_s=10.0, cpu_s=cpu, peak_rss_mb=400.0, peak_tree_mb=900.0)


def test_legs_alternate_each_repeat_reversed():
    assert leg_order(["ppoz", "trl"], 3) == ["ppoz", "trl", "trl", "ppoz", "ppoz", "trl"]
    assert leg_order(["trl"], 2) == ["trl", "trl"]


def test_summary_is_medians_with_min_and_max():
    figures = summarise([run(100, 10.0, 0.2, cpu=10.0), run(300, 10.0, 0.8, first=40.0), run(200, 10.0, None, first=20.0)])
    assert figures["responses_per_s"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert figures["tokens_per_s"] == {"median": 200.0, "min": 100.0, "max": 300.0}
    assert figures["val_after"] == {"median": 0.5, "min": 0.2, "max": 0.8}  # the run without a validation is left out
    assert figures["first_at_target_s"] == {"median": 30.0, "min": 20.0, "max": 40.0} and figures["reached_target"] == 2
    assert figures["cores"]["min"] == 1.0 and figures["cores"]["max"] == 2.0
    assert summarise([run(10, 1.0)])["first_at_target_s"] is None


def test_ratio_of_the_median_rates_needs_both_legs():
    result = {"ppoz": summarise([run(300, 10.0)]), "trl": summarise([run(100, 10.0), run(50, 10.0), run(150, 10.0)])}
    assert ratio(result) == pytest.approx(3.0)
    assert ratio({"ppoz": result["ppoz"]}) is None


def test_a_legs_summary_is_its_last_json_line_and_its_first_time_at_the_target_from_its_validations():
    lines = ["ppoz train: 10 responses", '{"samples": 1}', "  learner | {not json", '{"samples": 2, "seconds": 1.0}', "bye"]
    assert last_json(lines) == {"samples": 2, "seconds": 1.0}
    assert last_json(["no summary"]) is None
    validations = [[5.0, 0.1], [10.0, 0.69], [15.0, 0.7], [20.0, 0.9]]
    assert first_time_at(validations, 0.7) == 15.0
    assert first_time_at(validations[:2], 0.7) is None
    assert first_time_at(validations, None) is None  # a throughput-only task has no target


def test_the_long_task_asks_for_answers_of_16_to_255_words_and_holds_its_validation_lengths_out():
    assert say(130) == "one three zero" and say(16) == "one six"
    train, val = train_repeat_rows(), val_repeat_rows()
    lengths = {len(r["ground_truth"].split()) for r in train}
    assert min(lengths) == 16 and max(lengths) == 255 and len(lengths) == len(train) == 216
    assert {len(r["ground_truth"].split()) for r in val}.isdisjoint(lengths) and len(val) == 24
    row = train[0]
    assert row["prompt"] == "say seven one six times" and row["ground_truth"] == " ".join(["seven"] * 16)
    assert TASKS["long"].max_new_tokens == 256 and TASKS["real-shape"].train_rows == TASKS["long"].train_rows


def test_the_long_tasks_reward_by_hand():
    answer = " ".join(["seven"] * 4)
    assert repeat_score("repeat_words", "seven seven seven seven", answer) == 1.0
    assert repeat_score("repeat_words", "seven seven", answer) == 0.5  # short: 2 of 4
    assert repeat_score("repeat_words", "seven one seven seven", answer) == 0.75  # a wrong word in the middle
    assert repeat_score("repeat_words", "seven " * 8, answer) == 0.5  # 8 right words past an answer of 4: 4 / 8
    assert repeat_score("repeat_words", "", answer) == 0.0
    assert repeat_score("repeat_words", "one two three", answer) == 0.0


def test_a_process_trees_memory_counts_every_descendant():
    hold = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(60)"
    parent = f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {hold!r}]).pid, flush=True); exec({hold!r})"
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    child = int(process.stdout.readline())
    try:
        # both touch 200 MB: the tree is over 400 MB once both have, which neither does alone
        wait_for(lambda: tree_rss_kb(process.pid) > 400 * 1024, timeout=60, what="two processes of 200 MB each")
        assert tree_rss_kb(child) < 300 * 1024 < tree_rss_kb(process.pid) < 1000 * 1024  # the tree, not one process or the machine
    finally:
        for pid in (child, process.pid):
            os.kill(pid, signal.SIGKILL)
        process.wait()
    wait_for(lambda: tree_rss_kb(process.pid) == 0, what="the reaped parent to count nothing")


def test_the_trl_environment_is_pinned_to_this_ones_packages():
    lines = pins().splitlines()
    assert any(line.lower().startswith("torch==") for line in lines)
    assert any(line.lower().startswith("transformers==") for line in lines)
    assert not any(line.lower().startswith("ppoz==") for line in lines)


def test_options_and_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.tasks, args.seconds, args.repeats, args.legs, args.trl_threads, args.json) == (
        "demo,long,real-shape",
        0.0,
        3,
        "ppoz,trl",
        0,
        False,
    )
    assert (args.val_every_s, args.device, args.trl_python) == (15.0, "auto", "")
    assert parser.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "tpu"])


def test_a_trl_python_without_trl_is_refused_by_name(capsys) -> None:
    """--trl-python is used as it is: one that cannot import trl stops the bench before any leg runs."""
    from tools.bench.ppoz_vs_trl import main

    args = argparse.Namespace(
        tasks="demo", legs="ppoz,trl", repeats=1, seconds=0.0, trl_threads=0, val_every_s=15.0, trl_python=sys.executable, device="cpu"
    )
    args.trl_venv, args.json = "unused", True
    with pytest.raises(SystemExit, match="does not import trl"):
        main(args)


def validated_after_an_update(progress: Path) -> bool:
    """A progress row of the leg holds a validation taken after the learner's first update."""
    if not progress.exists():
        return False
    rows = [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]
    return any(row.get("val_reward") is not None and (row.get("version") or 0) >= 1 for row in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_ppoz_leg_trains_the_long_task_and_validates_while_it_trains(tmp_path) -> None:
    # The leg's budget counts from before its stack starts, and on a busy machine the start alone can take it
    # all: the test gives a budget it never reaches, waits for the event (a validation after an update), then
    # stops the leg as Ctrl-C would, which still prints the summary.
    command = [sys.executable, "-m", "tools.bench.train_leg", "--task", "long", "--seconds", "800", "--val-every-s", "3", "--out", "run"]
    command += ["--max-stream-backlog", "64", "--report-every", "1"]
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as leg:
        try:
            # 10-20 s of start and an update every second or two here; 600 s is x20 of it
            wait_for(
                lambda: validated_after_an_update(tmp_path / "run" / "train" / "progress.jsonl") or leg.poll() is not None,
                timeout=600,
                what="a validation after the learner's first update",
            )
            leg.send_signal(signal.SIGTERM)
            out, err = leg.communicate(timeout=180)
        finally:
            leg.kill()
    assert leg.returncode == 0, out[-3000:] + err[-3000:]
    summary = last_json(out.splitlines())
    assert summary is not None, out[-3000:]
    assert summary["samples"] > 0 and summary["response_tokens"] >= summary["samples"] and summary["learner"]["version"] >= 1
    assert summary["val_records"] == 24 and summary["records"] == 216 and summary["stopped"] is True
    assert "max_stream_backlog = 64\n" in (tmp_path / "run" / "stack.toml").read_text()
    assert summary["validations"] and all(0.0 <= v <= 1.0 for _, v in summary["validations"])
    # the learner's loop profiled, up to its last update: the bench shows it per leg
    cycle = summary["learner_cycle"]
    assert set(cycle) == {"read", "idle", "prepare", "update", "checkpoint", "publish", "other"}, cycle
    assert cycle["update"] > 0 and all(seconds >= 0 for seconds in cycle.values()), cycle


def test_the_decode_profile_runs_the_engine_and_generate_on_a_task(tmp_path) -> None:
    """The diagnostic behind docs/benchmarks.md's GPU profile: both engines' passes are timed (40 steps, so
    that the second pass runs its profiled steps 20 to 30)."""
    command = [sys.executable, "-m", "tools.bench.decode_profile", "--tasks", "long", "--new-tokens", "40", "--device", "cpu"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    timed = [line for line in done.stdout.splitlines() if line.startswith("long, ")]
    assert len(timed) == 6, done.stdout[-3000:]  # 2 cache settings x 2 passes, generate twice
    assert "Self CPU time total" in done.stdout


def test_the_learners_loop_is_shown_as_median_shares_of_the_runs_that_profiled_it():
    profiled = [run(100, 10.0), run(100, 10.0), run(100, 10.0), run(100, 10.0)]
    profiled[0].cycle = {"idle": 6.0, "update": 3.0, "read": 1.0}  # 60% idle, 30% update, 10% read
    profiled[1].cycle = {"idle": 2.0, "update": 6.0, "read": 2.0}  # 20%, 60%, 20%
    profiled[2].cycle = {"idle": 1.0, "update": 1.0, "read": 2.0}  # 25%, 25%, 50%
    # profiled[3] has none (a trl run, or a learner that never updated): left out, not counted as zeros
    assert profiled[0].cycle_shares == {"idle": 0.6, "update": 0.3, "read": 0.1}
    figures = summarise(profiled)
    assert figures["learner_cycle_shares"] == {"idle": 0.25, "update": 0.3, "read": 0.2}
    assert profiled[1].figures()["learner_cycle_shares"] == {"idle": 0.2, "update": 0.6, "read": 0.2}
    assert "learner_cycle_shares" not in summarise([run(10, 1.0)]) and "learner_cycle_shares" not in run(10, 1.0).figures()
