"""`ppoz bench broker`: step+feedback pairs per second through a real broker.

Processes, as in a farm: a Redis server (embedded unless --redis-url), the
broker, M actor processes that answer at once (uniform policy, real BrokerLink),
and one load process driving N client tasks over a few DEALER sockets. Every
step and feedback is durable in Redis before it is answered, as in production.

Two phases in one run:
1. throughput: every task keeps one request in flight (closed loop) for
   --seconds; gives pairs/s.
2. latency: pairs started at a fixed --rate (open loop); gives p50/p99/max
   of each request's round trip seen by the client. The actor answers at once,
   so this round trip is what the broker adds plus two loopback hops.

`--scenario fairness` (issue 30) measures instead what one client's flood does
to another client: an actor that takes --batch-ms a batch (a model's forward),
a polite client stepping at a fixed rate on one socket, alone and then beside a
flooding client that keeps --flood steps in flight on one socket of its own.
It runs the broker's round-robin queue and, for comparison, a first come,
first served queue (the broker before issue 30) in alternating order,
--repeats times each, and reports the polite client's step latency (p50, p99,
in ms and in batches) with medians over the runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time
from typing import Any

from common.stats import percentiles
from common.zmqio import recv_frames, send_frames
from ppoz.flags import add_json_flag, add_repeats_flag
from tools.bench import load_at_start
from tools.bench.broker_figures import broker_added_latency, commit_costs, cpu_seconds

log = logging.getLogger(__name__)

OBS = {
    "prompt": "You are testing the app. Visited pages: MainActivity, Settings. History: ..." * 4,
    "question": "Which action should I choose next? I shall choose No. ",
    "action": [f"{i}: TouchEvent(state=3f2a9c0e, view=MainActivity/TextView-{i})" for i in range(5)],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=256, help="client tasks driven at once, each one emulator (default: 256)")
    parser.add_argument("--sockets", type=int, default=16, help="DEALER sockets the tasks are spread over (default: 16)")
    parser.add_argument("--actors", type=int, default=2, help="actor processes answering at once (default: 2)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase (default: 10)")
    parser.add_argument("--rate", type=float, default=500.0, help="pairs/s in the latency phase (default: 500)")
    parser.add_argument("--segment-len", type=int, default=32, help="broker segment length (default: 32)")
    parser.add_argument("--redis-url", default="", help="Redis to use (default: an embedded redis-server)")
    add_json_flag(parser)
    parser.add_argument(
        "--scenario",
        choices=("throughput", "fairness"),
        default="throughput",
        help="throughput: pairs/s and latency with instant actors; fairness: a flooding client beside a polite one (default: throughput)",
    )
    parser.add_argument("--flood", type=int, default=3000, help="fairness: steps the flooding client keeps in flight (default: 3000)")
    parser.add_argument("--batch-ms", type=float, default=20.0, help="fairness: the actor's time per batch (default: 20)")
    parser.add_argument("--credits", type=int, default=8, help="fairness: the actor's credits, its largest batch (default: 8)")
    add_repeats_flag(parser, "fairness: runs of each queue; figures are medians (default: 3)")


def _stop_all(stop: Any, procs: list[Any]) -> None:
    """Tell the bench's processes to stop; wait for each up to 10 s, then terminate it."""
    stop.set()
    for proc in procs:
        if proc.pid is None:  # never started
            continue
        proc.join(10)
        if proc.is_alive():
            proc.terminate()


def _past(due: float) -> bool:
    return time.perf_counter() >= due


