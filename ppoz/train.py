"""`ppoz train`: generation-mode PPO on a prompt dataset, on this machine or against a farm.

Without `--broker` it starts a stack here as `ppoz up` does (embedded Redis, broker, actors, learner;
`[up]` says how many, the config file's tables configure them, `--model` sets `[policy] model` for
actors and learner) and drives it; with `--broker` it drives an existing farm's broker (the learner's
figures come from `--redis-url`, the farm's Redis, if given). The drivers, rewards and validation: dataset_driver/run.py.

Before anything starts, the datasets are read and each record checked against the broker's limits, and the
reward function is loaded: a bad record or a wrong `--reward-fn` is named at once, not after the stack started.
On one machine the stack keeps its Redis under output_dir/redis (append-only), so `--resume` finds which
samples were stored (docs/train.md, "Resume").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import add_flags, load, local_path, read_toml
from common.learner_figures import Latest
from common.options import ADVANTAGE_ESTIMATORS
from ppoz.flags import add_json_flag, add_model_flag

if TYPE_CHECKING:
    from common.shared_settings import StoreSettings
    from dataset_driver.group_advantage import GroupAdvantage
    from dataset_driver.run import Prepared

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dataset_driver.config import TrainConfig

    parser.add_argument(
        "--config", metavar="FILE", type=local_path, help="TOML config file: [train], and the stack's tables; flags override it"
    )
    add_model_flag(parser, "the policy model directory or Hugging Face id (sets [policy] model for the actors and the learner)")
    parser.add_argument("--broker", default="", help="drive this farm's broker (its client endpoint) instead of starting a stack here")
    # With --broker, the farm's [store] (the file's, these flags over it): its Redis holds the learner's figures
    # and the marks of the samples the farm stored, which a resumed run skips.
    parser.add_argument(
        "--key-prefix", default=argparse.SUPPRESS, help="with --broker: the farm's Redis key prefix (default: [store] key_prefix, ppoz)"
    )
    add_json_flag(parser, "print the summary as one JSON object, last")
    parser.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        help="with --broker: the farm's Redis, for the learner's figures in the progress line (default: [store] redis_url)",
    )
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
    from broker.config import BrokerConfig
    from common.shared_settings import StoreSettings
    from dataset_driver.config import TrainConfig
    from dataset_driver.data import DatasetError
    from dataset_driver.driver import ValidationError
    from dataset_driver.run import prepare, run_training
    from ppoz.supervisor import StackBusy

    cfg = load(TrainConfig, args.config, args)
    if not cfg.data:
        raise SystemExit("ppoz train: no training prompts; give --data FILE (or [train] data)")
    grouping, learner_flags = advantage_settings(args.config, args.advantage)
    stop, interrupt = stop_on_signals()
    try:
        # the broker's limits: its [broker] table (a farm's drivers read the farm's file, or the defaults)
        prepared = prepare(cfg, load(BrokerConfig, args.config).limits)
        if args.broker:
            store = load(StoreSettings, args.config, args)
            marks = _marks(store)
            if marks is None and cfg.resume:
                log.warning("no --redis-url: a resumed run cannot read which samples the farm stored, and may repeat a few")
            figures = _figures(store)
            summary = run_training(cfg, args.broker, figures, stop, grouping=grouping, prepared=prepared, marks=marks, interrupt=interrupt)
        else:
            summary = on_this_machine(args, cfg, stop, grouping, learner_flags, prepared, interrupt)
    except (DatasetError, ValueError, ValidationError, StackBusy) as e:
        print(f"ppoz train: {e}", file=sys.stderr)
        return 2
    return finish(cfg, summary, args.json, learner_started_here=not args.broker)


def stop_on_signals() -> tuple[threading.Event, threading.Event]:
    """(stop, interrupt): SIGTERM and SIGINT (Ctrl-C) set both, and the run stops as docs/train.md says (no
    validation after, a summary that says where it stopped, exit status 0 unless nothing was rewarded)."""
    stop, interrupt = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("%s received: the run stops (turns not fed back within seconds are left for a resumed run)", signal.Signals(signum).name)
        interrupt.set()
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, interrupt


def advantage_settings(config_file: str | None, advantage: str | None) -> tuple[GroupAdvantage | None, list[str]]:
    """From the [generation] table (and --advantage over it): the drivers' grouping (None: they send rewards,
    for GAE) and the `ppoz learner` flags that carry --advantage to a learner started here. The learner's
    settings are validated now, before anything starts."""
    from dataset_driver.group_advantage import GroupAdvantage
    from learner_node.config import GenerationConfig

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
    worker stopped, when no response was rewarded, or when the learner this run started applied no update:
    a run that trained nothing must not look like one that did. A run stopped by a signal is not finished:
    it says where it stopped, and only an unrewarded run among those exits non-zero. output_dir/summary.json is
    written here, once, with everything the printed summary holds."""
    from dataset_driver.run import dumps, write_summary

    summary["curve"] = str(_curve(cfg, summary))
    line = f"ppoz train: {summary['samples']} responses, reward curve in {summary['curve']}"
    if summary.get("val_after") is not None and summary.get("val_before") is not None:
        line += f"; validation reward {summary['val_before']:.3f} before, {summary['val_after']:.3f} after"
    print(line, flush=True)
    if summary.get("adapter") or summary.get("weights"):
        what = f"adapter in {summary['adapter']}" if summary.get("adapter") else f"weights in {summary['weights']}"
        print(f"ppoz train: the trained {what}", flush=True)
    if summary.get("checkpoint"):
        from ppoz.export import export_command

        command = export_command(summary["checkpoint"], Path(cfg.output_dir) / "model")
        print(f"ppoz train: as a model folder that from_pretrained and serving engines load: {command}", flush=True)
    if summary.get("stopped"):
        print(f"ppoz train: stopped at sample {summary['resume_from']}; run it again (resume is on) to go on from there", flush=True)
    stopped = summary.get("stopped_workers") or []
    if stopped:
        print(f"ppoz train: {len(stopped)} of {cfg.workers} driver workers stopped; first: {stopped[0]}", file=sys.stderr)
    unrewarded = summary["samples"] > 0 and not summary.get("rewarded")
    if unrewarded:
        print(
            f"ppoz train: none of the {summary['samples']} responses was rewarded, so nothing was trained on; the first reason:"
            f" {(summary.get('unrewarded_reasons') or ['not recorded'])[0]}",
            file=sys.stderr,
        )
    untrained = (
        learner_started_here
        and not summary.get("stopped")
        and summary["samples"] > 0
        and (summary.get("learner") or {}).get(Latest.VERSION, 0) < 1
    )
    if untrained and not unrewarded:
        why = (
            f"none of them was rewarded; the first reason: {(summary.get('unrewarded_reasons') or ['not recorded'])[0]}"
            if not summary.get("rewarded")
            else "the learner's log lines above say why: an error, or fewer rewarded responses than [learner] rollout_batch"
        )
        print(f"ppoz train: the learner applied no update ({summary['samples']} responses, policy version 0): {why}", file=sys.stderr)
    write_summary(cfg.output_dir, summary)
    if as_json:
        print(dumps(summary))
    return 1 if len(stopped) >= cfg.workers or untrained or unrewarded else 0


