"""Benchmarks run by `ppoz bench NAME`: the catalogue the command line builds its parsers from, and what
the benches share."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bench:
    """One `ppoz bench NAME`: its one-line help, its description, and the module that holds its
    `add_arguments(parser)` and `main(args)` (imported only when that bench runs or shows its help)."""

    name: str
    help: str
    description: str
    module_path: str = ""  # where it is not tools.bench.NAME

    @property
    def module(self) -> str:
        return self.module_path or f"tools.bench.{self.name}"


BENCHES = (
    Bench(
        "broker",
        "step+feedback pairs/s and latency through the broker",
        "Step+feedback pairs per second through a real broker with Redis durability on, and client-seen latency at a fixed rate.",
    ),
    Bench(
        "scoring",
        "candidate scoring: padded sequences vs prompt KV per action vs packed",
        "Score Kea-shaped observations three ways on one model, side by side (docs/benchmarks.md).",
    ),
    Bench(
        "learner",
        "peak memory and speed of a PPO step: packed vs one sequence per candidate",
        "Peak memory and transitions/s of one PPO policy step, packed layout against one sequence per candidate.",
    ),
    Bench(
        "rag",
        "what rag_step's retrieval adds to a step, side by side with the plain step",
        "Time step, retrieval and rag_step on simulated Kea tasks with a corpus (docs/benchmarks.md).",
    ),
    Bench(
        "generate",
        "PPOZ's generation engine against model.generate one at a time, as a static batch, and generate_batch",
        "The same requests through transformers (model.generate one at a time and as a static batch, generate_batch) "
        "and PPOZ (its engine, and a real broker and actor), legs alternating, medians of --repeats runs: tokens/s, "
        "p50/p99 latency, fraction of the matmul peak, equal greedy outputs (docs/benchmarks.md).",
    ),
    Bench(
        "memory",
        "the peak GPU memory of each part (learner updates, actors, start-up) at a real model's shape, traced on the CPU",
        "Run the learner's and the actor's own code at Qwen2.5-0.5B/1.5B/7B's width, heads and vocabulary in bf16 on the "
        "meta device, which allocates what a GPU would and computes nothing; count every storage while it lives; fit "
        "the peaks at 2, 4 and 6 layers linearly to the model's depth; compare each part with its budget "
        "(docs/benchmarks.md).",
    ),
    Bench(
        "kea",
        "a whole stack at Kea's shapes: 1,024-token prompts, 32 candidates, Qwen2.5's vocabulary; updates, hung jobs, peaks",
        "A 2-layer Qwen2 of hidden 64 at Qwen2.5's 151,936-token vocabulary under `ppoz up` with its defaults, and clients "
        "sending Kea-shaped observations (1,024-token prompts, 32 candidates of 40-60 tokens) for --minutes: updates "
        "applied, jobs taken as hung and requeued, seconds a step, the learner's and the actor's peak memory "
        "(docs/benchmarks.md).",
    ),
    Bench(
        "pace",
        "clients that never ask, faster than the learner: the share of their transitions dropped as stale",
        "Kea-like emulators (half through `ppoz gateway`'s PPOAPI routes, half with the protocol's step; none asks, none sends "
        "done) against `ppoz up` until the learner has applied --updates updates, a fresh stack per leg (the broker's "
        "defaults, and the broker as before issue 55), alternating: steps answered against their deadline, transitions "
        "stored, trained and dropped as stale, steps held by the broker (docs/benchmarks.md).",
    ),
    Bench(
        "activations",
        "what one learner forward keeps for its backward: plain, bf16 autocast, gradient checkpointing, both",
        "A Qwen2 of a real model's width in bf16 with a float32 LoRA adapter of rank 8: the bytes autograd saves for the "
        "backward of one sequence, counted through saved-tensor hooks, four ways (docs/benchmarks.md).",
    ),
    Bench(
        "midflight",
        "new weights while responses run: drain the batch, resubmit the unfinished rows, or continue (the actor's way)",
        "The actor's engine generates a queue of responses while a new LoRA adapter arrives every --every decode steps, "
        "taken three ways, legs alternating, medians of --repeats runs: drain the batch first, resubmit the unfinished "
        "rows, or continue with their KV recomputed; wall time, useful tokens/s, decode steps (docs/benchmarks.md).",
    ),
    Bench(
        "learning",
        "PPO under policy lag: sync, dropping stale samples, and the decoupled objective, side by side",
        "Train a contextual bandit with the actor's and learner's own code three ways under the same budget and "
        "seeds: no lag, lag with stale samples dropped, lag with the decoupled objective (docs/benchmarks.md).",
    ),
    Bench(
        "stability",
        "generation PPO through the real stack at several policy learning rates: does it learn, and stay learned",
        "Run the say-the-word task (a tiny random model, rank-4 LoRA) through `ppoz up` with client threads for a long run at "
        "each learning rate in --lr, legs alternating, --repeats runs each: when the reward first reaches 0.9, its peak, the "
        "last quarter's mean and worst window, and the largest fall from a peak (docs/benchmarks.md).",
    ),
    Bench(
        "update",
        "the generation learner's update throughput: packed rows vs right-padded rows, equal losses",
        "Response tokens per second through one generation PPO update (forward, backward, optimizer steps) on long-tailed "
        "response lengths, the learner's packed layout against one right-padded sequence per row, alternating, with the "
        "losses and weights of both compared (docs/benchmarks.md).",
    ),
    Bench(
        "drivers",
        "the dataset drivers' responses rewarded per second with an LLM judge stand-in, by judge_concurrency",
        "Responses rewarded per second and the wait from response to reward for ppoz train's drivers, with a rule reward and "
        "with an LLM judge (a local chat-completions stand-in with a set latency) at several judge_concurrency settings, "
        "end to end against a real stack and through the scoring path alone (docs/benchmarks.md).",
    ),
    Bench(
        "train",
        "the arithmetic demo's GRPO training: PPOZ against trl's GRPOTrainer on the same work and wall-clock budget",
        "Train the arithmetic demo's work (the tiny numbers model, the 25 sums, the first_word reward, GRPO groups of 4) "
        "for the same wall-clock budget two ways, legs alternating, medians of --repeats runs: `ppoz demo --task "
        "arithmetic --advantage grpo`, and trl's GRPOTrainer in a virtual environment of its own that the bench creates "
        "on first use (trl is no dependency of PPOZ): responses/s, validation after, the first time at 0.7, CPU cores "
        "used and peak memory.",
        module_path="tools.bench.ppoz_vs_trl",
    ),
    Bench(
        "weights",
        "publishing a full snapshot of a GB or more, learner to applied actor, in Redis and a directory, against memcpy",
        "Publish a random model's full snapshot (1.50 GB by default) in chunks, fetch it with every checksum checked and apply "
        "it to an actor's model, through Redis and through the shared-directory store, against a plain memory copy of the "
        "same tensors; legs alternating, medians of --repeats runs: GB/s and the publisher's peak memory (docs/benchmarks.md).",
    ),
    Bench(
        "gpu",
        "every GPU figure in one command: GAE, one update's time and peak memory at a 1.5B shape, scoring, generate, weights",
        "On a GPU, within --budget-s (8 minutes by default), at users' shapes: GAE on 131,072 tokens, one generation update "
        "with the learner's defaults at Qwen2.5-1.5B's shape (time, peak memory), the actor's decode step at 64 rows against "
        "its kernels' own GPU time, ppoz bench scoring, generate (against "
        "one request at a time and the static batch at 64 rows) and weights, and bench train's long task against trl with "
        "--trl-python; one JSON object with --json. With --device cpu the same code at tiny sizes (CI runs it).",
    ),
    Bench(
        "farm",
        "the stack on six hosts (network namespaces, as root): links cut, Redis killed; throughput per host, recovery times",
        "Redis and the broker, two actors, a learner of two ranks on two hosts (torchrun --nnodes 2) and the clients, each "
        "in a Linux network namespace joined by a bridge. While the clients play, an actor host's link is cut for 30 s, "
        "the second learner host's link during an update, and Redis is killed and restarted; then the ledger must "
        "balance, both actors serve the newest version and no request failed. Prints steps served per host in each "
        "phase and how long each fault took to heal (docs/farm.md, docs/benchmarks.md). Needs root.",
        module_path="tools.reliability.farm",
    ),
)

QUIET_LOAD = 0.5  # a load average above this at the start: other work shares the cores and skews the legs


def load_at_start(bench: str) -> float:
    """The machine's one-minute load average, printed, with a warning when other work is running."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"ppoz bench {bench}: load average {load:.2f} on {cores} cores at the start", file=sys.stderr, flush=True)
    if load > QUIET_LOAD:
        logging.getLogger(f"tools.bench.{bench}").warning(
            "load average %.2f on %d cores before the bench: other work is running and will skew the legs", load, cores
        )
    return load


