"""`ppoz bench pace`: clients that never ask, stepping faster than the learner trains, against a default stack.

A Kea farm's emulators (the Kea fork's PPOAPI calls: attach, step, feedback with rewards of 20-110, `done` never sent,
never `ask`) step as fast as the actor answers, and the learner cannot train that fast. Before issue 55 the broker's
back-pressure reached only clients that ask, so the stream filled with transitions the learner then dropped as older
than its lag bound: 89% of them with 4 emulators. Here `--clients` clients (half of them through `ppoz gateway`'s
PPOAPI routes with `requests`, as the Kea fork calls them; half with the protocol's own `step`, no `ask` either) play
the Kea-like simulator (envs/kea_sim.py) against `ppoz up` with its defaults (broker, learner, one actor; the demo's
tiny model), until the learner has applied `--updates` updates. Two legs, alternating for `--repeats` rounds, each a
fresh stack: `after`, the broker's defaults, and `before`, the broker as it was before issue 55 (step_hold_share 0:
no step held; segment_max_versions 0: segments close by length alone). Each reports: steps answered and the slowest
against its deadline, errors, updates, the learner's transitions stored, trained and dropped as stale, and the
broker's held steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_DEADLINE_S = 30.0  # the broker's request_timeout_ms: a step's deadline when its client names none
LEGS = {"after": "", "before": "step_hold_share = 0\nsegment_max_versions = 0\n"}  # [broker] lines of each leg


@dataclass
class Tally:
    """What the clients saw, shared by their threads (list appends and counter adds under one lock)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    seconds: list[float] = field(default_factory=list)  # each answered step's wait, as its client saw it
    errors: list[str] = field(default_factory=list)

    def answered(self, seconds: float) -> None:
        with self.lock:
            self.seconds.append(seconds)

    def failed(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


def kea_reward(sim_reward: float) -> float:
    """The simulator's reward (1 a new screen, 0 a seen one, -0.5 out of the app, -0.3 killing it) on the Kea fork's
    scale: 50 base, 110 for a new screen, 20 out of the foreground."""
    return 50.0 + 60.0 * sim_reward


def _play(step: Any, feedback: Any, seed: int, stop: threading.Event, tally: Tally) -> None:
    """One emulator's loop on its own simulated app session: step, act, feedback, never `done` (an episode's end resets
    the simulator, as Kea restarts the app, and the trajectory goes on)."""
    from envs.kea_sim import KeaSim, demo_app

    env = KeaSim(demo_app(seed=0))
    obs = env.reset(seed=seed)
    while not stop.is_set():
        started = time.monotonic()
        try:
            action = step({"prompt": obs["prompt"], "action": obs["action"]})  # the fork's obs: no question
        except Exception as e:  # noqa: BLE001 - counted and reported; the emulator goes on as Kea would
            tally.failed(f"step: {type(e).__name__}: {e}"[:300])
            stop.wait(1.0)
            continue
        tally.answered(time.monotonic() - started)
        result = env.step(action)
        try:
            feedback(kea_reward(result.reward))
        except Exception as e:  # noqa: BLE001
            tally.failed(f"feedback: {type(e).__name__}: {e}"[:300])
        obs = env.reset(seed=seed + int(started * 1000) % 100_000) if result.terminated or result.truncated else result.obs


def ppoapi_emulator(base: str, seed: int, stop: threading.Event, tally: Tally) -> None:
    """The Kea fork's calls through the gateway, with `requests`: attach, then step and feedback."""
    import requests

    with requests.Session() as http:
        task = http.post(f"{base}/attach", json={}, timeout=STEP_DEADLINE_S * 2).json()["task_id"]

        def step(obs: dict[str, Any]) -> int:
            reply = http.post(f"{base}/step", json={"task_id": task, "obs": obs}, timeout=STEP_DEADLINE_S * 2)
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            return int(reply.json()["action"])

        def feedback(reward: float) -> None:
            reply = http.post(f"{base}/feedback", json={"task_id": task, "reward": reward, "done": False}, timeout=STEP_DEADLINE_S * 2)
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")

        _play(step, feedback, seed, stop, tally)


def protocol_emulator(broker: str, seed: int, stop: threading.Event, tally: Tally) -> None:
    """The protocol's own client: attach, then step and feedback, never `ask`."""
    from client import Client

    with Client(broker, deadline=STEP_DEADLINE_S * 2) as client:
        task = client.attach()
        _play(
            lambda obs: int(client.step(task, obs)["action"]),
            lambda reward: client.feedback(task, reward, done=False),
            seed,
            stop,
            tally,
        )


def leg(name: str, clients: int, updates: int, max_seconds: float, learner: str = "", broker: str = "") -> dict[str, Any]:
    """One fresh stack with the broker of leg `name` (LEGS), `clients` emulators until `updates` updates (or
    `max_seconds`): what the clients saw and what the learner kept. `learner`, `broker`: TOML lines for those tables
    (`--rollout-batch` and the like), added to the leg's own."""
    from client import Client
    from gateway.config import GatewayConfig
    from gateway.server import Gateway
    from models.tiny_models import build_tiny_model
    from ppoz.ports import free_port
    from ppoz.up import UpConfig
    from tools.harness import wait_for_actor, watched_stack

    model = build_tiny_model(Path.home() / ".cache" / "ppoz" / "tiny-llama", "llama", hidden=64, layers=2)  # the demo's
    with tempfile.TemporaryDirectory(prefix="ppoz-bench-pace-") as tmp:
        front, back, weights = free_port(), free_port(), free_port()
        config = Path(tmp) / "pace.toml"
        config.write_text(
            f'[policy]\nmodel = "{model}"\n'
            f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\n{LEGS[name]}{broker}'
            f'[actor]\nbroker = "tcp://127.0.0.1:{back}"\nweights = "tcp://127.0.0.1:{weights}"\n'
            f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\ncheckpoint_dir = "{tmp}/ckpt"\ntensorboard_dir = ""\n' + learner
        )
        with open(Path(tmp) / "stack.log", "w") as log, watched_stack(UpConfig(actors=1), str(config), "info", output=log) as stack:
            if not wait_for_actor(stack, timeout=600):
                raise RuntimeError(f"no actor registered within 600 s: {(Path(tmp) / 'stack.log').read_text()[-2000:]}")
            _wait_for_the_learners_limit(stack.client_broker, timeout=600)
            gateway = Gateway(GatewayConfig(port=0, broker=stack.client_broker)).start()
            serving = threading.Thread(target=gateway.serve, daemon=True)
            serving.start()
            stop, tally = threading.Event(), Tally()
            base = f"http://127.0.0.1:{gateway.port}"
            threads = [
                threading.Thread(
                    target=ppoapi_emulator if i % 2 == 0 else protocol_emulator,
                    args=(base if i % 2 == 0 else stack.client_broker, i, stop, tally),
                    daemon=True,
                )
                for i in range(clients)
            ]
            started = time.monotonic()
            for t in threads:
                t.start()
            status: dict[str, Any] = {}
            with Client(stack.client_broker, deadline=30.0) as probe:
                while time.monotonic() - started < max_seconds and not stack.supervisor.failed:
                    time.sleep(1.0)
                    status = probe.status()
                    if int(status.get("learner", {}).get("updates", 0) or 0) >= updates:
                        break
                stop.set()
                for t in threads:
                    t.join(STEP_DEADLINE_S * 2 + 10)
                status = probe.status()
            gateway.stop()
            serving.join(10)
    return _figures(name, clients, time.monotonic() - started, tally, status)


def _wait_for_the_learners_limit(broker: str, timeout: float) -> None:
    """Until the broker follows the backlog limit the learner publishes at its start. The actor can register long
    before (the learner loads its model, a reference copy and an optimizer; on a busy machine, tens of seconds), and
    clients started in between step unchecked: what they send then is trained late or dropped as stale, which is the
    start's cost, not the steady pace this bench measures (the suite's test, run beside other tests before this wait,
    failed once with 986 steps in 76 s against 178 in 39 s alone; likely this, not shown)."""
    from client import Client

    deadline = time.monotonic() + timeout
    with Client(broker, deadline=30.0) as probe:
        while not probe.status().get("stream_backlog_limit"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the learner published no backlog limit within {timeout:.0f} s")
            time.sleep(0.2)


def _figures(name: str, clients: int, seconds: float, tally: Tally, status: dict[str, Any]) -> dict[str, Any]:
    from common import learner_figures
    from common.learner_figures import LearnerCounter as C

    learner = status.get("learner", {})
    counters = learner_figures.counters(learner)
    broker = status.get("counters", {})
    stored, stale = counters.get(C.TRANSITIONS_STORED, 0), counters.get(C.DROPPED_STALE, 0)
    waits = sorted(tally.seconds)
    return {
        "leg": name,
        "clients": clients,
        "seconds": round(seconds, 1),
        "steps": len(waits),
        "step_s_median": round(statistics.median(waits), 3) if waits else None,
        "step_s_max": round(waits[-1], 2) if waits else None,
        "deadline_s": STEP_DEADLINE_S,
        "errors": len(tally.errors),
        "first_error": tally.errors[0] if tally.errors else "",
        "updates": int(learner.get("updates", 0) or 0),
        "stored": stored,
        "trained": counters.get(C.TRANSITIONS_TRAINED, 0),
        "dropped_stale": stale,
        "stale_share": round(stale / stored, 4) if stored else None,
        "steps_held": broker.get("broker/steps_held", 0),
        "steps_held_out": broker.get("broker/steps_held_out", 0),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", default="4", help="comma-separated emulator counts, one leg set each (default %(default)s)")
    parser.add_argument("--legs", default="after,before", help="after (the defaults), before (as before issue 55), or both (default)")
    parser.add_argument("--updates", type=int, default=8, help="a leg ends once the learner has applied this many updates (default: 8)")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="a leg ends after this long, whatever the updates (default: 900)")
    parser.add_argument("--rollout-batch", type=int, default=0, help="[learner] rollout_batch (default: the learner's, 64)")
    parser.add_argument("--max-policy-lag", type=int, default=0, help="[learner] max_policy_lag (default: the learner's, 8)")
    parser.add_argument("--segment-len", type=int, default=0, help="[broker] segment_len (default: the broker's, 32)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of legs, alternating (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def main(args: argparse.Namespace) -> int:
    import logging
    import sys

    try:
        counts = [int(c) for c in args.clients.split(",") if c]
    except ValueError:
        counts = []
    names = [n for n in args.legs.split(",") if n]
    if not counts or min(counts) < 1 or not names or not set(names) <= set(LEGS) or args.updates < 1 or args.repeats < 1:
        print(
            f"ppoz bench pace: --clients takes counts from 1 (such as 4,16), --legs {' and '.join(LEGS)}, --updates and"
            f" --repeats from 1 (got --clients {args.clients!r}, --legs {args.legs!r})",
            file=sys.stderr,
        )
        return 2
    logging.getLogger("gateway").setLevel(logging.WARNING)
    legs = []
    for round_ in range(args.repeats):
        for clients in counts:
            for name in names if round_ % 2 == 0 else reversed(names):  # alternating: neither always goes first
                result = leg(name, clients, args.updates, args.max_seconds, *_settings(args))
                legs.append(result)
                if not args.json:
                    print(_line(result), flush=True)
    if args.json:
        print(json.dumps({"legs": legs}))
    return 0


def _settings(args: argparse.Namespace) -> tuple[str, str]:
    """The [learner] and the [broker] lines of the flags given (their defaults are the components' own)."""
    learner = {"rollout_batch": args.rollout_batch, "policy_minibatch": args.rollout_batch, "max_policy_lag": args.max_policy_lag}
    lines = "".join(f"{key} = {value}\n" for key, value in learner.items() if value)
    return lines, f"segment_len = {args.segment_len}\n" if args.segment_len else ""


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['leg']:>6}, {r['clients']:>3} clients: {r['steps']} steps in {r['seconds']} s "
        f"(median {r['step_s_median']} s, slowest {r['step_s_max']} s of {r['deadline_s']:g}), {r['errors']} errors; "
        f"{r['updates']} updates, stored {r['stored']}, trained {r['trained']}, dropped stale {r['dropped_stale']} "
        f"({100 * (r['stale_share'] or 0):.1f}%); held {r['steps_held']}, held out {r['steps_held_out']}"
    )
