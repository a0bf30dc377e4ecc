"""Soak: many simulated emulators against a full stack of real processes, for minutes.

    ppoz soak --clients 200 --minutes 10

starts an embedded redis-server (append-only), `ppoz broker`, one `ppoz actor`
serving a tiny LLM built locally, and `ppoz learner` training it, each its own
process, as `ppoz up` starts them (ppoz/up.py `started_stack`, watched by its
supervisor: a process that dies stops the run), then drives `--clients` emulators from one asyncio loop, one DEALER
socket each, as Kea does: attach, then episodes of ask -> step -> feedback,
detach at the end. Every `--window-s` seconds it records, for that window: steps
answered, errors, step latency percentiles (what a client waited for its
action), ask waits, and the resident memory of each process. At the end the
clients detach, the learner trains what is left, and the ledger
(tools/reliability/ledger.py) is read.

It passes when no client saw an error, the ledger balances, every process's
resident memory grew by at most `--rss-growth-mb` from the end of its warm-up
to the end (warm-up: the first window, where models load and allocator pools
fill; for the learner, until the first window that ends after its third update:
its first updates grow it by steps as the optimizer's state, the backward pass's
buffers and full-size rollouts appear, measured 408, 608, 722 MB after updates
1, 2, 3 and 719 to 735 MB after updates 4 to 6; the 10-minute soak's learner
stayed within +2 MB after minute 1), and the latency of the second half of the
run is within `--latency-drift` times that of the first (p50 and p99, both after
the first window). The exit code is 1 otherwise; `--json` prints the whole report.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import zmq.asyncio

from client import AsyncClient
from common.config import load, local_path
from common.learner_figures import Latest, read_latest
from common.redis_server import connect
from ppoz.flags import add_json_flag, add_seed_flag
from ppoz.ports import free_port
from ppoz.up import Stack, UpConfig
from tools.harness import wait_for_actor, watched_stack
from tools.reliability.fuzz import rss_kb
from tools.reliability.ledger import add_settle_flag, settle_ledger
from tools.reliability.output import ledger_and_steps_failures, print_report, run_as_script

log = logging.getLogger(__name__)

KEY_PREFIX = "soak"
LEARNER_WARMUP_UPDATES = 3  # the learner's memory settles after these (see the module's docstring)
SCREENS = [
    "MainActivity",
    "CartActivity",
    "SettingsActivity",
    "LoginActivity",
    "SearchActivity",
    "ProductActivity",
    "AboutActivity",
    "LicenceActivity",
]
WIDGETS = ["Cart", "Search", "Settings", "Login", "Back", "Buy", "About", "Share", "Menu", "Profile", "Help", "Filter"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=200, help="simulated emulators (default: 200)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients play (default: 10)")
    parser.add_argument("--window-s", type=float, default=60.0, help="length of one reporting window (default: 60)")
    add_seed_flag(parser)
    parser.add_argument(
        "--rss-growth-mb",
        type=float,
        default=150.0,
        help="largest accepted growth of any process's resident memory after the first window (default: 150)",
    )
    parser.add_argument(
        "--latency-drift",
        type=float,
        default=2.0,
        help="largest accepted ratio of the second half's step latency (p50, p99) to the first half's (default: 2)",
    )
    add_settle_flag(parser, 600.0)
    parser.add_argument("--keep", default="", type=local_path, help="keep the logs and checkpoints here (default: a temporary folder)")
    add_json_flag(parser, "print the report as one JSON object")


# --- the report ----------------------------------------------------------------------------------
@dataclass
class Window:
    end_s: float  # seconds since the clients started
    steps: int
    errors: int
    ask_waits: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    rss_mb: dict[str, float]
    learner_version: int = 0  # updates the learner had published by the window's end


@dataclass
class Report:
    clients: int
    seconds: float
    windows: list[Window] = field(default_factory=list)
    steps: int = 0
    acknowledged: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    ledger: str = ""
    ledger_balanced: bool = False
    rss_growth_mb: dict[str, float] = field(default_factory=dict)
    latency_ratio: dict[str, float] = field(default_factory=dict)  # second half / first half
    limits: dict[str, float] = field(default_factory=dict)

    def failures(self) -> list[str]:
        out = [f"{self.error_count} client errors, first: {self.errors[:3]}"] if self.error_count else []
        out += ledger_and_steps_failures(self.ledger_balanced, self.ledger, self.steps)
        for name, growth in self.rss_growth_mb.items():
            if growth > self.limits["rss_growth_mb"]:
                out.append(f"{name} resident memory grew by {growth:.0f} MB (limit {self.limits['rss_growth_mb']:.0f})")
        for name, ratio in self.latency_ratio.items():
            if ratio > self.limits["latency_drift"]:
                out.append(
                    f"step latency {name} of the second half is {ratio:.2f}x the first half's (limit {self.limits['latency_drift']})"
                )
        return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def warmed_window(windows: list[Window], process: str) -> Window:
    """The window whose end is `process`'s memory baseline: the first, or the learner's first after its warm-up updates.

    A learner that has not updated before the last window is measured from the first (its
    growth then includes its warm-up, and a failure says so by its size)."""
    if process != "learner":
        return windows[0]
    for window in windows[:-1]:
        if window.learner_version >= LEARNER_WARMUP_UPDATES:
            return window
    return windows[0]


def summarise(report: Report, latencies: list[tuple[float, float]]) -> None:
    """Memory growth after warm-up and the latency drift between the halves of the run."""
    if len(report.windows) >= 2:
        last = report.windows[-1].rss_mb
        for name in report.windows[0].rss_mb:
            if name in last:
                report.rss_growth_mb[name] = round(last[name] - warmed_window(report.windows, name).rss_mb[name], 1)
    warm = report.windows[0].end_s if len(report.windows) >= 3 else 0.0
    half = (warm + report.seconds) / 2
    early = [ms for t, ms in latencies if warm <= t < half]
    late = [ms for t, ms in latencies if t >= half]
    if early and late:
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            report.latency_ratio[name] = round(percentile(late, q) / max(percentile(early, q), 1e-3), 2)


def format_report(report: Report) -> str:
    lines = [
        f"soak: {report.clients} clients for {report.seconds:.0f} s",
        f"{'until':>7} {'steps':>7} {'steps/s':>8} {'errors':>6} {'waits':>6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
        f"{'learner v':>9}  RSS MB",
    ]
    previous = 0.0
    for w in report.windows:
        rate = w.steps / max(w.end_s - previous, 1e-9)
        previous = w.end_s
        rss = " ".join(f"{k} {v:.0f}" for k, v in w.rss_mb.items())
        lines.append(
            f"{w.end_s:>6.0f}s {w.steps:>7} {rate:>8.1f} {w.errors:>6} {w.ask_waits:>6} {w.p50_ms:>8.1f} {w.p95_ms:>8.1f} "
            f"{w.p99_ms:>8.1f} {w.learner_version:>9}  {rss}"
        )
    lines.append(f"steps {report.steps}, feedbacks acknowledged {report.acknowledged}, client errors {report.error_count}")
    lines.append(f"resident memory growth after warm-up (MB): {report.rss_growth_mb}")
    lines.append(f"step latency, second half / first half: {report.latency_ratio}")
    lines.append(f"ledger: {report.ledger} ({'balanced' if report.ledger_balanced else 'NOT balanced'})")
    failures = report.failures()
    lines.append("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return "\n".join(lines)


# --- the stack -----------------------------------------------------------------------------------
PROCESS_NAMES = {"actor-0": "actor", "redis-server": "redis"}  # the stack's component names -> the report's
REPORT_ORDER = ("broker", "actor", "learner", "redis")  # the order of the processes in a window's line


def stack_config(model: str, workdir: Path) -> str:
    """The soak's stack for `ppoz up`'s `started_stack`: Redis append-only, one actor serving the tiny model, the
    learner training all its weights on the CPU; a failed process stops the run rather than being restarted."""
    front, back, weights = free_port(), free_port(), free_port()
    return (
        f'[store]\nkey_prefix = "{KEY_PREFIX}"\n'
        f'[policy]\nmodel = "{model}"\nlora_rank = 0\nnormalisation = "token"\n'
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nmax_stream_backlog = 1024\n'
        '[actor]\ndevice = "cpu"\ncredits = 128\nmax_batch = 64\n'
        f'[learner]\ndevice = "cpu"\nweights_bind = "tcp://127.0.0.1:{weights}"\nrollout_batch = 256\nrollout_timeout_s = 5\n'
        f'policy_minibatch = 64\nmicro_batch = 64\nupdate_epochs = 1\ncheckpoint_dir = "{workdir / "ckpt"}"\nkeep_checkpoints = 2\n'
        'tensorboard_dir = ""\n'
        # One compute thread each: the actor and the learner share this machine's cores with the broker, Redis and
        # the clients, and torch's default (a thread per core in each) oversubscribes them.
        '[up]\nactors = 1\ncpu_threads = 1\non_failure = "stop"\nmax_restarts = 0\nstop_timeout_s = 60\n'
    )


class ProcessLogs(io.TextIOBase):
    """The stack's output, each line prefixed with its component's name (ppoz/supervisor.py), as one log file per
    process in `workdir`, named as the report names the process (broker.log, actor.log, learner.log)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # Each process's file from the start, as a process's own output file is: a quiet one's is there, empty.
        self.files: dict[str, IO[str]] = {name: (workdir / f"{name}.log").open("w") for name in ("broker", "actor", "learner")}
        self.partial = ""

    def write(self, text: str) -> int:
        if self.closed:  # a reader thread's last lines, after the stack stopped and the files closed
            return len(text)
        self.partial += text
        while "\n" in self.partial:
            line, self.partial = self.partial.split("\n", 1)
            name, _, said = line.partition(" | ")
            name = PROCESS_NAMES.get(name.strip(), name.strip())
            if name not in self.files:
                self.files[name] = (self.workdir / f"{name}.log").open("w")
            self.files[name].write(said + "\n")
        return len(text)

    def flush(self) -> None:
        for file in self.files.values():
            file.flush()

    def close(self) -> None:
        if self.closed:
            return
        super().close()  # flushes the files first
        for file in self.files.values():
            file.close()


