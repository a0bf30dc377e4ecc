"""`ppoz play`: environment clients against a running broker, with a report.

N clients (threads, one task each) play one environment (the Kea-like
simulator or a gymnasium adapter) through the real protocol; every few
seconds and at the end it prints episodes, mean return and steps per second.
`--random-baseline N` first plays N episodes locally with the uniformly random
policy, so the figure to beat is printed beside the policy's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading
from typing import Any

from ppoz.flags import add_broker_flag, add_json_flag, add_seed_flag

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default="kea", help="kea (the app simulator), frozenlake, cliffwalking or taxi (default: kea)")
    parser.add_argument(
        "--env-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment option, e.g. horizon=16 or is_slippery=true; repeatable",
    )
    add_broker_flag(parser)
    parser.add_argument("--clients", type=int, default=4, help="clients played in parallel (default: 4)")
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default: 0, until Ctrl-C or SIGTERM)")
    parser.add_argument("--episodes", type=int, default=0, help="episodes per client, then stop (default: 0, no limit)")
    add_seed_flag(parser, "the simulator's app layout and the episodes' seeds (default: 0)")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds one request may take, retries included (default: 60)")
    parser.add_argument("--report-every", type=float, default=5.0, help="seconds between progress lines (default: 5)")
    parser.add_argument(
        "--random-baseline",
        type=int,
        default=0,
        metavar="N",
        help="first play N episodes locally with the uniformly random policy and report their mean return",
    )
    add_json_flag(parser, "print the final report as one JSON object")


def parse_options(items: list[str]) -> dict[str, Any]:
    """`["horizon=16", "is_slippery=true"]` -> `{"horizon": 16, "is_slippery": True}` (JSON values, else strings)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env-option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


def main(args: argparse.Namespace) -> int:
    from envs.base import random_returns
    from envs.runner import Runner, make_env_factory, mean_and_stderr

    if args.clients < 1 or args.seconds < 0 or args.episodes < 0:
        print("ppoz play: --clients must be at least 1, --seconds and --episodes 0 or more", file=sys.stderr)
        return 2
    try:
        make_env = make_env_factory(args.env, args.seed, **parse_options(args.env_option))
    except (ValueError, TypeError) as e:
        print(f"ppoz play: {e}", file=sys.stderr)
        return 2
    say = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the one JSON object only
    baseline = baseline_stderr = None
    if args.random_baseline:
        baseline, baseline_stderr = mean_and_stderr(random_returns(make_env, args.random_baseline, seed=args.seed))
        if not args.json:  # with --json, stdout is the one JSON object, which carries the baseline too
            print(
                f"random policy: mean return {baseline:.3f} ± {baseline_stderr:.3f} over {args.random_baseline} episodes (played locally)",
                file=say,
                flush=True,
            )
    print(f"playing {args.env} with {args.clients} clients against {args.broker}", file=say, flush=True)
    runner = Runner(args.broker, make_env, args.clients, deadline=args.deadline, max_episodes=args.episodes or None, seed=args.seed)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: runner.stop_event.set())

    def report(s: dict[str, Any]) -> None:
        print(
            f"{s['elapsed_s']:6.0f} s  steps {s['steps']:7d}  {s['steps_per_s']:6.1f} steps/s  episodes {s['episodes']:5d}  "
            f"mean return (last {s['recent_episodes']}) {s['recent_mean_return']:8.3f}  policy v{s['policy_version']}"
            f"  failures {s['failures']}",
            flush=True,
        )

    seconds = args.seconds or float("inf")
    final = runner.run_for(seconds, None if args.json else report, every=args.report_every)
    final["env"] = args.env
    if baseline is not None:
        final["random_mean_return"] = baseline
        final["random_stderr"] = baseline_stderr
    if args.json:
        # No episode yet means a mean of NaN, which JSON has no word for (jq and JSON.parse refuse it): null.
        print(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in final.items()}, sort_keys=True))
    else:
        report(final)
        print(
            f"last fifth of the episodes ({final['last_fifth_episodes']}): mean return "
            f"{final['last_fifth_mean_return']:.3f} ± {final['last_fifth_stderr']:.3f}",
            flush=True,
        )
    return 0
