"""`ppoz status`: the broker's figures as a table (or as JSON): actors and their load, sessions, speed, the
stream's backlog, the learner's policy version and its last update's figures, its counters, the broker's own.

It imports neither torch nor the learner: the learner's figures come from the broker's status, which reads
them from Redis (common/learner_figures.py, which names them all, by kind of policy too).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def main(args: argparse.Namespace) -> int:
    from client import Client, PPOZError

    try:
        with Client(
            args.broker,
            deadline=args.timeout,
            attempt_timeout=args.timeout,
            curve_secret_key=args.curve_secret_key or None,
            curve_server_key=args.curve_server_key or None,
        ) as c:
            status = c.status()
    except PPOZError as e:
        print(f"ppoz status: no answer from {args.broker}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a missing or bad CURVE key file (common.security.KeyFileError)
        print(f"ppoz status: {e}", file=sys.stderr)
        return 2
    for key in ("proto", "v", "op", "rid", "status"):
        status.pop(key, None)
    if args.json:
        print(json.dumps(status, sort_keys=True))
        return 0
    print_table(args.broker, status)
    return 0


def print_table(broker: str, status: dict[str, Any]) -> None:
    from common.learner_figures import Latest

    learner = status.get("learner") or {}
    newest = int(learner.get(Latest.VERSION, 0)) if learner else None
    print(f"broker {broker}  up {status['uptime_s']:.0f} s" + ("" if status.get("storage_ok", True) else "  REDIS DOWN"))
    print(
        f"  sessions {status['sessions']}  pending steps {status['pending_steps']}  queued {status['queued_jobs']}"
        f"  steps/s {status.get('steps_per_s', 0.0):.1f}  stream backlog {status.get('stream_transitions', status['stream_length'])}"
        f" transitions (limit {status.get('stream_backlog_limit') or 'none'})"
    )
    print(f"  actors ({len(status['actors'])}):")
    for a in status["actors"]:
        lag = f"  lag {newest - a['policy_version']}" if newest is not None else ""
        print(f"    {a['name']:<24} load {a['inflight']}/{a['credits']}  policy v{a['policy_version']}{lag}  served {a['served']}")
    if learner:
        print(f"  learner: policy v{newest} after {int(learner.get(Latest.UPDATES, 0))} updates; last update: {last_update(learner)}")
        print_counters(learner)
    else:
        print("  learner: no update yet")
    latency = status.get("added_latency") or {}
    if latency.get("n"):
        print(
            f"  added latency over {latency['n']} replies: p50 {latency['p50_ms']:.1f} ms  p99 {latency['p99_ms']:.1f} ms"
            f"  max {latency['max_ms']:.1f} ms"
        )
    nonzero = {key: value for key, value in status["counters"].items() if value}
    print(f"  counters ({len(status['counters']) - len(nonzero)} at zero not shown; --json shows all):")
    for key, value in sorted(nonzero.items()):
        print(f"    {key:<36} {value}")
    if status.get("limits"):
        print("  limits: " + "  ".join(f"{key} {value}" for key, value in sorted(status["limits"].items())))


def last_update(learner: dict[str, float]) -> str:
    """The last update's figures as the learner names them (policy_loss, value_loss, entropy, approx_kl, kl_ref,
    clipfrac), for either kind of policy; a learner that trained both kinds has them labelled by kind."""
    from common import learner_figures

    kinds = learner_figures.last_update(learner)
    shown = {kind: "  ".join(f"{name} {value:.4g}" for name, value in figures.items()) for kind, figures in kinds.items()}
    if len(shown) == 1:
        return next(iter(shown.values()))
    return "; ".join(f"{kind}: {text}" for kind, text in shown.items())


def print_counters(learner: dict[str, float]) -> None:
    from common import learner_figures
    from common.learner_figures import LearnerCounter as C

    counters = learner_figures.counters(learner)
    if not counters:
        return
    prefix = learner_figures.MISMATCHED_PREFIX
    why = ", ".join(f"{k.removeprefix(prefix)} {v}" for k, v in sorted(counters.items()) if k.startswith(prefix) and v)
    print(
        f"  transitions: stored {counters.get(C.TRANSITIONS_STORED, 0)}, trained {counters.get(C.TRANSITIONS_TRAINED, 0)}, "
        f"dropped stale {counters.get(C.DROPPED_STALE, 0)}, truncated {counters.get(C.DROPPED_TRUNCATED, 0)}"
        + (f" (next_obs unscorable: {counters[C.DROPPED_UNSCORABLE_NEXT_OBS]})" if counters.get(C.DROPPED_UNSCORABLE_NEXT_OBS) else "")
        + f", mismatched {counters.get(C.DROPPED_MISMATCHED, 0)}"
        + (f" ({why})" if why else "")
        + f", non-finite {counters.get(C.DROPPED_NONFINITE, 0)}"
        + (f" (updates discarded: {counters[C.DISCARDED_UPDATES]})" if counters.get(C.DISCARDED_UPDATES) else "")
    )