def check_alive(stack: Stack) -> None:
    """RuntimeError naming the process that exited, with its last lines; the one whose death stopped the others
    first (the stack's supervisor stops them all on a death: [up] on_failure = "stop")."""
    supervisor = stack.supervisor
    exited = [c for c in supervisor.components if c.process is not None and c.process.poll() is not None]
    exited.sort(key=lambda c: c.name != supervisor.failed)
    if exited:
        c, tail = exited[0], "\n".join(exited[0].last_lines)
        raise RuntimeError(f"{PROCESS_NAMES.get(c.name, c.name)} exited with code {c.process.returncode if c.process else None}:\n{tail}")


def rss_mb(stack: Stack) -> dict[str, float]:
    """The resident memory of each process of the stack, Redis included, by the report's names."""
    supervisor = stack.supervisor
    pids = {c.name: c.pid for c in supervisor.components if c.pid is not None}
    pids.update((child.name, child.pid) for child in supervisor.adopted)
    named = {PROCESS_NAMES.get(name, name): pid for name, pid in pids.items()}
    ordered = sorted(named, key=lambda name: REPORT_ORDER.index(name) if name in REPORT_ORDER else len(REPORT_ORDER))
    return {name: round((rss_kb(named[name]) or 0) / 1024, 1) for name in ordered}


