"""`ppoz bench weights`: a full-weight snapshot of a GB or more, learner to applied actor, every way it travels.

The learner's side is `common.weights.store_snapshot` on the model's tensors taken one at a time (as
`publish` does); the actor's is the serving path: `fetch` into the policy's staging copy (chunks read
in parallel, each checked), then `LLMPolicy.set_weights`, which swaps the staged tensors in. The
yardstick is a plain memory copy of the same tensors into the actor's model. Legs, alternating
(forward, then backward, ...), medians of --repeats runs:

- memcpy     the yardstick;
- redis      chunks as Redis values (an embedded redis-server on a Unix socket, as `ppoz up` starts one);
- directory  the directory store on this machine's temporary directory (a disk, with its page cache);
- shared     the directory store on /dev/shm: the same-host path, where actors read what the learner
             wrote from shared memory (files for the next publication are allocated in the background:
             `prepare_s`, off the critical path);
- host       Redis through this host's cache: the first actor copies the snapshot in (`total_s`), a
             second one finds it there (`second_s`: its fetch and swap, one fetch per host);
- lora       a rank-8 adapter of the same model through Redis (it must not get slower).

A round of every leg runs first, not counted: the first touch of each buffer and a tmpfs's first files cost what a
learner's first publication costs once. Each leg removes what it stored before the next runs.

Then the swap pause (--swaps, on /dev/shm): the actor generates --rows responses while new snapshots are
published from a thread; each is fetched in the background and applied between two decode steps. The
pause is the time of the loop turn's `catch_up` that applied it (p50, p99, max), against a decode step's
median where no fetch ran (the target: p99 at most one step).

With --peak, the publisher's peak memory above its resident set before publishing is measured
(/proc/self/status VmHWM, reset through /proc/self/clear_refs; the bench runs itself with glibc's mmap
threshold fixed, so freed buffers leave the resident set).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ppoz.flags import add_json_flag, add_repeats_flag
from tools.bench import load_at_start, printed_as_json, status_kb
from tools.bench.weights_hosts import run_hosts

LEGS = ("memcpy", "redis", "directory", "shared", "host", "lora")
QUIET_STEPS = 8  # decode steps between a swap and the next publication in the pause leg (the quiet steps measured)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (default 24: 374M parameters, 1.50 GB in float32)")
    add_repeats_flag(parser, "runs of each leg, alternating (default 3)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="chunk size in MiB (default 64)")
    parser.add_argument("--threads", type=int, default=4, help="chunks an actor fetches and checks at once (default 4)")
    parser.add_argument("--swaps", type=int, default=20, help="snapshots applied while generating, for the pause (default 20; 0: none)")
    parser.add_argument("--no-hosts", action="store_true", help="skip the leg across two hosts (network namespaces: root only)")
    parser.add_argument("--rows", type=int, default=8, help="responses generated at once in the pause leg (default 8)")
    parser.add_argument(
        "--peak",
        action="store_true",
        help="measure the publisher's peak memory: runs with glibc's mmap threshold fixed, which makes every big "
        "allocation a fresh mmap (page faults: slower legs; compare throughput without it)",
    )
    add_json_flag(parser)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def _policy(folder: str, seed: int, lora_rank: int = 0, rows: int = 8) -> Any:
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from models.policy_model import ModelSpec, load_policy

    torch.manual_seed(seed)
    model, tokenizer = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=lora_rank))
    return LLMPolicy(model, tokenizer, SamplingConfig(max_generate_rows=rows, max_generate_positions=160))


def _scramble(model: torch.nn.Module, seed: int) -> None:
    """Other weights than another model's of the same folder (a learner that trained)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * 1e-3)


