"""`ppoz bench drivers`: how many responses per second the dataset drivers reward when an LLM judge scores them.

A remote judge answers in about half a second, so the drivers' throughput is bounded by how many
judge requests run at once, not by the policy. This measures it, side by side in one run, for a
rule reward (no judge: the ceiling) and for an LLM judge at several `judge_concurrency` settings,
with the code `ppoz train` runs: the reward built by `dataset_driver.run.build_reward` from a `[train]`
config (the official openai client, its timeouts and retries, the concurrency limit, the cache),
scored by the drivers' `BatchingScorer` with `max_batch` = workers, as `ppoz train` sets it. The
judge is a stand-in for the remote service (tools/bench/judge_stand_in.py): a chat-completions
server on loopback, in this process, that replies `Score: 1` after `--latency` seconds.

Two measurements of each setting:

- `end_to_end`: `dataset_driver.driver.drive` with `--workers` driver threads against a real stack on
  loopback (embedded redis-server, the broker, one actor with one CPU thread serving a tiny
  Llama-style model with a word-level tokenizer, built here), every response generated, scored
  and fed back. No learner: the broker's back-pressure is off (`max_stream_backlog = 0`), so
  training never stalls the drivers and the learner takes no CPU from them on a small machine.
- `scoring_only`: the same reward and scorer without the stack, `--workers` threads each handing
  one response to the scorer and waiting for its reward: the limit the judge sets alone.

Figures per setting: responses rewarded per second (from the first response handed to the scorer
to the last reward), and p50/p99 of the time from a response to its reward (its wait in the
scorer's queue, its batch, the judge). Each prompt is distinct, so the judge's cache of identical
requests never answers (a real policy's sampled responses rarely repeat; the tiny model's often
would). Medians over `--repeats`, the settings interleaved within each repeat so that the
machine's changing speed falls on all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.stats import percentiles
from dataset_driver.data import PromptOrder, PromptRecord
from dataset_driver.driver import BATCHES_IN_FLIGHT, BatchingScorer, DriverProgress, Sampling, drive, item_for
from ppoz.flags import add_json_flag, add_repeats_flag
from rewards.composite import CompositeReward, Item, Scored

log = logging.getLogger(__name__)

RULE = "first_word"  # the rule reward of the ceiling: cheap, as a verifiable reward is
PROMPT_WORDS = 12  # words per prompt, from the tiny model's vocabulary
N_PROMPTS = 20_000  # more than a run at the ceiling takes, so no prompt is judged twice in one run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--latency", type=float, default=0.5, help="seconds the judge stand-in takes to answer each request, as a remote LLM (default: 0.5)"
    )
    parser.add_argument(
        "--concurrency",
        default="1,8,32",
        help="the judge_concurrency settings to compare, comma-separated: judge requests in flight at once (default: 1,8,32)",
    )
    parser.add_argument(
        "--workers", type=int, default=16, help="driver threads, each with its own client and task ([train] workers; default: 16)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="how long the drivers take new prompts in each end-to-end measurement; responses already taken then finish (default: 8)",
    )
    parser.add_argument(
        "--scoring-seconds",
        type=float,
        default=4.0,
        help="the same for each measurement of the scoring path alone (default: 4)",
    )
    add_repeats_flag(parser, "measurements of each setting; the figures are their medians (default: 3)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens per response in the end-to-end measurements (default: 8)")
    parser.add_argument("--scoring-only", action="store_true", help="measure the scoring path alone: no stack, no model")
    add_json_flag(parser, "print the figures as one JSON object, the last line (the stack's processes may print above it)")


class BenchError(RuntimeError):
    """The benchmark could not measure (the stack did not start, a measurement passed its deadline)."""


@dataclass(frozen=True)
class Setting:
    concurrency: int  # judge requests in flight at once; 0: the rule reward, no judge
    batches_in_flight: int = BATCHES_IN_FLIGHT  # the scorer's; 1: one batch at a time, as before 3f5aa48

    @property
    def name(self) -> str:
        one_batch = "_one_batch" if self.batches_in_flight == 1 else ""
        return (f"judge_c{self.concurrency}" if self.concurrency else "rule") + one_batch

    @property
    def label(self) -> str:
        one_batch = ", 1 batch" if self.batches_in_flight == 1 else ""
        return (f"judge, concurrency {self.concurrency}" if self.concurrency else "rule reward (no judge)") + one_batch


class TimedScorer(BatchingScorer):
    """The drivers' scorer, also timing each response from its hand-over to its reward."""

    def __init__(self, reward: CompositeReward, max_batch: int, batches_in_flight: int) -> None:
        self._lock = threading.Lock()
        self.timings: list[tuple[float, float]] = []  # (handed over, rewarded) per rewarded response
        self.unrewarded = 0
        super().__init__(reward, max_batch=max_batch, batches_in_flight=batches_in_flight)

    def submit(self, item: Item) -> Future[Scored]:
        handed = time.perf_counter()
        future = super().submit(item)
        future.add_done_callback(lambda done: self._done(handed, done))
        return future

    def _done(self, handed: float, future: Future[Scored]) -> None:
        now = time.perf_counter()
        with self._lock:
            if future.result().reward is None:
                self.unrewarded += 1
            else:
                self.timings.append((handed, now))

    def figures(self) -> dict[str, float]:
        with self._lock:
            timings = list(self.timings)
        if not timings:
            raise BenchError(f"no response was rewarded ({self.unrewarded} unrewarded)")
        span = max(done for _, done in timings) - min(handed for handed, _ in timings)
        waits = percentiles([(done - handed) * 1000 for handed, done in timings])
        return {
            "rewarded": len(timings),
            "rewarded_per_s": len(timings) / max(span, 1e-9),
            "p50_ms": waits["p50_ms"],
            "p99_ms": waits["p99_ms"],
            "unrewarded": self.unrewarded,
        }