def add_model_shape_flags(parser: argparse.ArgumentParser, hidden: int, layers: int, vocab: int, hidden_help: str = "") -> None:
    """--hidden, --layers and --vocab: the shape of the llama-style model with random weights a bench builds
    (tools/bench/scoring.py's `build_model`), with their defaults."""
    parser.add_argument("--hidden", type=int, default=hidden, help=hidden_help or f"model width (default: {hidden})")
    parser.add_argument("--layers", type=int, default=layers, help=f"decoder layers (default: {layers})")
    parser.add_argument("--vocab", type=int, default=vocab, help=f"vocabulary size (default: {vocab})")


def printed_as_json(args: argparse.Namespace, result: object) -> bool:
    """With --json, `result` printed as one JSON object, and True: the bench's table is then left out."""
    if args.json:
        print(json.dumps(result))
    return bool(args.json)


def measured_legs(case: dict[str, Any], legs: list[str], width: int, error_chars: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """The legs of a bench's table that `case` measured, each with its figures; in place of a leg that failed, its
    line of the table says so, with the first `error_chars` characters of its error (`case["errors"]`)."""
    for leg in legs:
        if leg in case:
            yield leg, case[leg]
        else:
            print(f"{leg:<{width}}  failed: {case['errors'].get(leg, '')[:error_chars]}")


def status_kb(field: str) -> int:
    """A field of this process's /proc/self/status in kB (VmRSS, VmHWM, ...); 0 where there is none."""
    from tools.reliability.fuzz import rss_kb

    return rss_kb("self", field) or 0