class Legs:
    """The stores, the learner and the actor of the throughput legs."""

    def __init__(self, args: argparse.Namespace, client: Any, scratch: Path, folder: str) -> None:
        from common import weights

        self.args, self.client, self.scratch = args, client, scratch
        self.learner, self.actor = _policy(folder, 0).model, _policy(folder, 1)
        _scramble(self.learner, 2)
        self.stores: dict[str, weights.SnapshotStore] = {
            "redis": weights.RedisSnapshots(client, "bench-redis"),
            "directory": weights.DirectorySnapshots(scratch / "directory"),
            "shared": weights.DirectorySnapshots(shared_dir(scratch) / "shared"),
            "host": weights.RedisSnapshots(client, "bench-host"),
        }
        self.lora_learner, self.lora_actor = _policy(folder, 3, lora_rank=8).model, _policy(folder, 4, lora_rank=8)
        self.version = 0

    def run(self, leg: str) -> dict[str, float]:
        from common import weights
        from models.policy_model import policy_state_items

        self.version += 1
        if leg == "memcpy":
            start = time.perf_counter()
            with torch.no_grad():
                target = self.actor.model.state_dict()
                for name, tensor in self.learner.state_dict().items():
                    target[name].copy_(tensor)
            return {"total_s": time.perf_counter() - start}
        lora = leg == "lora"
        learner, actor = (self.lora_learner, self.lora_actor) if lora else (self.learner, self.actor)
        store = self.stores["redis" if lora else leg]
        prefix = f"bench-{leg}"
        cache = weights.HostCache(shared_dir(self.scratch) / "host-cache") if leg == "host" else None
        resident, peak_ok = status_kb("VmRSS"), self.args.peak and _reset_peak()
        start = time.perf_counter()
        kind = "lora" if lora else "full"
        tensors = policy_state_items(learner, tied_once=True)
        ann = weights.store_snapshot(self.client, prefix, self.version, tensors, kind, "bench", store, self.args.chunk_mb << 20, keep=1)
        published = time.perf_counter()
        publish_peak_mb = (status_kb("VmHWM") - resident) / 1024 if peak_ok else float("nan")
        state = weights.fetch(self.client, prefix, ann, store, self.args.threads, into=actor.staging(kind), cache=cache)
        fetched = time.perf_counter()
        actor.set_weights(state, self.version, "bench")
        applied = time.perf_counter()
        figures = {
            "total_s": applied - start,
            "publish_s": published - start,
            "fetch_s": fetched - published,
            "apply_s": applied - fetched,
            "publish_peak_mb": publish_peak_mb,
        }
        if isinstance(store, weights.DirectorySnapshots) and store._preparing is not None:
            store._wait_prepared()  # the next publication's files, allocated while the actor fetched
            figures["prepare_s"] = time.perf_counter() - published
        if cache is not None:  # a second actor of this host: the copy is there
            second = weights.HostCache(cache.local.root)
            again = time.perf_counter()
            state = weights.fetch(self.client, prefix, ann, store, self.args.threads, into=actor.staging(kind), cache=second)
            actor.set_weights(state, self.version, "bench")
            figures["second_s"] = time.perf_counter() - again
            if second.fills:
                raise RuntimeError("the second actor fetched the snapshot again instead of reading the host's copy")
        del state
        self._clear(store, prefix, ann, cache)
        return figures

    def _clear(self, store: Any, prefix: str, ann: Any, cache: Any) -> None:
        """Remove what the leg stored (on a tmpfs: kept for the next publication's files, as a learner's store does),
        so that no leg runs beside another's gigabytes in Redis, on the disk or in a host cache."""
        import msgpack

        from common.segments import RedisKeys

        chunks = len(msgpack.unpackb(store.manifest(ann.run, ann.version))["chunks"])
        store.remove(ann.run, ann.version, chunks)
        self.client.delete(RedisKeys(prefix).weights_kept, RedisKeys(prefix).weights_latest)
        if cache is not None:
            shutil.rmtree(cache.local.root, ignore_errors=True)

    def check(self) -> None:
        for a, b in ((self.actor.model, self.learner), (self.lora_actor.model, self.lora_learner)):
            if not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)):
                raise RuntimeError("the actor's weights differ from the learner's after the last leg")


