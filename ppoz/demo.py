"""`ppoz demo`: watch an LLM policy learn to explore an app, on this machine, no GPU.

Everything runs in this one process, each part on its own thread and talking
over real ZeroMQ sockets and a real (embedded) Redis, exactly as the separate
processes of a farm do: the broker, one LLM actor, the PPO learner, and several
simulated Kea clients (envs/kea_sim.py) exploring an app with UI tarpits. The
model is a tiny Llama-style network built locally and cached under
~/.cache/ppoz (no download). A live progress line shows steps, episodes, mean
return, policy version, losses and speed; at the end a summary compares the
trained policy with the uniformly random one, and a PNG learning curve and
TensorBoard logs are written.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common.config import local_path
from common.learner_figures import CANDIDATES, UpdateFigure
from common.options import ADVANTAGE_ESTIMATORS
from ppoz.export import export_command
from ppoz.flags import add_device_flag, add_json_flag, add_model_flag, add_seed_flag

log = logging.getLogger(__name__)

# The app the demo explores, sized for a tiny model on a CPU: short event strings and the
# last few steps of history keep a prompt near 1k tokens (a real Kea prompt is 1k-20k).

EPILOG = """\
A real model and a GPU:
  ppoz demo --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --minutes 30
The model is read with transformers' from_pretrained: a local directory, or a
Hugging Face id that transformers downloads on first use. Models other than the
built-in tiny one are trained through a LoRA adapter (rank 8) at a learning
rate of 1e-5; the tiny one trains all its weights. For a farm over several
machines use `ppoz up` or the separate commands (docs/farm.md).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task",
        default="kea",
        choices=("kea", "arithmetic"),
        help="kea: choose among candidate actions exploring an app; arithmetic: write the sum in words, "
        "ppoz train on a generated dataset (default: kea)",
    )
    add_json_flag(parser, "arithmetic: print the summary (val_before, val_after, ...) as JSON, last")
    parser.add_argument(
        "--advantage",
        default="gae",
        choices=ADVANTAGE_ESTIMATORS,
        help="arithmetic: gae (a critic), grpo or rloo (critic-free, 4 responses per sum compared with each other) (default: gae)",
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to train (default: 5)")
    parser.add_argument(
        "--responses",
        type=int,
        default=0,
        help="arithmetic: stop after this many training responses (with grpo or rloo, up to whole groups of 4), once the"
        " learner has trained them, or at --minutes if that comes first (default: 0, by --minutes alone)",
    )
    parser.add_argument(
        "--clients", type=int, default=None, help="simulated clients: Kea emulators (default: 4), arithmetic's driver workers (default: 8)"
    )
    add_model_flag(parser, "a local model directory or Hugging Face id (default: a tiny model built locally)")
    add_device_flag(parser, "cpu, cuda, cuda:N or auto (default: auto), for the actor and the learner")
    add_seed_flag(parser, "kea: the simulated app's layout; arithmetic: prompt order and sampling seeds (default: 0)")
    parser.add_argument(
        "--out", default="runs/demo", type=local_path, help="learning curve, checkpoints and TensorBoard logs go here (default: runs/demo)"
    )
    parser.add_argument("--report-every", type=float, default=10.0, help="seconds between progress lines (default: 10)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG


def main(args: argparse.Namespace) -> int:
    if not args.minutes > 0 or (args.clients is not None and args.clients < 1) or args.responses < 0:
        given = f"got --minutes {args.minutes:g}, --clients {args.clients}, --responses {args.responses}"
        print(f"ppoz demo: --minutes must be positive, --clients at least 1 and --responses 0 or more ({given})", file=sys.stderr)
        return 2
    if args.responses and args.task != "arithmetic":
        print(f"ppoz demo: --responses counts generated responses: it is for --task arithmetic, not {args.task}", file=sys.stderr)
        return 2
    if args.task == "arithmetic":
        from ppoz import demo_arithmetic

        return demo_arithmetic.main(args)
    args.clients = args.clients or 4
    import redis

    from actor_node.config import ActorConfig
    from actor_node.main import run_actor
    from broker.config import BrokerConfig
    from broker.server import Broker
    from common.learner_figures import read_latest
    from common.redis_server import EmbeddedRedis, connect
    from common.shared_settings import PolicySpec, StoreSettings
    from envs.base import random_returns
    from envs.kea_sim import KeaSim, demo_app
    from envs.runner import Runner
    from learner_node.config import LearnerConfig
    from learner_node.worker import Learner
    from models.tiny_models import build_tiny_model
    from ppoz.curve import write_learning_curve

    for noisy in ("broker", "actor_node", "learner_node", "common", "envs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out = Path(args.out)
    tiny = not args.model
    model = args.model or str(build_tiny_model(Path.home() / ".cache" / "ppoz" / "tiny-llama", "llama", hidden=64, layers=2))
    app = demo_app(seed=args.seed)
    random_baseline = statistics.mean(random_returns(lambda i: KeaSim(app), 500, seed=args.seed))
    policy = PolicySpec(model=model, lora_rank=0 if tiny else 8, normalisation="token")
    print(
        f"ppoz demo: {args.clients} simulated Kea clients explore an app of {app.screens} screens with tarpits "
        f"({app.horizon} steps per episode)\n  model {model}; training for {args.minutes:g} minutes\n"
        f"  random policy: mean return {random_baseline:.2f} (played locally, 500 episodes)",
        flush=True,
    )
    with EmbeddedRedis() as redis_server:
        store = StoreSettings(redis_url=redis_server.url)  # broker, learner and actor meet in it
        broker = Broker(
            BrokerConfig(
                frontend="tcp://127.0.0.1:*",
                backend="tcp://127.0.0.1:*",
                store=store,
                # transitions no learner has read: 12 whole episodes, three rollouts ready while one trains (before the
                # broker left out what the learner has read, 16 episodes counted the rollout in training among them)
                max_stream_backlog=12 * app.horizon,
                segment_len=app.horizon,
            ),
            connect(redis_server.url),
        )
        broker.start()
        threading.Thread(target=broker.run, name="broker", daemon=True).start()
        learner_cfg = LearnerConfig(
            policy=policy,
            device=args.device,
            store=store,
            rollout_batch=40,
            policy_minibatch=20,
            micro_batch=10,
            update_epochs=4,
            # policy_lr by the model: 3e-4 for the tiny one's random weights, all trained; 1e-5 for a real model's LoRA
            value_lr=1e-3,
            target_kl=0.03,
            ent_coef=0.01,
            gamma=0.9,
            max_policy_lag=3,
            value_hidden=[256, 256],
            checkpoint_dir=str(out / "checkpoints"),
            tensorboard_dir=str(out / "tensorboard"),
            weights_bind="tcp://127.0.0.1:*",
        )
        learner = Learner(learner_cfg, connect(redis_server.url, socket_timeout=30))
        learner_thread = threading.Thread(target=learner.run, name="learner", daemon=True)
        learner_thread.start()
        stop_actor = threading.Event()
        actor = ActorConfig(
            broker=broker.backend_endpoint,
            policy=policy,
            device=args.device,
            store=store,
            weights=learner.weights_endpoint,
            weights_poll_s=1.0,
        )
        actor_thread = threading.Thread(target=run_actor, args=(actor, stop_actor), name="actor", daemon=True)
        actor_thread.start()
        metrics_redis = connect(redis_server.url)
        runner = Runner(broker.frontend_endpoint, lambda i: KeaSim(app), args.clients, deadline=120, seed=args.seed).start()
        started = time.monotonic()
        # Ctrl-C (or SIGTERM) sets an event the loop waits on, as every ppoz process stops: no KeyboardInterrupt that
        # code the main thread is in could swallow (a demo once kept training past Ctrl-C, on a loaded machine).
        interrupted = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: interrupted.set())
        while time.monotonic() - started < args.minutes * 60 and runner.running() and not interrupted.is_set():
            interrupted.wait(min(args.report_every, max(0.1, args.minutes * 60 - (time.monotonic() - started))))
            try:
                figures = read_latest(metrics_redis, store.key_prefix)
            except redis.RedisError:
                figures = {}  # the line goes out without the learner's part
            print(progress_line(runner.stats.snapshot(), figures), flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C cuts the summary short
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if interrupted.is_set():
            print("  stopped by Ctrl-C; writing the summary", flush=True)
        runner.stop()
        stop_actor.set()
        learner.stop()
        learner_thread.join(120)
        actor_thread.join(30)
        broker.stop()
        metrics_redis.close()
    episodes = runner.stats.episodes
    curve = write_learning_curve(
        out / "learning_curve.png",
        episodes,
        random_baseline,
        started,
        title=f"ppoz demo: {args.clients} Kea-like clients, {Path(model).name}",
    )
    return print_summary(episodes, random_baseline, learner, curve, out, interrupted.is_set())


def progress_line(s: dict[str, Any], learner: dict[str, float]) -> str:
    def fmt(key: str, spec: str = ".3f") -> str:
        return format(learner[key], spec) if key in learner else "-"

    return (
        f"  {s['elapsed_s']:5.0f} s  steps {s['steps']:6d} ({s['steps_per_s']:4.1f}/s)  episodes {s['episodes']:4d}  "
        f"mean return (last {s['recent_episodes']}) {s['recent_mean_return']:5.2f}  policy v{s['policy_version']:<3d}  "
        f"policy loss {fmt(UpdateFigure.POLICY_LOSS.of(CANDIDATES))}  "
        f"value loss {fmt(UpdateFigure.VALUE_LOSS.of(CANDIDATES))}  "
        f"entropy {fmt(UpdateFigure.ENTROPY.of(CANDIDATES))}"
    )


def trained_window(episodes: list[Any], fraction: float = 0.2, least: int = 20) -> list[float]:
    """The returns of the last `fraction` of the episodes (at least `least`): the trained policy's figure."""
    n = max(least, int(len(episodes) * fraction))
    return [e.ret for e in episodes[-n:]]


def print_summary(episodes: list[Any], random_baseline: float, learner: Any, curve: Path, out: Path, interrupted: bool = False) -> int:
    """The summary; exit status 1 when the trained policy did not clearly beat the random one after the whole
    run. A run stopped with Ctrl-C is the user's choice, not a failure: it says so and exits 0."""
    untrained = [e.ret for e in episodes if e.policy_version == 0]
    trained = trained_window(episodes)
    mean = statistics.mean(trained) if trained else math.nan
    sem = statistics.stdev(trained) / math.sqrt(len(trained)) if len(trained) > 1 else math.nan
    print("\nsummary")
    print(
        f"  episodes {len(episodes)}, steps {sum(e.steps for e in episodes)}, learner updates {learner.updates}, "
        f"policy version {learner.version}"
    )
    print(
        f"  mean return  random policy {random_baseline:.2f}   untrained model "
        f"{statistics.mean(untrained) if untrained else math.nan:.2f} ({len(untrained)} episodes)   "
        f"trained model {mean:.2f} +- {sem:.2f} (last {len(trained)} episodes)"
    )
    better = mean > random_baseline + max(0.5, 2 * (sem if not math.isnan(sem) else 0))
    if better:
        print("  the trained policy beats the random one")
    elif interrupted:
        print("  the trained policy does not beat the random one yet: stopped early (5 minutes, --minutes, let it learn)")
    else:
        print("  the trained policy did NOT clearly beat the random one")
    print(f"  learning curve: {curve}")
    print(f"  TensorBoard:    tensorboard --logdir {out / 'tensorboard'}")
    print(f"  checkpoints:    {out / 'checkpoints'}")
    if any((out / "checkpoints").glob("ckpt-*")):  # none before the learner's first update
        print(f"  as a model:     {export_command(out / 'checkpoints', out / 'model')}   (a folder from_pretrained loads)")
    return 0 if better or interrupted else 1
