"""`ppoz train`: generation-mode PPO on a prompt dataset, on this machine or against a farm.

Without `--broker` it starts a stack here as `ppoz up` does (embedded Redis, broker, actors, learner;
`[up]` says how many, the config file's tables configure them, `--model` sets `[policy] model` for
actors and learner) and drives it; with `--broker` it drives an existing farm's broker (the learner's
figures come from `--redis-url`, the farm's Redis, if given). The drivers, rewards and validation: train/run.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import add_flags, load, read_toml
from common.options import ADVANTAGE_ESTIMATORS

if TYPE_CHECKING:
    from rewards.group import GroupAdvantage

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from train.config import TrainConfig

    parser.add_argument("--config", metavar="FILE", help="TOML config file: [train], and the stack's tables; flags override it")
    parser.add_argument("--model", default="", help="the policy model directory (sets [policy] model for the actors and the learner)")
    parser.add_argument("--broker", default="", help="drive this farm's broker (its client endpoint) instead of starting a stack here")
    parser.add_argument("--key-prefix", default="ppoz", help="with --broker: the farm's Redis key prefix (default: ppoz)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")
    parser.add_argument("--redis-url", default="", help="with --broker: the farm's Redis, for the learner's figures in the progress line")
    parser.add_argument(
        "--advantage",
        choices=ADVANTAGE_ESTIMATORS,
        help="gae: a critic and GAE (default); grpo: critic-free, each response against the other rollout_n responses to its"
        " prompt, scaled by their std; rloo: critic-free, each against the mean of the others; grpo and rloo take the KL in the"
        " loss (k3). Sets [generation] advantage for the learner started here; with --broker the"
        " farm's learner needs the same in its [generation] table (docs/train.md)",
    )
    add_flags(parser, TrainConfig)  # the stack's own settings ([up], [learner], ...) come from the config file


def main(args: argparse.Namespace) -> int:
    from train.config import TrainConfig
    from train.data import DatasetError
    from train.driver import ValidationError
    from train.run import run_training

    cfg = load(TrainConfig, args.config, args)
    if not cfg.data:
        raise SystemExit("ppoz train: no training prompts; give --data FILE (or [train] data)")
    grouping, learner_flags = advantage_settings(args.config, args.advantage)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("%s received: the drivers finish their turns and the run stops", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if args.broker:
            summary = run_training(cfg, args.broker, _figures(args.redis_url, args.key_prefix), stop, grouping=grouping)
        else:
            summary = on_this_machine(args, cfg, stop, grouping, learner_flags)
    except (DatasetError, ValueError, ValidationError) as e:
        print(f"ppoz train: {e}", file=sys.stderr)
        return 2
    return finish(cfg, summary, args.json, learner_started_here=not args.broker)


def advantage_settings(config_file: str | None, advantage: str | None) -> tuple[GroupAdvantage | None, list[str]]:
    """From the [generation] table (and --advantage over it): the drivers' grouping (None: they send rewards,
    for GAE) and the `ppoz learner` flags that carry --advantage to a learner started here. The learner's
    settings are validated now, before anything starts."""
    from learner_node.config import GenerationConfig
    from rewards.group import GroupAdvantage

    table = read_toml(config_file).get("generation", {}) if config_file else {}
    given: dict[str, Any] = {}
    if advantage:
        given["advantage"] = advantage
        if advantage != "gae":  # GRPO's KL penalty is in the loss, as k3 (Shao et al. 2024), unless the file says otherwise
            given.update({k: v for k, v in (("kl_in_reward", False), ("kl_estimator", "k3")) if k not in table})
    gen = load(GenerationConfig, config_file, given)
    learner_flags: list[str] = []
    for key, value in given.items():  # `ppoz learner` names [generation]'s flags --gen-KEY (--no-gen-KEY for false)
        flag = "gen-" + key.replace("_", "-")
        learner_flags += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    grouping = GroupAdvantage(gen.advantage, gen.grpo_scale_by_std) if gen.advantage != "gae" else None
    return grouping, learner_flags


def finish(cfg: Any, summary: dict[str, Any], as_json: bool, learner_started_here: bool = False) -> int:
    """The reward curve, the closing line, and the summary as JSON (last) if asked. Not 0 when every driver
    worker stopped, or when the learner this run started applied no update: a run that trained nothing
    must not look like one that did."""
    summary["curve"] = str(_curve(cfg, summary))
    line = f"ppoz train: {summary['samples']} responses, reward curve in {summary['curve']}"
    if "val_after" in summary:
        line += f"; validation reward {summary['val_before']:.3f} before, {summary['val_after']:.3f} after"
    print(line, flush=True)
    stopped = summary.get("stopped_workers") or []
    if stopped:
        print(f"ppoz train: {len(stopped)} of {cfg.workers} driver workers stopped; first: {stopped[0]}", file=sys.stderr)
    untrained = learner_started_here and summary["samples"] > 0 and (summary.get("learner") or {}).get("version", 0) < 1
    if untrained:
        why = (
            f"none of them was rewarded; the first reason: {(summary.get('unrewarded_reasons') or ['not recorded'])[0]}"
            if not summary.get("rewarded")
            else "the learner's log lines above say why: an error, or fewer rewarded responses than [learner] rollout_batch"
        )
        print(f"ppoz train: the learner applied no update ({summary['samples']} responses, policy version 0): {why}", file=sys.stderr)
    if as_json:
        print(json.dumps(_finite(summary)))
    return 1 if len(stopped) >= cfg.workers or untrained else 0


def _finite(value: Any) -> Any:
    """NaN and infinities as null: the summary stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _curve(cfg: Any, summary: dict[str, Any]) -> Any:
    from ppoz.curve import write_training_curve

    out = Path(cfg.output_dir)
    rows = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines() if line.strip()]
    return write_training_curve(out / "reward_curve.png", rows, summary.get("val_before"), summary.get("val_after"))


def on_this_machine(
    args: argparse.Namespace, cfg: Any, stop: threading.Event, grouping: GroupAdvantage | None, learner_flags: list[str]
) -> dict[str, Any]:
    from ppoz.up import UpConfig, started_stack
    from train.run import run_training

    up = load(UpConfig, args.config)
    learner_table = read_toml(args.config).get("learner", {}) if args.config else {}
    # the learner's checkpoints (each with the adapter in peft's format) go under the run's outputs, unless the file says where
    checkpoints = "" if "checkpoint_dir" in learner_table else str(Path(cfg.output_dir) / "checkpoints")
    with started_stack(up, args.config, args.log_level, args.model, checkpoints, learner_flags) as stack:

        def watch() -> None:  # a component that dies for good stops the run
            stack.supervisor.watch()
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
        if stack.reward_service and not cfg.reward_service:  # the drivers use the reward service this stack started
            cfg = dataclasses.replace(cfg, reward_service=stack.reward_service)
        summary = run_training(cfg, stack.client_broker, _figures(stack.redis_url, stack.key_prefix), stop, grouping=grouping)
        if stack.supervisor.failed:
            raise RuntimeError(f"the stack stopped because {stack.supervisor.failed} died")
    adapters = sorted(Path(checkpoints or learner_table["checkpoint_dir"]).glob("ckpt-*/adapter"))
    summary["adapter"] = str(adapters[-1]) if adapters else None  # the learner's last (it checkpoints as it stops)
    return summary


def _figures(redis_url: str, key_prefix: str) -> Any:
    """A reader of the learner's latest figures (empty without a Redis URL)."""
    if not redis_url:
        return dict
    from common.learner_figures import read_latest
    from common.redis_server import connect

    client = connect(redis_url)
    return lambda: read_latest(client, key_prefix)