Load = Callable[[TimedScorer, threading.Event], None]  # hands responses to the scorer until the event is set


def prompts(n: int, seed: int = 0) -> list[PromptRecord]:
    """n distinct prompts of the tiny model's words, each with a word as its ground truth."""
    from models.tiny_models import WORDS

    rng = random.Random(seed)
    seen: set[str] = set()
    records: list[PromptRecord] = []
    while len(records) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
        if text not in seen:
            seen.add(text)
            records.append(PromptRecord(text, rng.choice(WORDS), "words", {}, f"prompt {len(records)}"))
    return records


def reward_for(setting: Setting, base_url: str, workers: int, latency_s: float) -> CompositeReward:
    """The reward `ppoz train` builds for this setting (dataset_driver/run.py `build_reward`)."""
    from dataset_driver.config import TrainConfig
    from dataset_driver.run import build_reward

    judged = setting.concurrency > 0
    cfg = TrainConfig(
        workers=workers,
        reward_fn="" if judged else RULE,
        judge_model="stand-in" if judged else "",
        judge_base_url=base_url,
        judge_concurrency=max(1, setting.concurrency),
        judge_timeout_s=latency_s + 30.0,
    )
    return build_reward(cfg)


def measure(setting: Setting, args: argparse.Namespace, load: Load, seconds: float) -> dict[str, Any]:
    """Run `load` (which hands responses to the scorer until the event is set) for `seconds` against
    this setting's reward and a fresh judge stand-in; the figures."""
    from tools.bench.judge_stand_in import chat_server, scoring

    with chat_server(scoring(args.latency)) as server:
        reward = reward_for(setting, server.base_url, args.workers, args.latency)
        scorer = TimedScorer(reward, max(args.workers, 1), setting.batches_in_flight)  # as ppoz train sets it (dataset_driver/run.py)
        stop = threading.Event()
        timer = threading.Timer(seconds, stop.set)
        timer.daemon = True
        failed: list[BaseException] = []

        def run() -> None:
            try:
                load(scorer, stop)
            except Exception as e:  # noqa: BLE001 - reported below, in the caller's thread
                failed.append(e)

        worker = threading.Thread(target=run, name="bench-load", daemon=True)
        timer.start()
        worker.start()
        # After `seconds` the responses already taken still get their rewards: at concurrency 1 that
        # is a whole batch of `workers` judge requests one after another, each up to its timeout.
        deadline = seconds + reward_timeout_s(args) + 60.0
        worker.join(deadline)
        timer.cancel()
        scorer.close()
        if reward.judge is not None:
            reward.judge.close()
        if worker.is_alive():
            raise BenchError(f"{setting.label}: the measurement did not finish within {deadline:.0f} s")
        if failed:
            raise BenchError(f"{setting.label}: {type(failed[0]).__name__}: {failed[0]}") from failed[0]
        figures = scorer.figures()
        figures["most_in_flight"] = server.most_in_flight  # judge requests the stand-in held at once
        figures["cache_hits"] = reward.judge.counts["cache_hits"] if reward.judge is not None else 0
    return figures


def reward_timeout_s(args: argparse.Namespace) -> float:
    """The longest a response may wait for its reward: a batch of `workers` judged one at a time, its own last, and slack."""
    return 2 * args.workers * args.latency + 60.0