def _broker_process(redis_url: str, segment_len: int, endpoints: Any, stop: Any, queue: str = "fair") -> None:
    from broker.config import BrokerConfig
    from broker.scheduling import FairQueue
    from broker.server import Broker
    from common.redis_server import connect
    from common.shared_settings import StoreSettings

    class FirstComeFirstServed(FairQueue):
        """The step queue before issue 30, for comparison: every client in one line."""

        def line_of(self, job: Any) -> bytes:
            return b""

        def admits(self, client: bytes, limit: int) -> bool:
            return len(self) < limit

    cfg = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        store=StoreSettings(redis_url=redis_url, key_prefix="bench"),
        segment_len=segment_len,
        request_timeout_ms=120_000,
    )
    broker = Broker(cfg, connect(redis_url))
    if queue == "fifo":
        broker.queue = FirstComeFirstServed()
    broker.start()
    endpoints.put((broker.frontend_endpoint, broker.backend_endpoint))
    broker.run(until=stop.is_set)


def _actor_process(endpoint: str, stop: Any, batch_ms: float = 0.0, credits: int = 64) -> None:
    from actor_node.link import BrokerLink
    from actor_node.policies import UniformPolicy
    from actor_node.worker import serve

    class Timed(UniformPolicy):
        """The uniform policy, taking `batch_ms` a batch as a model's forward would."""

        def choose_batch(self, jobs: list[dict[str, Any]]) -> list[Any]:
            time.sleep(batch_ms / 1000)
            return super().choose_batch(jobs)

    link = BrokerLink(endpoint, credits=credits).start()
    done = threading.Event()

    def relay_stop() -> None:  # a multiprocessing Event to the threading Event serve() polls
        stop.wait()
        done.set()

    threading.Thread(target=relay_stop, daemon=True).start()
    serve(link, Timed(0) if batch_ms else UniformPolicy(0), done, max_batch=credits)
    link.close()