# --- the clients ---------------------------------------------------------------------------------
def observation(rng: random.Random, step: int) -> dict[str, Any]:
    """A Kea-shaped observation, 150 to 250 characters, 3 to 6 candidates.

    Short for a Kea prompt (1k-20k tokens): the soak measures the system over time, not the model,
    and the byte-level tiny model on a CPU would otherwise be the whole story.
    """
    screen = rng.choice(SCREENS)
    widgets = rng.sample(WIDGETS, rng.randint(3, 6))
    history = " ".join(f"Touch({rng.choice(WIDGETS)})" for _ in range(min(step, 2)))
    prompt = f"Testing app Shop. Screen: {screen}. Widgets: {', '.join(widgets)}. Recent: {history or 'none'}."
    return {"prompt": prompt, "question": " Next:", "action": [f" Touch({w})" for w in widgets]}


class Clients:
    """N emulators on one event loop; latencies and errors are recorded as they happen."""

    def __init__(self, frontend: str, n: int, seed: int) -> None:
        self.frontend = frontend
        self.n = n
        self.seed = seed
        self.started = 0.0
        self.latencies: list[tuple[float, float]] = []  # (seconds since start, step latency ms)
        self.errors: list[str] = []
        self.error_count = 0
        self.ask_waits = 0
        self.acknowledged = 0
        self.requests = 0  # every request the emulators made
        self.attempts = 0  # every send, retries included
        self.stopping = False

    async def run(self, seconds: float, on_window: Any, window_s: float, until: Callable[[], bool] | None = None) -> None:
        """Play for `seconds`, or until `until()` says to stop; `on_window(end_s)` every `window_s`."""
        ctx = zmq.asyncio.Context()
        self.started = time.monotonic()
        tasks = [asyncio.create_task(self._emulator(ctx, i)) for i in range(self.n)]
        next_window = window_s
        try:
            while time.monotonic() - self.started < seconds and not (until is not None and until()):
                await asyncio.sleep(min(1.0, max(0.0, self.started + next_window - time.monotonic())))
                if time.monotonic() - self.started >= next_window:
                    on_window(next_window)
                    next_window += window_s
        finally:
            self.stopping = True
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.term()

    def _error(self, e: BaseException) -> None:
        self.error_count += 1
        if len(self.errors) < 20:
            self.errors.append(f"{type(e).__name__}: {e}")

    async def _emulator(self, ctx: zmq.asyncio.Context, i: int) -> None:
        rng = random.Random(self.seed * 100_003 + i)
        client = AsyncClient(self.frontend, deadline=120.0, attempt_timeout=30.0, context=ctx)
        task_id = None
        try:
            await asyncio.sleep(rng.random() * 2)  # emulators do not boot in the same millisecond
            task_id = await client.attach()
            while not self.stopping:
                length = rng.randint(5, 20)
                for step in range(length):
                    if self.stopping:
                        break
                    ask = await client.ask(task_id)
                    if ask.get("status") == "wait":
                        self.ask_waits += 1
                        await asyncio.sleep(ask.get("retry_after_ms", 200) / 1000)
                        continue
                    sent = time.monotonic()
                    await client.step(task_id, observation(rng, step))
                    now = time.monotonic()
                    self.latencies.append((now - self.started, (now - sent) * 1000))
                    await asyncio.sleep(rng.uniform(0.0, 0.05))  # the emulator acts on the screen
                    done = step == length - 1
                    await client.feedback(task_id, rng.choice([1.0, 0.0, 0.0, -0.5]), done=done)
                    self.acknowledged += 1
        except Exception as e:  # noqa: BLE001 - every error is a finding
            self._error(e)
        finally:
            if task_id is not None:
                try:
                    await client.detach(task_id)
                except Exception as e:  # noqa: BLE001
                    self._error(e)
            self.requests += client.requests
            self.attempts += client.attempts
            await client.close()