def scoring_load(records: list[PromptRecord], args: argparse.Namespace) -> Load:
    """`workers` threads, each handing the scorer one response and waiting for its reward, until stopped."""
    positions = itertools.cycle(range(len(records)))  # a rule reward outruns any prompt list; a judge's run never wraps
    lock = threading.Lock()
    timeout = reward_timeout_s(args)

    def load(scorer: TimedScorer, stop: threading.Event) -> None:
        failed: list[Exception] = []

        def work() -> None:
            try:
                while not stop.is_set():
                    with lock:
                        record = records[next(positions)]
                    scorer.submit(item_for(record, str(record.ground_truth))).result(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a reward that never came: the measurement fails, named
                failed.append(e)

        threads = [threading.Thread(target=work, name=f"scoring-{i}", daemon=True) for i in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 60.0)
        if failed:
            raise BenchError(f"a scoring thread failed: {type(failed[0]).__name__}: {failed[0]}")

    return load


def driver_load(frontend: str, records: list[PromptRecord], args: argparse.Namespace, seed: int) -> Load:
    """The dataset drivers (`dataset_driver.driver.drive`) against the stack, until stopped."""

    def load(scorer: TimedScorer, stop: threading.Event) -> None:
        progress = DriverProgress()
        drive(
            frontend,
            records,
            PromptOrder(len(records), epochs=0, seed=seed),
            scorer,
            Sampling(max_new_tokens=args.new_tokens),
            workers=args.workers,
            stop=stop,
            deadline_s=60.0,
            progress=progress,
            seed=seed,
            reward_timeout_s=reward_timeout_s(args),
        )
        if progress.stopped_workers:
            raise BenchError(f"driver workers stopped: {progress.stopped_workers[0]}")
        if progress.errors:
            log.warning("%d responses unrewarded; first: %s", progress.unrewarded, progress.errors[0])

    return load


@contextlib.contextmanager
def stack(model_dir: str, workers: int, tmp: Path) -> Iterator[str]:
    """Embedded Redis, the broker and one actor serving `model_dir`, as `ppoz up` starts them; the client endpoint."""
    from ppoz.ports import free_port
    from ppoz.up import UpConfig
    from tools.harness import wait_for_actor, watched_stack

    config = tmp / "stack.toml"
    config.write_text(
        f'[broker]\nfrontend = "tcp://127.0.0.1:{free_port()}"\nbackend = "tcp://127.0.0.1:{free_port()}"\n'
        "segment_len = 1\nmax_stream_backlog = 0\n"  # one transition per turn; no learner, so no back-pressure
        f"[actor]\ncredits = {workers}\nmax_generate_rows = {workers}\n"  # every driver's request decoded at once
    )
    # One CPU thread for the actor: with `ppoz up`'s default (the cores shared among its torch processes:
    # all of them for a lone actor) its threads spun against the drivers' own process, and on 2 cores the
    # rule reward's ceiling fell from 85-103 to 5-29 responses/s. `ppoz train` on 2 cores runs the actor
    # and the learner, one thread each.
    up = UpConfig(learner=False, actors=1, cpu_threads=1, on_failure="stop", stop_timeout_s=30.0, ready_timeout_s=120.0)
    with watched_stack(up, str(config), "warning", model=model_dir) as running:
        if not wait_for_actor(running, 180.0, period=0.2):
            raise BenchError(f"the actor did not register within 180 s (failed: {running.supervisor.failed})")
        yield running.client_broker
        if running.supervisor.failed:
            raise BenchError(f"the stack's {running.supervisor.failed} died during the benchmark")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of a setting's runs, and the runs."""
    keys = ("rewarded_per_s", "p50_ms", "p99_ms")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["range_per_s"] = [min(r["rewarded_per_s"] for r in runs), max(r["rewarded_per_s"] for r in runs)]
    out["unrewarded"] = sum(r["unrewarded"] for r in runs)
    out["most_in_flight"] = max(r["most_in_flight"] for r in runs)
    out["cache_hits"] = sum(r["cache_hits"] for r in runs)
    out["runs"] = runs
    return out


def ratios(figures: dict[str, dict[str, Any]], settings: list[Setting]) -> dict[str, float]:
    """Each judge setting's throughput against the first (lowest) concurrency's, and against the rule reward's;
    the scorer with its batches in flight against one batch at a time."""
    judged = [s for s in settings if s.concurrency and s.batches_in_flight != 1]
    out: dict[str, float] = {}
    for s in judged[1:]:
        out[f"{s.name}/{judged[0].name}"] = figures[s.name]["rewarded_per_s"] / figures[judged[0].name]["rewarded_per_s"]
    for s in judged:
        out[f"{s.name}/rule"] = figures[s.name]["rewarded_per_s"] / figures["rule"]["rewarded_per_s"]
    for s in settings:
        if s.batches_in_flight == 1:
            pooled = Setting(s.concurrency).name
            out[f"{pooled}/{s.name}"] = figures[pooled]["rewarded_per_s"] / figures[s.name]["rewarded_per_s"]
    return out


def run_all(args: argparse.Namespace, settings: list[Setting]) -> dict[str, Any]:
    records = prompts(N_PROMPTS)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"scoring_only": {}, "end_to_end": {}}
    total = args.repeats * len(settings)

    def one(kind: str, setting: Setting, load: Load, seconds: float) -> None:
        got = measure(setting, args, load, seconds)
        runs[kind].setdefault(setting.name, []).append(got)
        done = sum(len(v) for v in runs[kind].values())
        log.info(
            "%s %d/%d, %s: %.1f rewarded/s, p50 %.0f ms, p99 %.0f ms",
            kind,
            done,
            total,
            setting.label,
            got["rewarded_per_s"],
            got["p50_ms"],
            got["p99_ms"],
        )

    for _ in range(args.repeats):
        for setting in settings:
            one("scoring_only", setting, scoring_load(records, args), args.scoring_seconds)
    if not args.scoring_only:
        from models.tiny_models import build_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            model = str(build_tiny_model(Path(tmp) / "words-llama", "llama", tokenizer="words"))
            log.info("starting the stack: embedded redis-server, broker, one actor serving %s", model)
            with stack(model, args.workers, Path(tmp)) as frontend:
                log.info("warming up the actor (2 s, not counted)")
                measure(Setting(0), args, driver_load(frontend, records, args, seed=999), 2.0)
                for repeat in range(args.repeats):
                    for setting in settings:
                        one("end_to_end", setting, driver_load(frontend, records, args, seed=repeat), args.seconds)
    result: dict[str, Any] = {}
    for kind, by_setting in runs.items():
        if by_setting:
            figures = {name: summarise(r) for name, r in by_setting.items()}
            for s in settings:  # what no implementation can beat: min(concurrency, workers) requests per latency
                bounded = s.concurrency and args.latency > 0
                figures[s.name]["bound_per_s"] = min(s.concurrency, args.workers) / args.latency if bounded else None
            result[kind] = figures
            result[f"ratios_{kind}"] = ratios(figures, settings)
    return result


