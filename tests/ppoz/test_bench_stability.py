"""`ppoz bench stability`: its figures from hand-written rewards, its leg order, its refusals, and one small real run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.processes import ppoz, start_ppoz
from tools.bench.stability import WINDOW, figures, leg_order


def rewards_of(windows: list[float]) -> list[float]:
    """Rewards whose windows of WINDOW have these means (each window: that share of ones, then zeros)."""
    out: list[float] = []
    for w in windows:
        ones = round(w * WINDOW)
        out += [1.0] * ones + [0.0] * (WINDOW - ones)
    return out


def test_a_policy_that_learns_and_falls_back_shows_its_fall():
    f = figures(rewards_of([0.1, 0.5, 0.92, 0.98, 0.6, 0.7, 0.8, 0.5]))
    assert f["learned_at"] == 3 * WINDOW  # the third window is the first at 0.9 or more
    assert f["peak"] == pytest.approx(0.98, abs=1e-9)
    assert f["tail_mean"] == pytest.approx(0.65, abs=1e-9) and f["tail_min"] == pytest.approx(0.5, abs=1e-9)  # the last quarter: 2 windows
    assert f["fall"] == pytest.approx(0.48, abs=1e-9)  # 0.98 down to 0.5


def test_a_policy_that_only_climbs_has_no_fall_and_one_that_never_learns_no_learned_at():
    climbing = figures(rewards_of([0.1, 0.3, 0.6, 0.9, 0.95, 0.96, 0.97, 1.0]))
    assert climbing["fall"] == 0 and climbing["learned_at"] == 4 * WINDOW
    flat = figures(rewards_of([0.1, 0.2, 0.1, 0.2]) + [1.0] * (WINDOW - 1))  # a last partial window is left out
    assert flat["learned_at"] is None and len(flat["windows"]) == 4 and flat["fall"] == pytest.approx(0.1, abs=1e-9)


def test_legs_alternate_their_order_every_repeat():
    assert leg_order([1e-3, 5e-4, 0.0], 3) == [1e-3, 5e-4, 0.0, 0.0, 5e-4, 1e-3, 1e-3, 5e-4, 0.0]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--lr", "fast"], "--lr"),
        (["--lr", "2"], "--lr"),
        (["--responses", "100"], "--responses"),
        (["--repeats", "0"], "--repeats"),
        (["--run-timeout-s", "nan"], "--run-timeout-s"),
    ],
)
def test_bad_flags_are_refused_by_name_before_anything_starts(flags, named):
    result = ppoz("bench", "stability", *flags, timeout=60)  # refused at start: 2-3 s under load; x20
    assert result.returncode != 0 and named in result.stderr, result.stderr[-1000:]
    assert "load average" not in result.stderr  # refused before the bench began


@pytest.mark.slow
@pytest.mark.timeout(660)  # past the bench's own subprocess timeout, so its stderr is shown
def test_a_small_run_reports_a_leg_with_the_learning_rate_the_learner_used(tmp_path: Path) -> None:
    # On a busy machine the learner trailed the clients and this run reported 3 updates for 600 responses. Here the
    # learner is held back on purpose (stopped for its first 20 s, as a loaded machine can starve it): the bench
    # waits for it to train what the clients sent before it reads its figures, so their count no longer depends on
    # how fast the learner went (600 responses, 18 rollouts of 32).
    command = ("bench", "stability", "--lr", "0", "--responses", "600", "--repeats", "1", "--json")
    bench = start_ppoz(*command, log=tmp_path / "bench.log", stdout=subprocess.PIPE)
    learner = None
    try:
        learner = wait_for(lambda: _descendant(bench.pid, " learner "), timeout=120, what="the bench's learner process")  # 8 s alone
        os.kill(learner, signal.SIGSTOP)
        time.sleep(20)  # the clients go on meanwhile: about 30 responses a second on the 2-core VM
        os.kill(learner, signal.SIGCONT)
        # the stack's start, 600 responses, the learner's 20 s stop and its catching up, the stop: 60-70 s alone; x9
        stdout, _ = bench.communicate(timeout=600)
    finally:
        if learner is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(learner, signal.SIGCONT)  # never left stopped; its stack dies with the bench (PDEATHSIG)
        if bench.poll() is None:
            bench.kill()
            bench.wait(30)
    result = subprocess.CompletedProcess(bench.args, bench.returncode, stdout, (tmp_path / "bench.log").read_text())
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    (run,) = out["runs"]
    assert run["responses"] >= 600 and len(run["windows"]) == 4 and run["updates"] >= 17
    assert run["resolved_lr"].startswith("0.0003")  # 0: the learner's default for a tiny model with LoRA
    assert out["legs"]["0.0"]["runs"] == 1 and out["legs"]["0.0"]["label"] == "0 (0.0003)"
    assert run["lag_samples"] >= 1 and run["mean_policy_lag"] >= 0  # the lag, read while the run went on


def _descendant(pid: int, word: str) -> int | None:
    """A process below `pid` whose command line holds `word` (read from /proc), or None."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            if word in (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                return child
        except OSError:
            pass
        todo += children.get(child, [])
    return None
