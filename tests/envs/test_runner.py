"""The client runner and `ppoz play`: environments played through a real broker and actor, episodes and segments counted."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py

from client import Client
from common.segments import Segment
from envs.runner import Runner, environment_names, make_env_factory
from tests import processes
from tests.conftest import RunningActor, RunningBroker
from tests.helpers import actors_ready, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
APP = dict(screens=5, links_per_screen=2, external_links=1, horizon=4)


@pytest.fixture
def served(
    start_broker: Callable[..., RunningBroker], start_actor: Callable[..., RunningActor], make_client: Callable[..., Client]
) -> tuple[RunningBroker, Client]:
    """A broker with one uniform-policy actor attached, and a client to ask it for its status."""
    broker = start_broker()
    start_actor(broker.backend)
    client = make_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the actor to attach")
    return broker, client


def segments(redis_client: redis_py.Redis, key_prefix: str) -> list[dict[str, Any]]:
    return [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{key_prefix}:segments")]


def free_endpoint() -> str:
    """A loopback endpoint nothing listens on."""
    return f"tcp://127.0.0.1:{processes.free_port()}"


def test_runner_plays_every_client_to_max_episodes(
    served: tuple[RunningBroker, Client], redis_client: redis_py.Redis, key_prefix: str
) -> None:
    broker, client = served
    horizon = APP["horizon"]
    # 24 steps of 3 clients against a broker and actor of this process: under 1 s alone; the run's 60 s bound is x60,
    # and each request's 20 s deadline far more
    runner = Runner(broker.frontend, make_env_factory("kea", seed=3, **APP), clients=3, deadline=20, max_episodes=2)
    stats = runner.run_for(60)
    assert not runner.running()
    assert (stats["episodes"], stats["steps"], stats["failures"]) == (6, 6 * horizon, 0)
    assert stats["policy_version"] == 0 and stats["elapsed_s"] < 60  # it stopped because every client was done
    episodes = runner.stats.episodes
    assert Counter(e.client for e in episodes) == {0: 2, 1: 2, 2: 2}
    assert all(e.steps == horizon for e in episodes)
    status = client.status()
    assert status["counters"]["broker/feedbacks"] == 6 * horizon
    assert status["sessions"] == 0  # every client detached at the end

    segs = segments(redis_client, key_prefix)
    assert len(segs) == 6  # one per episode: a horizon of 4 is below the broker's segment length
    assert Counter(s.task_id for s in segs) == Counter({task: 2 for task in {s.task_id for s in segs}})
    assert len({s.task_id for s in segs}) == 3
    returns = Counter(round(e.ret, 6) for e in episodes)
    assert Counter(round(sum(t.reward for t in s.transitions), 6) for s in segs) == returns
    for s in segs:
        assert (s.reason, s.done, s.truncated, len(s.transitions)) == ("truncated", False, True, horizon)
        steps = s.transitions
        assert [(t.truncated, t.done) for t in steps] == [(False, False)] * (horizon - 1) + [(True, False)]
        assert "Visited pages: MainActivity\nHistory of actions:\nCurrent page: MainActivity" in steps[0].obs.prompt
        assert all(0 <= t.action < len(t.obs.action) for t in steps)
        next_obs = s.next_obs.to_wire()  # the state the time limit cut off, for the learner to bootstrap from
        assert set(next_obs) == {"prompt", "question", "action"}
        assert next_obs["prompt"].count("\n- ") == horizon  # one history line per step taken

    # Replaying the recorded actions in a fresh simulator gives the recorded observations and rewards.
    for s in segs:
        env = make_env_factory("kea", seed=3, **APP)(0)
        obs = env.reset()
        for t in s.transitions:
            assert t.obs.prompt == obs["prompt"] and t.obs.action == obs["action"]
            result = env.step(t.action)
            assert result.reward == t.reward
            obs = result.obs
        assert obs == s.next_obs.to_wire()


def test_gym_episodes_end_done(served: tuple[RunningBroker, Client], redis_client: redis_py.Redis, key_prefix: str) -> None:
    broker, _ = served
    runner = Runner(broker.frontend, make_env_factory("frozenlake"), clients=2, deadline=20, max_episodes=4)  # as above
    stats = runner.run_for(60)
    assert (stats["episodes"], stats["failures"]) == (8, 0)
    segs = segments(redis_client, key_prefix)
    assert sum(len(s.transitions) for s in segs) == stats["steps"]
    assert len(segs) == 8
    done = [s for s in segs if s.done]
    assert done, "random moves on FrozenLake fall into a hole well within 20 steps"
    for s in segs:
        last = s.transitions[-1]
        if s.done:  # a hole or the goal: nothing to bootstrap from
            assert (s.reason, s.truncated, s.next_obs, last.done) == ("done", False, None, True)
            assert last.reward in (0.0, 1.0)
        else:  # 20 steps without either
            assert (s.reason, s.truncated, len(s.transitions), last.truncated) == ("truncated", True, 20, True)
            assert s.next_obs.action == ["move left", "move down", "move right", "move up"]
    assert sorted(e.ret for e in runner.stats.episodes) == sorted(sum(t.reward for t in s.transitions) for s in segs)


def test_make_env_factory_names_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="'pong'") as excinfo:
        make_env_factory("pong")
    assert all(name in str(excinfo.value) for name in environment_names())
    assert "kea" in environment_names()
    with pytest.raises((ValueError, TypeError), match="bogus"):
        make_env_factory("kea", bogus=1)
    with pytest.raises((ValueError, TypeError), match="bogus"):
        make_env_factory("frozenlake", bogus=1)
    with pytest.raises(ValueError, match="horizon"):
        make_env_factory("kea", horizon=0)
    factory = make_env_factory("kea", seed=4, horizon=3)
    first, second = factory(0), factory(1)
    assert first is not second and first.reset() == second.reset()  # one app for the whole farm


def test_runner_needs_a_client() -> None:
    with pytest.raises(ValueError, match="clients=0"):
        Runner("tcp://127.0.0.1:1", make_env_factory("frozenlake"), clients=0)


def test_runner_without_a_broker_counts_failures_and_stops() -> None:
    runner = Runner(free_endpoint(), make_env_factory("frozenlake"), clients=2, deadline=0.3, max_episodes=1)
    started = time.monotonic()
    stats = runner.run_for(1.5)  # the run's length and the requests' deadline are under test; nothing answers
    elapsed = time.monotonic() - started
    assert not runner.running()
    # the run's length plus at most one request's deadline (1.8 s), and 2.2 s for a loaded machine's late wake-ups
    assert 1.4 < elapsed < 4.0, elapsed
    assert (stats["episodes"], stats["steps"]) == (0, 0)
    # Each client's attach timed out at least once, and it kept trying. A count in a time window, but of timers, which
    # load does not stretch: about 5 failures a client in 1.5 s of 0.3 s deadlines, where 2 in all are asked for
    assert stats["failures"] >= 2
    assert math.isnan(stats["mean_return"])


# -- ppoz play -------------------------------------------------------------------------------------------------------


def ppoz(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`ppoz ARGS` from the repository (tests/processes.py's `ppoz`, whose default timeout says why)."""
    return processes.ppoz(*args, timeout=timeout, cwd=REPO_ROOT)