def main(args: argparse.Namespace) -> int:
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"ppoz bench drivers: --concurrency must be comma-separated counts, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1 or min(args.workers, args.repeats, args.new_tokens) < 1:
        raise SystemExit("ppoz bench drivers: --concurrency, --workers, --repeats and --new-tokens must be positive")
    if args.latency < 0 or args.seconds <= 0 or args.scoring_seconds <= 0:
        raise SystemExit("ppoz bench drivers: --seconds and --scoring-seconds must be positive, --latency 0 or more")
    for noisy in ("httpx", "httpx2", "openai", "train", "client", "ppoz.up", "ppoz.supervisor", "common"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # the openai client's httpx logs every request at info
    # and the largest concurrency with the scorer taking one batch at a time (the drivers' scorer before 3f5aa48)
    settings = [Setting(0), *(Setting(c) for c in levels), Setting(levels[-1], batches_in_flight=1)]
    started = time.monotonic()
    try:
        result = run_all(args, settings)
    except BenchError as e:
        raise SystemExit(f"ppoz bench drivers: {e}") from e
    flags = ("latency", "workers", "seconds", "scoring_seconds", "repeats", "new_tokens")
    result["setup"] = {name: getattr(args, name) for name in flags} | {
        "concurrency": levels,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result) if args.json else tables(result, settings, args))
    return 0


def tables(result: dict[str, Any], settings: list[Setting], args: argparse.Namespace) -> str:
    """The figures as a table per measurement, with the ratios under each."""
    lines = [f"{args.workers} driver workers; the judge stand-in answers in {args.latency:g} s; medians of {args.repeats}"]
    for kind in ("end_to_end", "scoring_only"):
        if kind not in result:
            continue
        header = f"{'setting':<26}{'rewarded/s':>12}{'bound/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'in flight':>11}"
        lines += ["", kind.replace("_", " "), header]
        for s in settings:
            f = result[kind][s.name]
            bound = "" if f["bound_per_s"] is None else f"{f['bound_per_s']:.1f}"
            in_flight = str(f["most_in_flight"]) if s.concurrency else ""
            lines.append(f"{s.label:<26}{f['rewarded_per_s']:>12.1f}{bound:>10}{f['p50_ms']:>10.4g}{f['p99_ms']:>10.4g}{in_flight:>11}")
        lines.append("  " + ", ".join(f"{k} {v:.3g}x" for k, v in result[f"ratios_{kind}"].items()))
    return "\n".join(lines)
