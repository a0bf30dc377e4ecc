"""`ppoz demo`: the whole loop learning on this machine, no GPU, nothing to configure.

In one process, each part on its own thread and talking over real ZeroMQ
sockets and a real (embedded) Redis: the broker, one LLM actor, the PPO
learner, and several simulated clients. The model is a tiny Llama-style
network built locally (cached under ~/.cache/ppoz); the environment is a
contextual bandit shaped like a GUI step: the screen text names the widget to
tap, the candidates are tap actions, the reward is 1 for the right one. A
uniformly random policy earns 1/3 on average; the demo shows the learned
policy's reward rise above that, and prints both at the end.
"""

from __future__ import annotations

import argparse
import logging
import random
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

WIDGETS = ["Cart", "Search", "Settings"]
ACTIONS = [f"TouchEvent(view={w})" for w in WIDGETS]


def observation(rng: random.Random) -> tuple[dict, int]:
    target = rng.randrange(len(WIDGETS))
    prompt = f"Task: open {WIDGETS[target]}. Screen: MainActivity with buttons Cart, Search, Settings."
    return {"prompt": prompt, "question": " Action: ", "action": ACTIONS}, target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=150.0, help="how long to train (default: 150)")
    parser.add_argument("--clients", type=int, default=4, help="simulated clients (default: 4)")
    parser.add_argument("--model", default="", help="a local model directory or Hugging Face id (default: a tiny model built locally)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--out", default="runs/demo", help="checkpoints and TensorBoard logs go here (default: runs/demo)")
    parser.epilog = ("With a real model and a GPU: ppoz demo --model Qwen/Qwen2.5-0.5B-Instruct --device cuda "
                     "(the model is downloaded by transformers on first use; LoRA rank 8 is used for non-tiny models).")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from actor_node.config import ActorConfig
    from broker.config import BrokerConfig
    from broker.server import Broker
    from client import Client
    from common.redis_server import EmbeddedRedis, connect
    from learner_node.config import LearnerConfig
    from learner_node.worker import Learner
    from ppoz.cli import run_actor
    from ppoz.tiny_models import build_tiny_model

    for noisy in ("broker", "actor_node", "learner_node", "common", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out = Path(args.out)
    tiny = not args.model
    model = args.model or str(build_tiny_model(Path.home() / ".cache" / "ppoz" / "tiny-llama", "llama", hidden=64, layers=2))
    policy = dict(model=model, lora_rank=0 if tiny else 8, normalisation="token", device=args.device)
    print(f"ppoz demo: model {model}, {args.clients} simulated clients, {args.seconds:.0f} s of training")
    with EmbeddedRedis() as redis_server:
        broker = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", redis_url=redis_server.url,
                                     max_stream_backlog=64), connect(redis_server.url))  # fmt: skip
        broker.start()
        threading.Thread(target=broker.run, name="broker", daemon=True).start()
        learner = Learner(LearnerConfig(**policy, redis_url=redis_server.url, rollout_batch=32, policy_minibatch=16, micro_batch=8,
                                        update_epochs=4, policy_lr=3e-4 if tiny else 1e-5, value_lr=1e-3, target_kl=0.02,
                                        ent_coef=0.01, max_policy_lag=2, checkpoint_dir=str(out / "checkpoints"),
                                        tensorboard_dir=str(out / "tensorboard"), weights_bind="tcp://127.0.0.1:*"),
                          connect(redis_server.url, socket_timeout=30))  # fmt: skip
        learner_thread = threading.Thread(target=learner.run, name="learner", daemon=True)
        learner_thread.start()
        stop = threading.Event()
        actor = ActorConfig(broker=broker.backend_endpoint, **policy, redis_url=redis_server.url, weights=learner.weights_endpoint,
                            weights_poll_s=1.0)  # fmt: skip
        threading.Thread(target=run_actor, args=(actor, stop), name="actor", daemon=True).start()

        rewards: deque[float] = deque(maxlen=200)
        first: list[float] = []
        steps = [0]

        def play(seed: int) -> None:
            rng = random.Random(seed)
            with Client(broker.frontend_endpoint, deadline=120) as c:
                task = c.attach()
                while not stop.is_set():
                    if c.ask(task)["status"] == "wait":
                        time.sleep(0.05)
                        continue
                    obs, target = observation(rng)
                    reply = c.step(task, obs)
                    reward = 1.0 if reply["action"] == target else 0.0
                    c.feedback(task, reward, done=True)
                    rewards.append(reward)
                    steps[0] += 1
                    if reply["policy_version"] == 0:
                        first.append(reward)

        clients = [threading.Thread(target=play, args=(i,), name=f"client-{i}", daemon=True) for i in range(args.clients)]
        for t in clients:
            t.start()
        started = time.monotonic()
        try:
            while time.monotonic() - started < args.seconds:
                time.sleep(5)
                mean = sum(rewards) / len(rewards) if rewards else float("nan")
                print(f"  {time.monotonic() - started:5.0f} s  steps {steps[0]:6d}  policy v{learner.version:<4d} "
                      f"updates {learner.updates:<4d} mean reward (last {len(rewards)}) {mean:.2f}   random: 0.33", flush=True)  # fmt: skip
        except KeyboardInterrupt:
            print("  stopped by Ctrl-C")
        stop.set()
        learner.stop()
        for t in clients:
            t.join(10)
        learner_thread.join(60)
        broker.stop()
    final = sum(rewards) / len(rewards) if rewards else float("nan")
    untrained = sum(first) / len(first) if first else float("nan")
    print("\nsummary")
    print(f"  steps {steps[0]}, updates {learner.updates}, policy version {learner.version}")
    print(f"  mean reward: random policy 0.33 (1 in 3), untrained model {untrained:.2f}, trained model (last {len(rewards)} steps) {final:.2f}")
    print(f"  checkpoints: {out / 'checkpoints'}   TensorBoard: tensorboard --logdir {out / 'tensorboard'}")
    return 0 if final > 0.4 else 1