class LoadGenerator:
    """N client tasks over a few DEALER sockets; each task alternates step and feedback."""

    def __init__(self, endpoint: str, n_tasks: int, n_sockets: int, name: str = "bench") -> None:
        import zmq

        from common import protocol as p

        self.p = p
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.socks = []
        for _ in range(n_sockets):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)  # a flood of thousands sent at once: queued, not refused (zmq.Again)
            s.setsockopt(zmq.RCVHWM, 100_000)
            s.connect(endpoint)
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.tasks = [f"{name}-{i}" for i in range(n_tasks)]
        self.sock_of = {t: self.socks[i % n_sockets] for i, t in enumerate(self.tasks)}
        self.seq = 0
        self.inflight: dict[str, tuple[str, str, float]] = {}  # rid -> (task, op, sent)
        self.errors = 0
        for t in self.tasks:  # attach every task, in bulk
            self.send(t, p.OP_ATTACH)
        self.collect(lambda *a: None, until=lambda: not self.inflight, timeout=30)

    def send(self, task: str, op: str) -> None:
        p = self.p
        self.seq += 1
        rid = str(self.seq)
        body = p.header(op, rid)
        body["task_id"] = task
        if op in p.STEP_OPS:
            body["obs"] = OBS
        elif op == p.OP_FEEDBACK:
            body.update(reward=0.5, done=False)
        self.inflight[rid] = (task, op, time.perf_counter())
        send_frames(self.sock_of[task], (b"", p.encode(body)))

    def collect(self, on_reply: Any, until: Any, timeout: float) -> None:
        """Receive replies, calling on_reply(task, op, latency_s), until until() or timeout."""
        end = time.perf_counter() + timeout
        while not until() and time.perf_counter() < end:
            for sock, _ in self.poller.poll(10):
                while True:
                    try:
                        frames = recv_frames(sock)
                    except self.zmq.Again:
                        break
                    reply = self.p.decode(frames[-1])
                    task, op, sent = self.inflight.pop(reply["rid"])
                    if "error" in reply:
                        self.errors += 1
                        log.warning("error reply: %s", reply["error"])
                    on_reply(task, op, time.perf_counter() - sent)

    def throughput(self, seconds: float) -> dict[str, Any]:
        p = self.p
        pairs = 0

        def on_reply(task: str, op: str, latency: float) -> None:
            nonlocal pairs
            if op == p.OP_STEP:
                self.send(task, p.OP_FEEDBACK)
            else:
                pairs += 1
                if not stopping:
                    self.send(task, p.OP_STEP)

        stopping = False
        for t in self.tasks:
            self.send(t, p.OP_STEP)
        start = time.perf_counter()
        self.collect(on_reply, until=lambda: time.perf_counter() - start >= seconds, timeout=seconds)
        elapsed = time.perf_counter() - start
        counted = pairs
        stopping = True
        self.collect(on_reply, until=lambda: not self.inflight, timeout=30)
        return {"pairs": counted, "seconds": elapsed, "pairs_per_s": counted / elapsed}

    def latency(self, rate: float, seconds: float) -> dict[str, Any]:
        p = self.p
        idle = list(self.tasks)
        latencies: dict[str, list[float]] = {p.OP_STEP: [], p.OP_FEEDBACK: []}

        def on_reply(task: str, op: str, latency: float) -> None:
            latencies[op].append(latency * 1000)
            if op == p.OP_STEP:
                self.send(task, p.OP_FEEDBACK)
            else:
                idle.append(task)

        start = time.perf_counter()
        started = 0
        late = 0  # starts skipped: every task was busy when one was due (the offered rate is above what is served)
        while (now := time.perf_counter()) - start < seconds:
            due = int((now - start) * rate)
            while started + late < due:
                if not idle:
                    late += 1
                    continue
                self.send(idle.pop(0), p.OP_STEP)
                started += 1
            next_due = start + (started + late + 1) / rate
            self.collect(on_reply, until=functools.partial(_past, next_due), timeout=max(0.0, next_due - time.perf_counter()))
        self.collect(on_reply, until=lambda: not self.inflight, timeout=30)
        both = latencies[p.OP_STEP] + latencies[p.OP_FEEDBACK]
        return {
            "pairs": started,
            "pairs_per_s": started / seconds,
            "late_starts": late,
            "step": percentiles(latencies[p.OP_STEP]),
            "feedback": percentiles(latencies[p.OP_FEEDBACK]),
            "all": percentiles(both),
        }

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.redis_server import connect, redis_url_or_embedded

    url, embedded = redis_url_or_embedded(args.redis_url)
    ctx = mp.get_context("spawn")  # nothing inherited: each process as it would run on its own
    stop = ctx.Event()
    endpoints = ctx.Queue()
    procs = [ctx.Process(target=_broker_process, args=(url, args.segment_len, endpoints, stop), daemon=True)]
    try:
        if args.redis_url:  # start from a clean slate on a shared server
            client = connect(url)
            for key in client.scan_iter("bench:*"):
                client.delete(key)
        procs[0].start()
        frontend, backend = endpoints.get(timeout=60)
        for _ in range(args.actors):
            procs.append(ctx.Process(target=_actor_process, args=(backend, stop), daemon=True))
            procs[-1].start()
        gen = LoadGenerator(frontend, args.clients, args.sockets)
        _wait_for_actors(frontend, args.actors)
        gen.throughput(1.0)  # warm-up
        pids = {
            "broker": procs[0].pid,
            "redis": embedded.process.pid if embedded and embedded.process else None,
            "actors": [proc.pid for proc in procs[1:]],
            "load": os.getpid(),
        }
        cpu_before = cpu_seconds(pids)
        tp = gen.throughput(args.seconds)
        cpu_after = cpu_seconds(pids)
        tp["cpu_us_per_pair"] = {k: round((cpu_after[k] - cpu_before[k]) / max(tp["pairs"], 1) * 1e6, 1) for k in cpu_after}
        lat = gen.latency(args.rate, args.seconds)
        lat["broker_added"] = broker_added_latency(frontend, args.seconds)
        errors = gen.errors
        gen.close()
        stream = connect(url).xlen("bench:segments")
        commit = commit_costs(url, OBS)
    finally:
        _stop_all(stop, procs)
        if embedded is not None:
            embedded.stop()
    return {
        "bench": "broker",
        "pairs_per_s": round(tp["pairs_per_s"], 1),
        "p99_added_ms_at_500": lat["broker_added"].get("p99_ms") if args.rate == 500 else None,
        "throughput": tp,
        "latency": {"rate": args.rate, **lat},
        "errors": errors,
        "segments_in_stream": stream,
        "commit_cpu_us_per_pair": commit,
        "clients": args.clients,
        "actors": args.actors,
        "segment_len": args.segment_len,
        "machine": f"{platform.node()} {platform.machine()} {mp.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }


def _wait_for_actors(frontend: str, n: int, timeout: float = 30.0) -> None:
    from client import Client

    with Client(frontend, deadline=5) as c:
        end = time.monotonic() + timeout
        while len(c.status()["actors"]) < n:
            if time.monotonic() > end:
                raise RuntimeError(f"only {len(c.status()['actors'])} of {n} actors registered within {timeout:.0f} s")
            time.sleep(0.1)


def _flood_process(endpoint: str, n_tasks: int, seconds: float, flooding: Any, out: Any) -> None:
    """The flooding client: one socket, `n_tasks` tasks, each with a step or feedback always in flight."""
    gen = LoadGenerator(endpoint, n_tasks, 1, name="flood")
    flooding.set()
    out.put(gen.throughput(seconds) | {"errors": gen.errors})
    gen.close()


def _fairness_leg(args: argparse.Namespace, url: str, queue: str) -> dict[str, Any]:
    """One broker with `queue`, one timed actor: the polite client alone, then beside the flood."""
    from common.redis_server import connect

    ctx = mp.get_context("spawn")
    stop, flooding = ctx.Event(), ctx.Event()
    endpoints, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_broker_process, args=(url, args.segment_len, endpoints, stop, queue), daemon=True)]
    polite_rate = 20.0
    client = connect(url)
    for key in client.scan_iter("bench:*"):  # each leg from a clean slate: no session, no kept reply of the last one
        client.delete(key)
    try:
        procs[0].start()
        frontend, backend = endpoints.get(timeout=60)
        procs.append(ctx.Process(target=_actor_process, args=(backend, stop, args.batch_ms, args.credits), daemon=True))
        procs[-1].start()
        _wait_for_actors(frontend, 1)
        polite = LoadGenerator(frontend, 64, 1, name="polite")
        alone = polite.latency(polite_rate, args.seconds)
        flood_seconds = args.seconds + 3.0
        procs.append(ctx.Process(target=_flood_process, args=(frontend, args.flood, flood_seconds, flooding, out), daemon=True))
        procs[-1].start()
        if not flooding.wait(120):
            raise RuntimeError("the flooding client did not start within 120 s")
        time.sleep(1.5)  # its steps queued
        beside = polite.latency(polite_rate, args.seconds)
        flood = out.get(timeout=flood_seconds + 120)
        errors = polite.errors
        polite.close()
    finally:
        _stop_all(stop, procs)
    return {
        "queue": queue,
        "alone": alone["step"],
        "flooded": beside["step"],
        "polite_late_starts": beside["late_starts"],
        "flood_pairs_per_s": round(flood["pairs_per_s"], 1),
        "errors": errors + flood["errors"],
    }


