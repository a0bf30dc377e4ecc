"""Play N environment clients in parallel against a broker, and count what happens.

Each client is a thread with its own protocol client, task and environment: the
loop a Kea emulator runs (ask, step, act, feedback), with episodes. An episode
that ends by the environment's time limit is fed back `truncated` with the next
observation, so the learner bootstraps from it; one that terminates is `done`.
A request that fails past its deadline costs the episode, not the run: the
client attaches again and starts a new one (and counts the failure).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from client import Client, PPOZError
from envs.base import EnvFactory, InvalidAction, TextEnv

log = logging.getLogger(__name__)


def environment_names() -> list[str]:
    from envs.gym_text import GYM_ENVS

    return ["kea", *GYM_ENVS]


def make_env_factory(name: str, seed: int = 0, **options: Any) -> EnvFactory:
    """`name` -> a factory of per-client instances (`kea` or a gymnasium adapter); options go to the env."""
    if name not in environment_names():  # name them all: the gym adapters' own error would leave out `kea`
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(environment_names())}")
    if name == "kea":
        from envs.kea_sim import KeaSim, SimConfig

        cfg = SimConfig(seed=seed, **options)  # one app for the whole farm, as when testing one app
        return lambda client: KeaSim(cfg)
    from envs.gym_text import make_gym_env

    make_gym_env(name, **options)  # fail now, naming the bad name or option, not inside a thread
    return lambda client: make_gym_env(name, **options)


@dataclass(frozen=True)
class Episode:
    client: int
    ret: float
    steps: int
    policy_version: int  # the newest version that chose one of its actions
    ended_at: float  # time.monotonic()


@dataclass
class RunStats:
    """Counters the client threads update; read them with `snapshot()`."""

    window: int = 100  # episodes in the moving mean
    started_at: float = field(default_factory=time.monotonic)
    steps: int = 0
    failures: int = 0
    episodes: list[Episode] = field(default_factory=list)
    recent: deque[float] = field(default_factory=deque)
    policy_version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count_step(self, policy_version: int) -> None:
        with self.lock:
            self.steps += 1
            self.policy_version = max(self.policy_version, policy_version)

    def count_episode(self, episode: Episode) -> None:
        with self.lock:
            self.episodes.append(episode)
            self.recent.append(episode.ret)
            while len(self.recent) > self.window:
                self.recent.popleft()

    def count_failure(self) -> None:
        with self.lock:
            self.failures += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            elapsed = time.monotonic() - self.started_at
            returns = [e.ret for e in self.episodes]
            last_fifth = returns[len(returns) - len(returns) // 5 :] if len(returns) >= 5 else []
            return {
                "elapsed_s": elapsed,
                "steps": self.steps,
                "steps_per_s": self.steps / elapsed if elapsed > 0 else 0.0,
                "episodes": len(self.episodes),
                "mean_return": sum(returns) / len(returns) if returns else float("nan"),
                "recent_mean_return": sum(self.recent) / len(self.recent) if self.recent else float("nan"),
                "recent_episodes": len(self.recent),
                # the learning figure docs/benchmarks.md quotes: the last fifth of the episodes, with its standard error
                "last_fifth_mean_return": mean_and_stderr(last_fifth)[0],
                "last_fifth_stderr": mean_and_stderr(last_fifth)[1],
                "last_fifth_episodes": len(last_fifth),
                "policy_version": self.policy_version,
                "failures": self.failures,
            }


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (NaN for no values; 0 error for one)."""
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, (var / len(values)) ** 0.5


def play(
    client: Client, env: TextEnv, stats: RunStats, stop: threading.Event, index: int = 0, max_episodes: int | None = None, seed: int = 0
) -> None:
    """One client's loop until `stop` is set or it has played `max_episodes`."""
    played = 0
    task = None
    while not stop.is_set() and (max_episodes is None or played < max_episodes):
        try:
            if task is None:
                task = client.attach()
            _episode(client, task, env, stats, stop, index, seed + 1000 * index + played)
            played += 1
        except PPOZError as e:
            # The broker restarted past its session TTL, or a deadline passed: this episode
            # is lost (the broker closes its segment as truncated); start a new one.
            log.warning("client %d: %s; attaching again", index, e)
            stats.count_failure()
            task = None
            stop.wait(0.5)
        except InvalidAction as e:  # the server answered with an index the observation does not have
            log.error("client %d: %s; starting a new episode", index, e)
            stats.count_failure()
    if task is not None:
        try:
            client.detach(task)
        except PPOZError as e:
            log.warning("client %d: detach failed: %s", index, e)


def _episode(client: Client, task: str, env: TextEnv, stats: RunStats, stop: threading.Event, index: int, seed: int) -> None:
    obs = env.reset(seed=seed)
    total, steps, version = 0.0, 0, 0
    while not stop.is_set():
        answer = client.ask(task)
        if answer.get("status") == "wait":
            stop.wait(answer.get("retry_after_ms", 100) / 1000)
            continue
        reply = client.step(task, obs)
        version = max(version, int(reply.get("policy_version", 0)))
        result = env.step(int(reply["action"]))
        cut_off = result.truncated and not result.terminated
        # A time limit: the learner bootstraps from the state it cut off.
        client.feedback(task, result.reward, done=result.terminated, truncated=cut_off, next_obs=result.obs if cut_off else None)
        stats.count_step(version)
        total += result.reward
        steps += 1
        obs = result.obs
        if result.terminated or result.truncated:
            stats.count_episode(Episode(index, total, steps, version, time.monotonic()))
            return


class Runner:
    """N client threads playing `make_env` environments against the broker at `endpoint`."""

    def __init__(
        self,
        endpoint: str,
        make_env: EnvFactory,
        clients: int,
        deadline: float = 60.0,
        max_episodes: int | None = None,
        seed: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        if clients < 1:
            raise ValueError(f"clients={clients}: need at least one")
        self.endpoint = endpoint
        self.make_env = make_env
        self.clients = clients
        self.deadline = deadline
        self.max_episodes = max_episodes
        self.seed = seed
        self.context = context
        self.stats = RunStats()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> Runner:
        self.stats.started_at = time.monotonic()
        for i in range(self.clients):
            env = self.make_env(i)
            t = threading.Thread(target=self._run_client, args=(i, env), name=f"client-{i}", daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _run_client(self, index: int, env: TextEnv) -> None:
        with Client(self.endpoint, deadline=self.deadline, context=self.context) as client:
            play(client, env, self.stats, self.stop_event, index, self.max_episodes, self.seed)

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every client to finish its current request, detach and exit; wait up to `timeout` s in all."""
        self.stop_event.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        return not self.running()

    def run_for(self, seconds: float, report: Callable[[dict[str, Any]], None] | None = None, every: float = 5.0) -> dict[str, Any]:
        """Play for `seconds` (or until every client has played max_episodes), calling `report` every `every` s."""
        self.start()
        end = time.monotonic() + seconds
        next_report = time.monotonic() + every
        while self.running() and time.monotonic() < end:
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
            if report is not None and time.monotonic() >= next_report:
                report(self.stats.snapshot())
                next_report += every
        self.stop()
        return self.stats.snapshot()
