"""`ppoz bench stability`: does generation PPO learn and then stay learned, through the real stack, at a given
policy learning rate?

The say-the-word task (tests/test_generation_end_to_end.py's): a prompt names one of six colours ("say the word
blue") and the reward is 1 when the response's first word is that colour. A tiny random Llama with the `words`
tokenizer (20 tokens: chance is about 1 in 20) and a rank-4 LoRA adapter (its head and final norm trained beside
it) is served by `ppoz up` (Redis, the broker, one actor and the learner, each its own process), and `--clients`
client threads generate and send feedback over the real protocol until `--responses` responses are rewarded.
The actor keeps serving while the learner trains, so samples are a few versions stale (the figures show the lag).

Each leg is a learning rate (`--lr`, 0: the learner's default for the model); runs alternate the legs' order,
`--repeats` runs each. Per run, the reward over windows of 150 responses gives:

- learned_at: responses until the first window at 0.9 or more (None: never);
- peak: the best window;
- tail_mean, tail_min: the mean and the worst window of the run's last quarter;
- fall: the largest drop of a window below the best window before it (what a policy that learned and then
  lost it shows; 0 for one that only climbs).

A learning rate that learns fast but then falls back is what this bench is for: the figures of a short run
cannot tell it from a stable one.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.learner_figures import Chart, Latest
from ppoz.flags import add_json_flag, add_repeats_flag
from tools.bench import load_at_start, printed_as_json

COLOURS = ["red", "green", "blue", "yellow", "black", "white"]
WINDOW = 150  # responses per reward window
LEARNED = 0.9  # a window at or above it: learned


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lr",
        default="1e-3,5e-4,0",
        help="comma-separated policy learning rates, one leg each; 0: the default by the model (default: 1e-3,5e-4,0)",
    )
    parser.add_argument("--responses", type=int, default=8000, help="rewarded responses per run (default: 8000)")
    add_repeats_flag(parser, "runs per leg, legs alternating (default: 3)")
    parser.add_argument("--clients", type=int, default=8, help="client threads (default: 8)")
    parser.add_argument("--run-timeout-s", type=float, default=900, help="give up on a run after this long (default: 900)")
    add_json_flag(parser, "print one JSON object")


def learning_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"ppoz bench stability: --lr must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not (0 <= r < 1) for r in rates):
        raise SystemExit(f"ppoz bench stability: every --lr must be in [0, 1), got {text!r}")
    return rates


def leg_order(legs: list[float], repeats: int) -> list[float]:
    """Every leg once per repeat, the order reversed every other repeat."""
    return [leg for r in range(repeats) for leg in (legs if r % 2 == 0 else legs[::-1])]


def figures(rewards: list[float]) -> dict[str, Any]:
    """The run's figures from its rewards in the order they came (module docstring)."""
    windows = [statistics.mean(rewards[i : i + WINDOW]) for i in range(0, len(rewards) - WINDOW + 1, WINDOW)]
    if not windows:
        return {"windows": [], "learned_at": None, "peak": None, "tail_mean": None, "tail_min": None, "fall": None}
    tail = windows[-max(1, len(windows) // 4) :]
    learned = next((i for i, w in enumerate(windows) if w >= LEARNED), None)
    best, fall = windows[0], 0.0
    for w in windows:
        best = max(best, w)
        fall = max(fall, best - w)
    return {
        "windows": [round(w, 3) for w in windows],
        "learned_at": None if learned is None else (learned + 1) * WINDOW,
        "peak": max(windows),
        "tail_mean": statistics.mean(tail),
        "tail_min": min(tail),
        "fall": fall,
    }


ROLLOUT_BATCH = 32  # transitions per update: what is left in the stream below it waits for more


def _status(front: str) -> dict[str, Any] | None:
    from client import Client, PPOZError

    try:
        with Client(front, deadline=2, attempt_timeout=2) as c:
            return c.status()
    except PPOZError:
        return None


def stack_config(model: str | Path, front: str, back: str, weights: str, workdir: Path, lr: float = 0.0) -> str:
    """The stack this task runs on (the bench's and tests/test_generation_end_to_end.py's): one-step episodes in
    segments of 1, rollouts of 32, a small token critic, one actor; `lr` 0 is the learner's default for the model.
    The supervisor stops the stack when a process fails, rather than restarting it: a run with a restart in it
    would be reported as if nothing had happened."""
    return (
        f'[policy]\nmodel = "{model}"\nlora_rank = 4\n'
        f'[broker]\nfrontend = "{front}"\nbackend = "{back}"\nsegment_len = 1\nheartbeat_ms = 200\n'
        f'[learner]\nweights_bind = "{weights}"\nrollout_batch = {ROLLOUT_BATCH}\npolicy_minibatch = 16\npolicy_lr = {lr!r}\n'
        f'checkpoint_dir = "{workdir / "ckpt"}"\ntensorboard_dir = ""\n'
        "[generation]\nvalue_hidden = [64]\n"
        "[actor]\nweights_poll_s = 1.0\nheartbeat_ms = 200\n"
        '[up]\nactors = 1\nstop_timeout_s = 60\non_failure = "stop"\n'
    )


def prompt_and_reward(rng: random.Random) -> tuple[str, Callable[[str], float]]:
    """One turn of the task: the prompt, and the reward of a response to it (1 when its first word is the colour)."""
    colour = rng.choice(COLOURS)
    return f"say the word {colour}", lambda text: float(text.split()[:1] == [colour])


def run(model: Path, lr: float, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One run of the stack at policy learning rate `lr`: its figures, and the learner's policy lag averaged over
    the updates seen (its status read every second; each update's own mean lag). The stack is `ppoz up`'s own
    (`started_stack`), its components' output in the run's up.log."""
    from client import Client
    from common.config import load
    from ppoz.ports import free_port
    from ppoz.up import UpConfig
    from tools.harness import watched_stack

    front, back, weights = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    config = workdir / "stack.toml"
    config.write_text(stack_config(model, front, back, weights, workdir, lr))
    log_path = workdir / "up.log"
    rewards: list[float] = []
    lags: dict[int, float] = {}  # update -> that update's mean policy lag
    lock = threading.Lock()
    errors: list[BaseException] = []
    end = time.monotonic() + args.run_timeout_s

    def play(i: int) -> None:
        rng = random.Random(i)
        try:
            with Client(front, deadline=120, attempt_timeout=60) as client:
                task = client.attach()
                while len(rewards) < args.responses and time.monotonic() < end and not errors:
                    prompt, reward_of = prompt_and_reward(rng)
                    client.wait_turn(task)
                    reply = client.generate(task, prompt, max_new_tokens=2)
                    reward = reward_of(reply["text"])
                    client.feedback(task, reward, done=True)
                    with lock:
                        rewards.append(reward)
        except BaseException as e:  # noqa: BLE001 - reported after the run
            errors.append(e)

    def record(status: dict[str, Any] | None) -> dict[str, Any]:
        learner = ((status or {}).get("learner")) or {}
        if learner.get(Latest.UPDATES) and learner.get(Chart.POLICY_LAG.key) is not None:
            lags[int(learner[Latest.UPDATES])] = float(learner[Chart.POLICY_LAG.key])
        return learner

    failed = ""
    with log_path.open("w") as log, watched_stack(load(UpConfig, str(config)), str(config), "info", output=log) as stack:
        supervisor = stack.supervisor
        while not ((s := _status(front)) and s["actors"]):
            if supervisor.failed or time.monotonic() > end:
                raise SystemExit(f"ppoz bench stability: the stack did not start; see {log_path}")
            time.sleep(0.5)
        threads = [threading.Thread(target=play, args=(i,), daemon=True) for i in range(args.clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and time.monotonic() < end + 5 and not supervisor.failed:
            record(_status(front))
            time.sleep(1.0)
        elapsed = time.monotonic() - started
        timed_out = time.monotonic() >= end
        # The learner trains what the clients sent before the figures are read, so its updates and lags cover the
        # whole run however far it trailed the clients (on a busy machine, by hundreds of responses).
        learner: dict[str, Any] = {}
        drained = False
        while not timed_out and not errors and not supervisor.failed:
            status = _status(front)
            learner = record(status)
            if status is not None and status["stream_length"] < ROLLOUT_BATCH:
                drained = True
                break
            timed_out = time.monotonic() >= end
            time.sleep(1.0)
        failed = supervisor.failed
    # What went wrong first: the stack, then the deadline, then a client (whose error may follow from either).
    if failed:
        raise SystemExit(f"ppoz bench stability: the stack's {failed} failed during the run; see {log_path}")
    if timed_out and len(rewards) < args.responses:
        raise SystemExit(f"ppoz bench stability: {len(rewards)} of {args.responses} responses in {args.run_timeout_s:g} s; see {log_path}")
    if errors:
        raise SystemExit(f"ppoz bench stability: a client failed: {errors[0]!r}; see {log_path}")
    if len(rewards) < args.responses:  # the clients ended early without an error: not expected, still refused
        raise SystemExit(f"ppoz bench stability: the clients stopped at {len(rewards)} of {args.responses} responses; see {log_path}")
    if not drained:
        raise SystemExit(f"ppoz bench stability: the learner had not trained the responses within {args.run_timeout_s:g} s; see {log_path}")
    return {
        "lr": lr,
        "responses": len(rewards),
        "seconds": round(elapsed, 1),
        **figures(rewards[: args.responses]),
        "updates": learner.get(Latest.UPDATES),
        "mean_policy_lag": statistics.mean(lags.values()) if lags else None,
        "lag_samples": len(lags),
        "resolved_lr": _resolved_lr(log_path),
    }


def _resolved_lr(log: Path) -> str | None:
    """The learner's own line naming the learning rate it trains at ("policy learning rate 0.0005 (...)")."""
    for line in log.read_text(errors="replace").splitlines():
        if "policy learning rate" in line:
            return line.split("policy learning rate", 1)[1].strip()
    return None


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    legs: dict[str, Any] = {}
    for lr in dict.fromkeys(r["lr"] for r in runs):
        mine = [r for r in runs if r["lr"] == lr]
        trained_at = (mine[0]["resolved_lr"] or "?").split()[0]  # what the learner said it trains at
        legs[repr(lr)] = {
            "label": f"{lr:g}" if lr else f"0 ({trained_at})",
            "runs": len(mine),
            "learned": sum(r["learned_at"] is not None for r in mine),
            **{f"median_{key}": _median([r[key] for r in mine]) for key in ("learned_at", "peak", "tail_mean", "tail_min", "fall")},
        }
    return legs


def main(args: argparse.Namespace) -> int:
    from models.tiny_models import build_tiny_model

    rates = learning_rates(args.lr)
    for name in ("responses", "repeats", "clients"):
        if getattr(args, name) < 1:
            raise SystemExit(f"ppoz bench stability: --{name} must be positive, got {getattr(args, name)}")
    if not (math.isfinite(args.run_timeout_s) and args.run_timeout_s > 0):
        raise SystemExit(f"ppoz bench stability: --run-timeout-s must be a positive number of seconds, got {args.run_timeout_s}")
    if args.responses < 4 * WINDOW:
        raise SystemExit(f"ppoz bench stability: --responses must be at least {4 * WINDOW} (four windows), got {args.responses}")
    load = load_at_start("stability")
    root = Path(tempfile.mkdtemp(prefix="ppoz-bench-stability-"))
    runs = []
    order = leg_order(rates, args.repeats)
    try:
        model = build_tiny_model(root / "model", arch="llama", tokenizer="words")
        for n, lr in enumerate(order, 1):
            workdir = root / f"run-{n}"
            workdir.mkdir()
            result = run(model, lr, args, workdir)
            runs.append(result)
            lag = result["mean_policy_lag"]
            print(
                f"run {n}/{len(order)} lr {lr:g} ({result['resolved_lr']}): learned at {result['learned_at']}, peak {result['peak']:.2f},"
                f" tail mean {result['tail_mean']:.2f} min {result['tail_min']:.2f}, fall {result['fall']:.2f},"
                f" mean policy lag {'-' if lag is None else f'{lag:.2f}'}, {result['seconds']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    except BaseException:
        print(f"ppoz bench stability: the runs' logs are kept in {root}", file=sys.stderr)
        raise
    shutil.rmtree(root, ignore_errors=True)
    out = {
        "bench": "stability",
        "machine": f"{platform.node()} ({os.cpu_count()} cores), {platform.platform()}",
        "load_at_start": load,
        "responses": args.responses,
        "clients": args.clients,
        "window": WINDOW,
        "legs": summarise(runs),
        "runs": runs,
    }
    if printed_as_json(args, out):
        return 0

    def fmt(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    print(f"{'lr':>14} {'learned':>8} {'learned at':>11} {'peak':>6} {'tail mean':>10} {'tail min':>9} {'fall':>6}")
    for leg in out["legs"].values():
        print(
            f"{leg['label']:>14} {leg['learned']:>4}/{leg['runs']:<3} {fmt(leg['median_learned_at'], '.0f'):>11}"
            f" {fmt(leg['median_peak']):>6}"
            f" {fmt(leg['median_tail_mean']):>10} {fmt(leg['median_tail_min']):>9} {fmt(leg['median_fall']):>6}"
        )
    print(f"medians of {args.repeats} runs each; {args.responses} responses a run, windows of {WINDOW}")
    return 0