# --- the run -------------------------------------------------------------------------------------
def run(clients: int, seconds: float, window_s: float, seed: int, workdir: Path, settle_s: float, limits: dict[str, float]) -> Report:
    from models.tiny_models import build_tiny_model

    report = Report(clients, seconds, limits=limits)
    model = str(build_tiny_model(workdir / "model", arch="llama", seed=seed))
    config = workdir / "stack.toml"
    config.write_text(stack_config(model, workdir))
    # Short path for the unix socket (at most 107 bytes). Each soak starts from the tiny model itself, not from a
    # checkpoint an earlier run left in a kept folder (--no-resume).
    up = replace(load(UpConfig, str(config)), redis_data_dir=tempfile.mkdtemp(prefix="ppoz-soak-"))
    try:
        with ProcessLogs(workdir) as logs, watched_stack(up, str(config), "warning", learner_flags=["--no-resume"], output=logs) as stack:
            _play(stack, clients, seconds, window_s, seed, settle_s, report)
    finally:
        shutil.rmtree(up.redis_data_dir, ignore_errors=True)
    return report


def _play(stack: Stack, clients: int, seconds: float, window_s: float, seed: int, settle_s: float, report: Report) -> None:
    """The clients against the running stack, a window at a time; then the ledger."""
    if not wait_for_actor(stack, 300.0):
        check_alive(stack)
        raise RuntimeError("no actor joined the broker within 300 s")
    driver = Clients(stack.client_broker, clients, seed)
    counted = {"steps": 0, "errors": 0, "waits": 0}
    figures_client = connect(stack.store.redis_url)

    def on_window(end_s: float) -> None:
        check_alive(stack)
        recent = [ms for t, ms in driver.latencies[counted["steps"] :]]
        report.windows.append(
            Window(
                end_s,
                len(recent),
                driver.error_count - counted["errors"],
                driver.ask_waits - counted["waits"],
                round(percentile(recent, 0.5), 1),
                round(percentile(recent, 0.95), 1),
                round(percentile(recent, 0.99), 1),
                rss_mb(stack),
                int(read_latest(figures_client, KEY_PREFIX).get(Latest.VERSION, 0)),
            )
        )
        counted.update(steps=len(driver.latencies), errors=driver.error_count, waits=driver.ask_waits)
        log.info("window ending %.0f s: %d steps, p99 %.1f ms", end_s, len(recent), report.windows[-1].p99_ms)

    try:
        asyncio.run(driver.run(seconds, on_window, window_s))
    finally:
        figures_client.close()
    report.steps, report.acknowledged = len(driver.latencies), driver.acknowledged
    report.errors, report.error_count = driver.errors, driver.error_count
    summarise(report, driver.latencies)
    client = connect(stack.store.redis_url)
    try:
        ledger = settle_ledger(client, KEY_PREFIX, driver.acknowledged, settle_s, lambda: check_alive(stack))
    finally:
        client.close()
    report.ledger, report.ledger_balanced = str(ledger), ledger.balanced


def main(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.minutes <= 0 or args.window_s <= 0:
        raise SystemExit("ppoz soak: --clients, --minutes and --window-s must be positive")
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ppoz-soak-work-"))
    workdir.mkdir(parents=True, exist_ok=True)
    limits = {"rss_growth_mb": args.rss_growth_mb, "latency_drift": args.latency_drift}
    try:
        report = run(args.clients, args.minutes * 60, args.window_s, args.seed, workdir, args.settle_s, limits)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return print_report(report, args.json, format_report)


if __name__ == "__main__":
    run_as_script("python -m tools.reliability.soak", __doc__, add_arguments, main, logging.INFO)