def shared_dir(scratch: Path) -> Path:
    """This host's shared memory (/dev/shm), or the scratch folder where there is none."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        folder = shm / f"{scratch.name}"
        folder.mkdir(exist_ok=True)
        return folder
    return scratch


def pause_leg(args: argparse.Namespace, client: Any, scratch: Path, folder: str) -> dict[str, Any]:
    """Snapshots applied while --rows responses are generated: the pauses, and the decode steps around them."""
    import threading

    from actor_node.responses import PREFILL
    from actor_node.weight_follower import WeightFollower
    from actor_node.worker import catch_up
    from common import weights
    from models.policy_model import policy_state_items

    actor, learner = _policy(folder, 5, rows=args.rows), _policy(folder, 6).model
    engine = actor.generation_engine()
    engine.end_ids = set()  # random weights may sample an end token: every row runs its whole budget
    store = weights.DirectorySnapshots(shared_dir(scratch) / "pause")
    follower = WeightFollower(client, "bench-pause", poll_s=0.05, weights_dir=str(store.root))
    published: list[int] = []

    def publish(version: int) -> None:  # the learner (a thread: its writes and checksums release the GIL)
        weights.store_snapshot(
            client, "bench-pause", version, policy_state_items(learner, tied_once=True), "full", "bench", store, args.chunk_mb << 20, keep=2
        )
        published.append(version)

    publish(1)
    if not catch_up(actor, follower, wait=True):  # the run's first snapshot: later ones are of the run being generated by
        raise RuntimeError("the actor did not load the first snapshot")
    sampling = {"max_new_tokens": 96, "temperature": 1.0, "stop": []}
    jobs = iter(
        {"job": i, "deadline_ms": 3_600_000, "obs": {"prompt": f"request {i}", "sampling": {**sampling, "seed": i}}} for i in range(10**9)
    )
    pauses: list[float] = []
    quiet: list[float] = []  # decode steps while no fetch ran
    fetching: list[float] = []  # decode steps while a fetch ran
    publisher: threading.Thread | None = None
    since_swap = 0  # decode steps since the last swap: the next snapshot comes after QUIET_STEPS of them
    deadline = time.monotonic() + 300
    while len(pauses) < args.swaps and time.monotonic() < deadline:
        idle = publisher is None or not publisher.is_alive()
        if idle and actor.policy_version == published[-1] and since_swap >= QUIET_STEPS:
            publisher = threading.Thread(target=publish, args=(len(published) + 1,), daemon=True)
            publisher.start()
        engine.add([next(jobs) for _ in range(engine.free)])
        start = time.perf_counter()
        applied = catch_up(actor, follower, generating=True)
        if applied:
            pauses.append(time.perf_counter() - start)
            since_swap = 0
        prefill = any(row.state == PREFILL for row in engine.rows)
        busy = follower.fetching is not None or (publisher is not None and publisher.is_alive())
        start = time.perf_counter()
        engine.step()
        if not prefill and not applied:
            (fetching if busy else quiet).append(time.perf_counter() - start)
            since_swap += 1
    follower.close()
    if publisher is not None:
        publisher.join()
    if not pauses or not quiet:
        raise RuntimeError(f"the pause leg applied {len(pauses)} snapshots in 300 s, with {len(quiet)} quiet decode steps")
    pauses.sort()
    step = statistics.median(quiet)
    p99 = pauses[min(len(pauses) - 1, round(0.99 * (len(pauses) - 1)))]
    return {
        "swaps": len(pauses),
        "pause_p50_ms": 1000 * statistics.median(pauses),
        "pause_p99_ms": 1000 * p99,
        "pause_max_ms": 1000 * pauses[-1],
        "decode_step_ms": 1000 * step,
        "decode_step_while_fetching_ms": 1000 * statistics.median(fetching) if fetching else float("nan"),
        "pause_p99_over_step": p99 / step,
        "met": p99 <= step,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.redis_server import EmbeddedRedis, connect
    from models.policy_model import policy_state_items
    from models.tiny_models import build_tiny_model

    load = load_at_start("weights")
    legs: dict[str, list[dict[str, float]]] = {leg: [] for leg in LEGS}
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="ppoz-bench-weights-") as directory:
        scratch = Path(directory)
        try:
            heads = max(1, args.hidden // 64)
            shape = {"hidden": args.hidden, "layers": args.layers, "intermediate": int(args.hidden * 2.75), "heads": heads}
            folder = str(build_tiny_model(scratch / "model", vocab_size=32000, kv_heads=heads, **shape))
            client = connect(server.url, socket_timeout=120)
            bench = Legs(args, client, scratch, folder)
            nbytes = sum(t.numel() * t.element_size() for t in bench.learner.state_dict().values())
            print(f"snapshot: {nbytes / 1e9:.2f} GB in {len(bench.learner.state_dict())} tensors", file=sys.stderr, flush=True)
            for leg in LEGS:  # a round not counted: first touches of the buffers, a tmpfs's first files (a learner's first publication)
                print(f"  warm-up {leg}: {bench.run(leg)['total_s']:.3f} s", file=sys.stderr, flush=True)
            for repeat in range(args.repeats):
                for leg in LEGS if repeat % 2 == 0 else LEGS[::-1]:
                    legs[leg].append(bench.run(leg))
                    print(f"  run {repeat + 1} {leg}: {legs[leg][-1]['total_s']:.3f} s", file=sys.stderr, flush=True)
            bench.check()
            lora_bytes = sum(t.numel() * t.element_size() for _, t in policy_state_items(bench.lora_learner))
            del bench
            redis_used_mb = client.info("memory")["used_memory"] / 2**20
            pause: dict[str, Any]
            try:
                pause = pause_leg(args, client, scratch, folder) if args.swaps else {}
            except RuntimeError as e:  # reported: the throughput legs' figures still count
                pause = {"error": str(e)}
            hosts: dict[str, Any] = {"skipped": "--no-hosts"}
            if not args.no_hosts:
                try:
                    hosts = run_hosts(folder, args.chunk_mb, args.threads, args.repeats)
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    hosts = {"error": str(e)[-2000:]}
        finally:
            shutil.rmtree(shared_dir(scratch), ignore_errors=True)
    medians = {}
    for leg, runs in legs.items():
        medians[leg] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        medians[leg]["gb_per_s"] = (lora_bytes if leg == "lora" else nbytes) / 1e9 / medians[leg]["total_s"]
    shared = medians["shared"]["gb_per_s"]
    memcpy = medians["memcpy"]["gb_per_s"]
    return {
        "bench": "weights",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.system()}",
        "load_at_start": load,
        "snapshot_gb": nbytes / 1e9,
        "lora_mb": lora_bytes / 1e6,
        "chunk_mb": args.chunk_mb,
        "fetch_threads": args.threads,
        "repeats": args.repeats,
        "redis_used_mb_after": redis_used_mb,
        "targets": {"shared_gb_per_s": shared, "shared_over_memcpy": shared / memcpy, "met": shared >= 2.0 and shared / memcpy >= 0.25},
        "medians": medians,
        "pause": pause,
        "hosts": hosts,
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
    if printed_as_json(args, result):
        return 0
    print(f"weights bench: a {result['snapshot_gb']:.2f} GB full snapshot, {result['chunk_mb']} MiB chunks, medians of {result['repeats']}")
    print(f"  {'leg':<10} {'GB/s':>6} {'total s':>8} {'publish s':>10} {'fetch s':>8} {'apply s':>8} {'publisher peak MB':>18}")
    for leg, m in result["medians"].items():
        print(
            f"  {leg:<10} {m['gb_per_s']:>6.2f} {m['total_s']:>8.3f} {m.get('publish_s', float('nan')):>10.3f} "
            f"{m.get('fetch_s', float('nan')):>8.3f} {m.get('apply_s', float('nan')):>8.3f} {m.get('publish_peak_mb', float('nan')):>18.0f}"
        )
    t = result["targets"]
    print(f"  same host (shared): {t['shared_gb_per_s']:.2f} GB/s, {t['shared_over_memcpy']:.2f} of memcpy (targets: 2 GB/s, 0.25)")
    if "host" in result["medians"]:
        print(f"  a second actor on the host (its copy found): {result['medians']['host']['second_s']:.3f} s")
    h = result["hosts"]
    if "snapshot_gb_per_s" in h:
        print(
            f"  across two hosts: {h['snapshot_gb_per_s']:.2f} GB/s, {h['snapshot_over_tcp']:.2f} of the bridge's TCP rate "
            f"({h['tcp_gb_per_s']:.2f} GB/s; target 0.5)"
        )
    else:
        print(f"  across two hosts: {h.get('skipped') or h.get('error')}")
    if "error" in result["pause"]:
        print(f"  swap pause: {result['pause']['error']}")
    elif result["pause"]:
        p = result["pause"]
        print(
            f"  swap pause over {p['swaps']} swaps: p50 {p['pause_p50_ms']:.2f} ms, p99 {p['pause_p99_ms']:.2f} ms, max "
            f"{p['pause_max_ms']:.2f} ms; a decode step {p['decode_step_ms']:.1f} ms ({p['decode_step_while_fetching_ms']:.1f} ms "
            "while a fetch runs)"
        )
    return 0
