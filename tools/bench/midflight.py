"""New weights while responses run, three ways: `ppoz bench midflight [--json]`.

The actor's engine (actor_node/generation_engine.py) with a LoRA policy generates a queue of responses of
16 to --longest tokens (every request its own budget, sampled at temperature 1 from its own seed),
--rows at a time, while a new adapter arrives every --every decode steps. Three ways to take it:
- drain: no request joins while new weights wait; they load when the batch is empty (PPOZ before issue 43);
- resubmit: the unfinished rows are dropped and start again under the new weights (a response longer than
  --every never finishes: the leg stops at 4x the steps a batch that never idles would take);
- continue: the weights load between two steps; the running rows compute their KV again and decode on
  (GenerationEngine.swap, what the actor does).
Legs alternate, --repeats runs each; the medians of the wall time for the whole queue, the useful tokens
per second (tokens of finished responses), the decode steps, and the recomputed KV positions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from ppoz.flags import add_json_flag, add_repeats_flag

LEGS = ("drain", "resubmit", "continue")


def run_leg(leg: str, policy: Any, adapters: list[Any], jobs: list[dict[str, Any]], every: int, max_steps: int) -> dict[str, float]:
    engine = policy.generation_engine()
    queue, done, steps, version, pending = list(jobs), 0, 0, policy.policy_version, False
    tokens, started = 0, time.perf_counter()
    while (queue or engine.active) and steps < max_steps:  # resubmit never finishes a response longer than `every`
        if steps and steps % every == 0:
            pending = True
        if pending and (leg != "drain" or not engine.active):
            version += 1
            running = [row.job for row in engine.rows]
            if leg == "resubmit" and running:
                engine.cancel({job["job"] for job in running})
                queue = running + queue
            policy.set_weights(adapters[version % len(adapters)], version, "bench")
            pending = False
        if not (pending and leg == "drain"):
            joining, queue = queue[: engine.free], queue[engine.free :]
            engine.add(joining)
        for _, answer in engine.step():
            if isinstance(answer, Exception):
                raise answer
            done += 1
            tokens += len(answer.response_ids)
        steps += 1
    seconds = time.perf_counter() - started
    unfinished = len(jobs) - done
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "steps": steps,
        "recomputed": engine.recomputed_tokens,
        "unfinished": unfinished,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=16, help="responses decoded at once (default: 16)")
    parser.add_argument("--requests", type=int, default=64, help="responses in the queue (default: 64)")
    parser.add_argument("--longest", type=int, default=256, help="the longest budget; budgets spread from 16 (default: 256)")
    parser.add_argument("--every", type=int, default=100, help="decode steps between two new adapters (default: 100)")
    add_repeats_flag(parser, "runs of every leg, alternating (default: 3)")
    add_json_flag(parser, "print one JSON object")


def main(args: argparse.Namespace) -> int:

    import random
    import tempfile

    import torch

    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from models.policy_model import ModelSpec, load_policy, policy_state_dict
    from models.tiny_models import build_tiny_model

    scratch = tempfile.TemporaryDirectory(prefix="ppoz-midflight-")
    folder = str(build_tiny_model(f"{scratch.name}/llama", arch="llama", hidden=256, layers=4))
    rng = random.Random(0)
    budgets = [rng.randint(16, args.longest) for _ in range(args.requests)]
    jobs = []
    for i, budget in enumerate(budgets):
        sampling = {"max_new_tokens": budget, "temperature": 1.0, "seed": i, "stop": []}
        obs = {"prompt": f"request {i}: " + "ab" * 20, "sampling": sampling}
        jobs.append({"job": i, "task_id": f"t{i}", "deadline_ms": 3_600_000, "obs": obs})
    results: dict[str, list[dict[str, float]]] = {leg: [] for leg in LEGS}
    for repeat in range(args.repeats):
        for leg in LEGS if repeat % 2 == 0 else tuple(reversed(LEGS)):
            model, tokenizer = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=8))
            shapes = policy_state_dict(model)
            gen = torch.Generator().manual_seed(1)
            adapters = [{k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in shapes.items()} for _ in range(3)]
            policy = LLMPolicy(model, tokenizer, SamplingConfig(max_generate_rows=args.rows, max_generate_positions=args.longest + 64))
            cap = 4 * (sum(budgets) // args.rows + args.longest)  # steps: four times what a batch never idle would take
            results[leg].append(run_leg(leg, policy, adapters, [dict(j) for j in jobs], args.every, cap))
    summary = {leg: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for leg, runs in results.items()}
    summary["setup"] = {"rows": args.rows, "requests": args.requests, "tokens": sum(budgets), "every": args.every, "repeats": args.repeats}
    if args.json:
        print(json.dumps(summary))
    else:
        for leg in LEGS:
            s = summary[leg]
            print(
                f"{leg:9s} {s['seconds']:7.2f} s  {s['tokens_per_s']:7.0f} tokens/s  {s['steps']:6.0f} steps  "
                f"{s['recomputed']:7.0f} recomputed  {s['unfinished']:3.0f} unfinished"
            )
    scratch.cleanup()
    return 0