def _curve(cfg: Any, summary: dict[str, Any]) -> Any:
    from ppoz.curve import write_training_curve

    out = Path(cfg.output_dir)
    rows = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines() if line.strip()]
    return write_training_curve(out / "reward_curve.png", rows, summary.get("val_before"), summary.get("val_after"))


def on_this_machine(
    args: argparse.Namespace,
    cfg: Any,
    stop: threading.Event,
    grouping: GroupAdvantage | None,
    learner_flags: list[str],
    prepared: Prepared | None = None,
    interrupt: threading.Event | None = None,
) -> dict[str, Any]:
    from dataset_driver.resume import SampleMarks
    from dataset_driver.run import run_training
    from learner_node.config import LearnerConfig
    from ppoz.up import UpConfig, started_stack

    up = load(UpConfig, args.config)
    out = Path(cfg.output_dir)
    fresh_redis = False
    if not up.store.redis_url and not up.redis_data_dir:  # the run's Redis (stream, sample marks) lives with its outputs
        up = dataclasses.replace(up, redis_data_dir=str(out / "redis"))
        fresh_redis = not cfg.resume  # --no-resume: nothing of an earlier run is trained or skipped
    learner_table = read_toml(args.config).get("learner", {}) if args.config else {}
    stand_in = {"store.redis_url": "redis://embedded", **({"policy.model": args.model} if args.model else {})}  # as started_stack checks it
    learner = load(LearnerConfig, args.config, stand_in) if up.learner else None
    # the learner's checkpoints (each with the adapter in peft's format) go under the run's outputs, unless the file says where
    checkpoints = "" if "checkpoint_dir" in learner_table else str(out / "checkpoints")
    with started_stack(up, args.config, args.log_level, args.model, checkpoints, learner_flags, out, fresh_redis) as stack:

        def watch() -> None:  # a component that dies for good stops the run
            stack.supervisor.watch()
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
        if stack.reward_service and not cfg.reward_service:  # the drivers use the reward service this stack started
            cfg = dataclasses.replace(cfg, reward_service=stack.reward_service)
        from common.redis_server import connect

        redis_client = connect(stack.store.redis_url)
        marks = SampleMarks(redis_client, stack.store.key_prefix)
        wait = None
        if learner is not None:
            wait = lambda stop: wait_for_learner(redis_client, stack.store, learner, cfg.drain_timeout_s, stop)  # noqa: E731
        figures = _figures(stack.store)
        summary = run_training(
            cfg,
            stack.client_broker,
            figures,
            stop,
            grouping=grouping,
            prepared=prepared,
            marks=marks,
            wait_for_learner=wait,
            interrupt=interrupt,
        )
        if stack.supervisor.failed:
            raise RuntimeError(f"the stack stopped because {stack.supervisor.failed} died")
    # the learner's last checkpoint (it checkpoints as it stops): a LoRA run's adapter, or every trained weight
    last = max(Path(checkpoints or learner_table["checkpoint_dir"]).glob("ckpt-*"), default=None)
    adapter = last / "adapter" if last is not None and (last / "adapter").is_dir() else None
    summary["checkpoint"] = str(last) if last is not None else None
    summary["adapter"] = str(adapter) if adapter is not None else None
    summary["weights"] = str(last / "policy.safetensors") if last is not None and adapter is None else None
    return summary


