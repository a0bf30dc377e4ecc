"""`ppoz reward-server`: the `[reward_service]` table's reward model and/or judge, served to every driver
of a farm (rewards/service/; docs/train.md, "A shared reward service").

It loads the reward model once, binds, logs one readiness line (`reward service ready on ENDPOINT: ...`,
what `ppoz up` and a log watcher wait for), and serves until SIGTERM or SIGINT: then it stops taking
requests, lets those in progress finish (up to drain_timeout_s) and logs one summary line.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import zmq

from common.config import add_flags, load, local_path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rewards.config import RewardServiceConfig

    parser.add_argument(
        "--config", metavar="FILE", type=local_path, help="TOML config file with a [reward_service] table; flags override it"
    )
    add_flags(parser, RewardServiceConfig)


def main(args: argparse.Namespace) -> int:
    from rewards.config import RewardServiceConfig
    from rewards.functions import RewardError
    from rewards.service import RewardService

    cfg = load(RewardServiceConfig, args.config, args)
    reward_model = judge = None
    try:
        if cfg.reward_model:
            from rewards.reward_model import RewardModel

            log.info("loading the reward model %s on %s", cfg.reward_model, cfg.reward_model_device)
            reward_model = RewardModel(cfg.reward_model_config(cfg.batch_size))
        if cfg.judge_model:
            from rewards.judge import Judge

            judge = Judge(cfg.judge_config())
    except (RewardError, ValueError) as e:  # a model that cannot be loaded, a judge without its key or package
        print(f"ppoz reward-server: {e}", file=sys.stderr)
        return 1
    service = RewardService(cfg, reward_model, judge)
    try:
        try:
            service.start()
        except zmq.ZMQError as e:
            print(f"ppoz reward-server: cannot bind {cfg.bind}: {e}", file=sys.stderr)
            return 1

        def on_signal(signum: int, frame: Any) -> None:
            log.info("%s received: finishing the requests in progress", signal.Signals(signum).name)
            service.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        hosted = [f"reward model {cfg.reward_model}"] * (reward_model is not None) + [f"judge {cfg.judge_model}"] * (judge is not None)
        log.info("reward service ready on %s: %s", service.endpoint, ", ".join(hosted))
        service.run()
        log.info("reward service stopped: %s", service.summary())
    finally:
        service.close()
        if judge is not None:
            judge.close()
    return 0
