"""`ppoz bench learning`: what stale samples cost PPO, and what the decoupled objective buys back.

A contextual bandit (one-step episodes: a prompt names a thing, the policy picks
one of four candidate answers, reward 1 for the right one) is played by the
actor's own code (LLMPolicy) and trained by the learner's own code (build_rollout,
candidate_update) on a tiny Llama-style model with a LoRA adapter, in one process so
the policy lag can be imposed exactly:

- `sync`: every rollout is trained on as soon as it is sampled (lag 0);
- `drop_stale`: the actor runs `--lag` rollouts ahead of the learner (a queue of
  that depth between them, as when actors keep serving while the learner
  trains), always with the newest weights; the learner drops samples older than
  its weights and trains plain PPO (ratio and clip against the behaviour policy)
  on the rest: the strict on-policy rule. It trains once the queue has been
  refilled with current samples, so most samples are thrown away;
- `decoupled`: the same queue; every sample (lag `--lag`) is trained on with the
  decoupled objective (docs/design.md, "Asynchronous PPO").

Every method gets the same budget of environment steps and the same seeds. The
figure is the mean reward over the last 20% of the steps, averaged over seeds,
next to the uniform random policy's (1 / candidates).
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ppoz.flags import add_json_flag
from tools.bench import printed_as_json

log = logging.getLogger(__name__)

METHODS = ("sync", "drop_stale", "decoupled")
THINGS = [
    ("the sky on a clear day", "blue"),
    ("grass in spring", "green"),
    ("a ripe banana", "yellow"),
    ("fresh snow", "white"),
    ("a fire engine", "red"),
    ("coal", "black"),
    ("an orange", "orange"),
    ("a violet", "purple"),
]
ANSWERS = ["blue", "green", "yellow", "white", "red", "black", "orange", "purple"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from learner_node.config import UpdateConfig

    epochs = UpdateConfig().update_epochs  # the learner's own (until 2026-11-28 the bench trained 4: docs/benchmarks.md)
    parser.add_argument("--steps", type=int, default=3072, help="environment steps per run (default: 3072)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method (default: 3)")
    parser.add_argument("--lag", type=int, default=4, help="rollouts the actor runs ahead of the learner (default: 4)")
    parser.add_argument("--rollout-batch", type=int, default=32, help="transitions per update (default: 32)")
    parser.add_argument("--lr", type=float, default=5e-4, help="policy learning rate (default: 5e-4)")
    parser.add_argument(
        "--update-epochs",
        type=int,
        default=epochs,
        help=f"policy passes over each rollout, every method (default: {epochs}, the learner's update_epochs)",
    )
    parser.add_argument("--lora-rank", type=int, default=4, help="LoRA rank (default: 4; the head and final norm train beside it)")
    parser.add_argument(
        "--target-kl",
        type=float,
        default=None,
        help="stop an update's epochs past this approx KL (default: the learner's target_kl; 0: never)",
    )
    add_json_flag(parser)


def observation(rng: random.Random) -> tuple[dict[str, Any], int]:
    """A prompt and four candidates, one right; the right one's position varies."""
    thing, colour = rng.choice(THINGS)
    wrong = rng.sample([a for a in ANSWERS if a != colour], 3)
    actions = [*wrong, colour]
    rng.shuffle(actions)
    return {"prompt": f"What colour is {thing}?", "question": " It is", "action": actions}, actions.index(colour)