def wait_for_learner(client: Any, store: StoreSettings, learner: Any, timeout_s: float, stop: threading.Event) -> None:
    """Once the drivers are done: wait (up to `timeout_s`, or until stopped) until the learner started here has
    acknowledged every segment in the stream, so the run's last samples are trained before the validation after
    and the summary. A learner that waits for full rollouts (`rollout_timeout_s` = 0) is not waited for once
    fewer than `rollout_batch` transitions are left: those wait for the next run."""
    from common.segments import F_N

    stream = store.keys.stream
    end = time.monotonic() + timeout_s
    said = False
    while not stop.is_set():
        entries = client.xlen(stream)
        if entries == 0:
            return
        if not learner.rollout_timeout_s and entries < learner.rollout_batch:
            left = sum(int(fields.get(F_N.encode(), 1)) for _, fields in client.xrange(stream))
            if left < learner.rollout_batch:
                print(f"ppoz train: {left} transitions left in the stream, fewer than one rollout_batch: they wait for the next run")
                return
        if time.monotonic() > end:
            print(f"ppoz train: the learner did not train the last {entries} segments within {timeout_s:g} s (drain_timeout_s)")
            return
        if not said:
            print(f"ppoz train: waiting for the learner to train the last {entries} segments", flush=True)
            said = True
        stop.wait(0.5)


def _marks(store: StoreSettings) -> Any:
    """The farm's sample marks (None without a Redis URL)."""
    if not store.redis_url:
        return None
    from common.redis_server import connect
    from dataset_driver.resume import SampleMarks

    return SampleMarks(connect(store.redis_url), store.key_prefix)


def _figures(store: StoreSettings) -> Any:
    """A reader of the learner's latest figures (empty without a Redis URL)."""
    if not store.redis_url:
        return dict
    from common.learner_figures import read_latest
    from common.redis_server import connect

    client = connect(store.redis_url)
    return lambda: read_latest(client, store.key_prefix)