def run_fairness(args: argparse.Namespace) -> dict[str, Any]:
    """Both queues, alternating (fair, fifo, fifo, fair, ...), --repeats runs each; medians of each figure."""
    from common.redis_server import redis_url_or_embedded

    load = load_at_start("broker")
    url, embedded = redis_url_or_embedded(args.redis_url)
    runs: dict[str, list[dict[str, Any]]] = {"fair": [], "fifo": []}
    try:
        for r in range(args.repeats):
            for queue in ("fair", "fifo") if r % 2 == 0 else ("fifo", "fair"):
                leg = _fairness_leg(args, url, queue)
                log.info("%s: polite p99 %s ms alone, %s ms flooded", queue, leg["alone"].get("p99_ms"), leg["flooded"].get("p99_ms"))
                runs[queue].append(leg)
    finally:
        if embedded is not None:
            embedded.stop()

    def med(queue: str, phase: str, key: str) -> float:
        return round(statistics.median(run[phase].get(key, float("nan")) for run in runs[queue]), 1)

    summary = {
        queue: {f"{phase}_{key}": med(queue, phase, key) for phase in ("alone", "flooded") for key in ("p50_ms", "p99_ms", "max_ms")}
        | {
            "flooded_p99_batches": round(med(queue, "flooded", "p99_ms") / args.batch_ms, 1),
            "flood_pairs_per_s": statistics.median(run["flood_pairs_per_s"] for run in runs[queue]),
        }
        for queue in runs
    }
    return {
        "bench": "broker",
        "scenario": "fairness",
        "summary": summary,
        "flooded_p99_fifo_over_fair": round(summary["fifo"]["flooded_p99_ms"] / summary["fair"]["flooded_p99_ms"], 1),
        "runs": runs,
        "errors": sum(run["errors"] for legs in runs.values() for run in legs),
        "flood": args.flood,
        "batch_ms": args.batch_ms,
        "credits": args.credits,
        "seconds": args.seconds,
        "load_at_start": round(load, 2),
        "machine": f"{platform.node()} {platform.machine()} {mp.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }


def main_fairness(args: argparse.Namespace) -> int:
    result = run_fairness(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"fairness: a client keeping {result['flood']} steps in flight beside a polite one stepping 20 times a second; "
            f"the actor takes {result['batch_ms']:g} ms a batch of up to {result['credits']}; medians of {args.repeats} runs"
        )
        print("  polite client's step latency, ms:    alone p50 / p99      flooded p50 / p99 / max    flooded p99 in batches")
        for queue, row in result["summary"].items():
            name = "round-robin (now)" if queue == "fair" else "first come, first served"
            print(
                f"    {name:<26} {row['alone_p50_ms']:>8.1f} / {row['alone_p99_ms']:<8.1f}   "
                f"{row['flooded_p50_ms']:>8.1f} / {row['flooded_p99_ms']:.1f} / {row['flooded_max_ms']:.1f}   "
                f"{row['flooded_p99_batches']:>8.1f}"
            )
        print(f"  flooded p99, first come first served / round-robin: {result['flooded_p99_fifo_over_fair']}x; errors {result['errors']}")
    return 0 if result["errors"] == 0 else 1


def main(args: argparse.Namespace) -> int:
    if args.scenario == "fairness":
        return main_fairness(args)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        lat = result["latency"]
        print(f"broker bench: {result['clients']} clients, {result['actors']} instant actors, Redis durability on")
        print(f"  throughput            {result['pairs_per_s']:>10.1f} step+feedback pairs/s")
        print(f"  latency at {lat['rate']:.0f} pairs/s, ms (client round trips; broker_added: time inside the broker):")
        for name in ("step", "feedback", "all", "broker_added"):
            q = lat[name]
            print(f"    {name:<9} p50 {q.get('p50_ms', 0):7.3f}  p99 {q.get('p99_ms', 0):7.3f}  max {q.get('max_ms', 0):7.3f}")
        cpu = result["throughput"]["cpu_us_per_pair"]
        print("  CPU per pair (us):    " + "  ".join(f"{k} {v}" for k, v in cpu.items()))
        commit = result["commit_cpu_us_per_pair"]
        print(
            f"  writing a turn, broker CPU per pair (us): redis-py MULTI/EXEC pipeline {commit['pipeline']}, "
            f"one Lua call {commit['lua_batch']} ({commit['pipeline'] / commit['lua_batch']:.1f}x less)"
        )
        print(f"  errors {result['errors']}, segments in stream {result['segments_in_stream']}")
    return 0 if result["errors"] == 0 else 1