def run(model_dir: str, method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training run; returns the rewards of every step and the transitions used and dropped."""
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from common.segments import CandidateObservation, Segment, Transition
    from learner_node.config import UpdateConfig
    from learner_node.policy import LearnerPolicy
    from learner_node.rollout import build_rollout, candidate_update
    from models.policy_model import ModelSpec, load_policy, policy_state_dict
    from models.tiny_models import LORA_TRAINABLE

    spec = ModelSpec(
        model=model_dir, device="cpu", lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_trainable=LORA_TRAINABLE["llama"]
    )
    torch.manual_seed(seed)
    model, tokenizer = load_policy(spec)
    actor_model, _ = load_policy(spec)
    lp = LearnerPolicy(model, tokenizer, "token", 1.0, [64], path="packed")
    actor = LLMPolicy(actor_model, tokenizer, SamplingConfig(normalisation="token", seed=seed), "packed")
    policy_opt = torch.optim.Adam(lp.trainable_parameters(), lr=args.lr)
    value_opt = torch.optim.Adam(lp.value_head.parameters(), lr=1e-3)
    cfg = UpdateConfig(
        objective="ppo" if method == "drop_stale" else "decoupled",
        update_epochs=args.update_epochs,
        policy_minibatch=args.rollout_batch // 2,
        micro_batch=args.rollout_batch // 2,
        value_epochs=4,
        ent_coef=0.0,
        target_kl=UpdateConfig().target_kl if args.target_kl is None else args.target_kl,
    )
    ahead = 0 if method == "sync" else args.lag
    max_lag = 0 if method == "drop_stale" else ahead
    rng = random.Random(seed)
    version, served = 0, 0
    queue: collections.deque[list[Any]] = collections.deque()
    rewards: list[float] = []
    used = dropped = 0

    def value_of(observations: list[CandidateObservation]) -> list[float]:
        return lp.values(observations)[1].tolist()

    while len(rewards) < args.steps:
        if served != version:  # the actor applies each new version before its next batch
            actor.set_weights(policy_state_dict(lp.model), version, "bench")
            served = version
        batch = [observation(rng) for _ in range(args.rollout_batch)]
        choices = actor.choose_batch([{"job": i, "task_id": f"t{i}", "obs": obs} for i, (obs, _) in enumerate(batch)])
        segments = []
        for i, ((obs, right), choice) in enumerate(zip(batch, choices, strict=True)):
            if isinstance(choice, Exception):  # the bench's own observations always score
                raise RuntimeError(f"the actor refused a bench observation: {choice}")
            reward = float(choice.action == right)
            rewards.append(reward)
            t = Transition(
                obs=CandidateObservation.from_wire(obs),
                action=choice.action,
                logprob=choice.logprob,
                probs=choice.probs,
                policy_version=served,
                reward=reward,
                done=True,
                truncated=False,
                mode="step",
            )
            segments.append(Segment(f"s{len(rewards)}:{i}", f"t{i}", 0, "done", True, False, None, [t]))
        queue.append(segments)
        if len(queue) <= ahead:
            continue
        rollout = build_rollout(queue.popleft(), value_of, 1.0, 0.95, current_version=version, max_policy_lag=max_lag)
        used += len(rollout)
        dropped += rollout.dropped_stale
        if len(rollout):
            candidate_update(lp, policy_opt, value_opt, rollout, cfg, update_index=version)
            version += 1
    return {"rewards": rewards, "used": used, "dropped": dropped, "updates": version}


def main(args: argparse.Namespace) -> int:
    from models.tiny_models import build_tiny_model

    if min(args.steps, args.seeds, args.lag, args.lora_rank, args.update_epochs) < 1 or args.rollout_batch < 2 or args.lr <= 0:
        raise SystemExit(
            "ppoz bench learning: --steps, --seeds, --lag, --lora-rank, --update-epochs and --lr must be positive, "
            "--rollout-batch at least 2"
        )
    logging.getLogger("actor_node").setLevel(logging.WARNING)
    logging.getLogger("common").setLevel(logging.WARNING)
    started = time.perf_counter()
    tail = max(1, args.steps // 5)
    if args.steps - tail < args.lag * args.rollout_batch:
        raise SystemExit(
            f"ppoz bench learning: --steps {args.steps} is too short for --lag {args.lag} x --rollout-batch {args.rollout_batch}: "
            f"need at least {5 * args.lag * args.rollout_batch // 4 + 1} steps"
        )
    sync_shifted = math.nan
    random_return = 1.0 / 4
    methods: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "llama", "llama", hidden=64, layers=2))
        for method in METHODS:
            runs = []
            for seed in range(args.seeds):
                result = run(model_dir, method, seed, args)
                runs.append(result)
                log.info(
                    "%s seed %d: last-20%% return %.3f, %d used, %d dropped, %d updates",
                    *(method, seed, statistics.mean(result["rewards"][-tail:]), result["used"], result["dropped"], result["updates"]),
                )
            returns = [statistics.mean(r["rewards"][-tail:]) for r in runs]
            if method == "sync":  # the same window moved back by the lag: the best a lagged actor can show
                shift = args.lag * args.rollout_batch
                sync_shifted = statistics.mean(statistics.mean(r["rewards"][-tail - shift : len(r["rewards"]) - shift]) for r in runs)
            methods[method] = {
                "return": statistics.mean(returns),
                "stderr": statistics.stdev(returns) / len(returns) ** 0.5 if len(returns) > 1 else 0.0,
                "used": sum(r["used"] for r in runs),
                "dropped": sum(r["dropped"] for r in runs),
                "updates": sum(r["updates"] for r in runs),
            }
    gain = {m: (v["return"] - random_return) for m, v in methods.items()}
    result = {
        "random_return": random_return,
        "methods": methods,
        "decoupled_share_of_sync_gain": gain["decoupled"] / gain["sync"] if gain["sync"] else float("nan"),
        # sync's return over the window moved back by lag x rollout_batch steps: a lagged actor serves the
        # policy sync served that many steps earlier, so this is what a lagged method reaches at sync's pace
        "sync_return_lag_steps_earlier": sync_shifted,
        "steps": args.steps,
        "seeds": args.seeds,
        "lag": args.lag,
        "update_epochs": args.update_epochs,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "seconds": round(time.perf_counter() - started, 1),
    }
    if printed_as_json(args, result):
        return 0
    print(f"contextual bandit, {args.steps} steps x {args.seeds} seeds, the actor {args.lag} rollouts ahead of the learner")
    print(f"{'method':<12}{'return (last 20%)':>20}{'used':>8}{'dropped':>9}{'updates':>9}")
    print(f"{'random':<12}{random_return:>20.3f}")
    for name, v in methods.items():
        print(f"{name:<12}{v['return']:>14.3f} ± {v['stderr']:.3f}{v['used']:>8}{v['dropped']:>9}{v['updates']:>9}")
    print(f"decoupled gains {result['decoupled_share_of_sync_gain']:.0%} of sync's improvement over random ({result['seconds']} s)")
    earlier = args.lag * args.rollout_batch
    print(f"sync over the window {earlier} steps earlier (what a lagged actor shows at sync's pace): {sync_shifted:.3f}")
    return 0
