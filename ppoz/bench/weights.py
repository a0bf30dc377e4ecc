"""`ppoz bench weights`: publishing a full-weight snapshot of a GB or more, learner to applied actor.

The learner's side is `common.weights.store_snapshot` on the model's tensors
taken one at a time (as `publish` does), the actor's side `fetch` (chunks read
in parallel and each checked against its sha256) and `load_policy_state_dict`
into a second model of the same shape. Both stores run: Redis (an embedded
redis-server on a Unix socket, as `ppoz up` starts one) and a directory (the
shared-directory store, here on the local disk with its page cache). The
yardstick is a plain memory copy of the same tensors into the actor's model.
Legs alternate (memcpy, redis, directory, then directory, redis, memcpy, ...),
and medians of --repeats runs are printed.

With --peak, the publisher's peak memory above its resident set before
publishing is measured too (/proc/self/status VmHWM, reset through
/proc/self/clear_refs; the bench runs itself with glibc's mmap threshold
fixed, so freed buffers leave the resident set, at the price of a page fault
per page of every big buffer): it is bounded by two chunks and their
encoding, not the model's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from ppoz.bench import load_at_start, status_kb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (default 24: 374M parameters, 1.50 GB in float32)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each leg, alternating (default 3)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="chunk size in MiB (default 64)")
    parser.add_argument("--threads", type=int, default=4, help="chunks an actor fetches and checks at once (default 4)")
    parser.add_argument(
        "--peak",
        action="store_true",
        help="measure the publisher's peak memory: runs with glibc's mmap threshold fixed, which makes every big "
        "allocation a fresh mmap (page faults: slower legs; compare throughput without it)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def _model(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        tie_word_embeddings=False,
    )
    with torch.no_grad():
        return LlamaForCausalLM(config).eval()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common import weights
    from common.policy_model import load_policy_state_dict, policy_state_items
    from common.redis_server import EmbeddedRedis, connect

    load = load_at_start("weights")
    learner, actor = _model(args.hidden, args.layers, 0), _model(args.hidden, args.layers, 1)
    nbytes = sum(t.numel() * t.element_size() for t in learner.state_dict().values())
    print(f"snapshot: {nbytes / 1e9:.2f} GB in {len(learner.state_dict())} tensors", file=sys.stderr, flush=True)
    legs: dict[str, list[dict[str, float]]] = {"memcpy": [], "redis": [], "directory": []}
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="ppoz-bench-weights-") as directory:
        client = connect(server.url, socket_timeout=120)
        stores: dict[str, weights.SnapshotStore] = {
            "redis": weights.RedisSnapshots(client, "bench-redis"),
            "directory": weights.DirectorySnapshots(directory),
        }
        version = 0
        for repeat in range(args.repeats):
            order = ["memcpy", "redis", "directory"]
            for leg in order if repeat % 2 == 0 else order[::-1]:
                version += 1
                if leg == "memcpy":
                    start = time.perf_counter()
                    with torch.no_grad():
                        target = actor.state_dict()
                        for name, tensor in learner.state_dict().items():
                            target[name].copy_(tensor)
                    legs[leg].append({"total_s": time.perf_counter() - start})
                    continue
                store = stores[leg]
                resident, peak_ok = status_kb("VmRSS"), args.peak and _reset_peak()
                start = time.perf_counter()
                ann = weights.store_snapshot(
                    client, f"bench-{leg}", version, policy_state_items(learner), "full", "bench", store, args.chunk_mb << 20, keep=1
                )
                published = time.perf_counter()
                publish_peak_mb = (status_kb("VmHWM") - resident) / 1024 if peak_ok else float("nan")
                state = weights.fetch(client, f"bench-{leg}", ann, store, threads=args.threads)
                fetched = time.perf_counter()
                load_policy_state_dict(actor, state)
                applied = time.perf_counter()
                del state
                legs[leg].append(
                    {
                        "total_s": applied - start,
                        "publish_s": published - start,
                        "fetch_s": fetched - published,
                        "apply_s": applied - fetched,
                        "publish_peak_mb": publish_peak_mb,
                    }
                )
                print(f"  run {repeat + 1} {leg}: {applied - start:.2f} s", file=sys.stderr, flush=True)
        if not all(torch.equal(a, b) for a, b in zip(actor.state_dict().values(), learner.state_dict().values(), strict=True)):
            raise RuntimeError("the actor's weights differ from the learner's after the last leg")
        redis_used_mb = client.info("memory")["used_memory"] / 2**20
    medians = {}
    for leg, runs in legs.items():
        medians[leg] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        medians[leg]["gb_per_s"] = nbytes / 1e9 / medians[leg]["total_s"]
    return {
        "bench": "weights",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.system()}",
        "load_at_start": load,
        "snapshot_gb": nbytes / 1e9,
        "chunk_mb": args.chunk_mb,
        "fetch_threads": args.threads,
        "repeats": args.repeats,
        "redis_used_mb_after": redis_used_mb,
        "medians": medians,
        "runs": legs,
    }


MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def main(args: argparse.Namespace) -> int:
    if args.peak and MMAP_THRESHOLD not in os.environ:
        # glibc raises its mmap threshold each time a big block is freed, after which freed blocks stay in its heap
        # and are reused: a later leg's chunks would not show in the resident set at all. A fixed threshold (read
        # at start only, hence the re-run) keeps every big buffer in an mmap of its own, given back when freed.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, MMAP_THRESHOLD: str(128 * 1024)})
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"weights bench: a {result['snapshot_gb']:.2f} GB full snapshot, {result['chunk_mb']} MiB chunks, medians of {result['repeats']}")
    print(f"  {'leg':<10} {'GB/s':>6} {'total s':>8} {'publish s':>10} {'fetch s':>8} {'apply s':>8} {'publisher peak MB':>18}")
    for leg, m in result["medians"].items():
        print(
            f"  {leg:<10} {m['gb_per_s']:>6.2f} {m['total_s']:>8.2f} {m.get('publish_s', float('nan')):>10.2f} "
            f"{m.get('fetch_s', float('nan')):>8.2f} {m.get('apply_s', float('nan')):>8.2f} {m.get('publish_peak_mb', float('nan')):>18.0f}"
        )
    return 0