def test_play_prints_one_json_object(served: tuple[RunningBroker, Client]) -> None:
    broker, client = served
    # ends after its 4 episodes and 20 random ones: 2-5 s alone, bounded by --seconds 60, below the 120 s timeout; x24
    done = ppoz(
        "play",
        "--env",
        "frozenlake",
        "--clients",
        "2",
        "--episodes",
        "2",
        "--json",
        "--random-baseline",
        "20",
        "--seconds",
        "60",
        "--broker",
        broker.frontend,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # the whole of stdout: one object and nothing else
    assert (report["episodes"], report["failures"], report["env"]) == (4, 0, "frozenlake")
    assert 0.0 <= report["random_mean_return"] <= 1.0 and 0.0 <= report["mean_return"] <= 1.0
    assert client.status()["counters"]["broker/feedbacks"] == report["steps"] > 0


def test_play_refuses_bad_input_with_exit_code_2() -> None:
    done = ppoz("play", "--env-option", "nonsense", "--broker", "tcp://127.0.0.1:1", timeout=60)  # a refusal at start: 1-3 s alone; x20
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "'nonsense'" in done.stderr and done.stdout == ""


def play_here(*args: str) -> int:
    """`ppoz play ARGS` in this process, in a thread (so it installs no signal handlers), bounded in time
    (so that input it should refuse but accepts ends the run quickly rather than hanging the suite)."""
    from ppoz.cli import build_parser

    parsed = build_parser().parse_args(["play", "--seconds", "0.5", "--deadline", "0.3", "--broker", free_endpoint(), *args])
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(parsed.func(parsed)))
    thread.start()
    thread.join(20)  # --seconds 0.5 and a request's 0.3 s deadline: under 1 s alone; x20
    assert not thread.is_alive() and len(codes) == 1
    return codes[0]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--env-option", "nonsense"], "'nonsense'"),
        (["--env", "pong"], "'pong'"),
        (["--env-option", "tarpits=no"], "tarpits='no'"),
        (["--env", "taxi", "--env-option", "max_steps=0"], "max_steps"),
        (["--clients", "0"], "--clients"),
    ],
)
def test_play_names_the_bad_input(args: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The same checks in this process (each one a subprocess would cost seconds of imports)."""
    assert play_here(*args) == 2
    out, err = capsys.readouterr()
    assert named in err and out == ""


def test_play_json_without_episodes_is_still_json(capsys: pytest.CaptureFixture[str]) -> None:
    """No broker, so no episode and no mean return: null, not NaN, which JSON parsers refuse."""
    assert play_here("--env", "frozenlake", "--clients", "1", "--json", "--random-baseline", "5") == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON report"))
    assert (report["episodes"], report["mean_return"], report["recent_mean_return"]) == (0, None, None)
    assert report["failures"] >= 1 and isinstance(report["random_mean_return"], float)
