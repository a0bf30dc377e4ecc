"""`ppoz bench train`: PPOZ's training loop against Hugging Face trl's GRPOTrainer on the same work and budget.

Legs, each given the same wall-clock budget (`--seconds`) on this machine:
- `ppoz`: `ppoz demo --task arithmetic --advantage grpo` as a process (its stack: embedded Redis, the
  broker, one actor, the learner, the driver workers), whose last line is its summary;
- `trl`: trl's `GRPOTrainer` on the same work (ppoz/bench/trl_grpo.py), run by the Python of a virtual
  environment of its own that this bench creates on first use (`--trl-venv`): a `.pth` file there
  puts this environment's packages on its path, so torch and transformers are the very versions the
  ppoz leg runs, and trl and what it needs besides (datasets, ...) are installed beside them, pinned so
  that pip changes none of this environment's packages. trl is never a dependency of PPOZ.

The work is the arithmetic demo's (ppoz/demo_arithmetic.py): the tiny numbers-llama model and its
weights, the 25 sums for training and validation, the `first_word` reward, 4 responses per sum, 2 new
tokens at temperature 1, all weights at learning rate 3e-4, 32 responses per update in minibatches of 16,
2 passes over each batch, clip 0.2, a KL penalty to the reference of 0.001 in the loss (k3: PPOZ's GRPO
default, trl's beta), advantages scaled by the group's std (both defaults). What still differs is each
trainer's own: PPOZ's learner stops an update's passes past target_kl and has a dual clip, and its actor
samples while the learner trains (policy lag, stale samples dropped); trl alternates the two.

Figures per leg, medians of `--repeats` runs with min and max, legs alternating (A B, B A, A B, ...):
- responses/s: responses generated for training over the training seconds (ppoz: the summary's `samples`
  over its `seconds`, the drivers' time; trl: optimizer steps x 32 over the time from the first step
  to the stop);
- validation reward (greedy, 2 tokens, on the 25 sums) before and after;
- the first time (seconds of training) a leg reached 0.7. The legs measure it differently, and the table
  says which: trl validates greedily every ~15 s of training; the ppoz demo does not validate while it
  trains, so its figure is the first progress row (every `--report-every` s) whose moving training reward
  (the drivers' mean of the last 100 sampled responses, at temperature 1) is at least 0.7;
- CPU cores used: CPU seconds (user + system) over the leg's wall seconds, the process and every
  descendant it waited for (resource.getrusage(RUSAGE_CHILDREN) around the process);
- peak memory: the largest resident set of any one process of the leg (ru_maxrss of the children);
  the ppoz leg runs several processes at once, so its total is more than this.
Threads: the ppoz leg's processes share the cores (OMP_NUM_THREADS, ppoz/up.py: the cores over the torch
processes, 1 each for the actor and the learner on 2 cores); the trl leg is one process on torch's default
(every core) unless `--trl-threads` says otherwise. On a busy machine a process with more torch threads than
free cores slows down far more than one thread would: another reason to run the bench on an idle machine.
The budget is counted the same way for both legs: from the start of the leg's process (the ppoz demo
starts its timer before it starts its stack; the trl runner before it imports trl), so model loading,
the stack's start and the first validation are inside it for both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppoz.bench import load_at_start

log = logging.getLogger(__name__)

LEGS = ("ppoz", "trl")
TRL_VERSION = "1.16.0"
DEFAULT_TRL_VENV = Path.home() / ".cache" / "ppoz" / "bench-trl-venv"
TARGET = 0.7  # the validation (trl) or moving training reward (ppoz) whose first time is reported
PPOZ_REPORT_EVERY_S = 5.0  # the ppoz demo's progress rows (progress.jsonl), which its first time at TARGET is read from
MEASURES = {
    "ppoz": "moving training reward (mean of the last 100 sampled responses, temperature 1), "
    f"progress.jsonl every {PPOZ_REPORT_EVERY_S:g} s",
    "trl": "greedy validation reward on the 25 sums, every ~15 s of training",
}
PEAK_MEASURE = "the largest resident set of any one process of the leg (ru_maxrss); the ppoz leg runs several at once, so its total is more"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=306.0, help="wall-clock budget of every run of a leg (default: 306)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every leg, in alternating order (default: 3)")
    parser.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)} (default: all)")
    parser.add_argument(
        "--trl-venv",
        default=str(DEFAULT_TRL_VENV),
        help=f"the trl leg's virtual environment, created with trl {TRL_VERSION} on first use (default: {DEFAULT_TRL_VENV})",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="the trl leg's torch CPU threads (default: 0, torch's default: every core, what a trl user gets; "
        "the ppoz leg's processes share the cores by OMP_NUM_THREADS, ppoz/up.py)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


# --- the trl leg's environment ------------------------------------------------------------------
def venv_python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")


def this_environment_dirs() -> list[str]:
    """This environment's package directories (pure and platform), in order, once each."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def pins() -> str:
    """Every distribution installed here as `name==version`: pip's constraints for the trl environment, so that
    installing trl changes none of the packages it shares with this one (it installs only what is missing)."""
    from importlib import metadata

    lines = set()
    for dist in metadata.distributions():
        name, version = dist.metadata["Name"], dist.version
        if name and version and name.lower() != "ppoz":
            lines.add(f"{name}=={version}")
    return "\n".join(sorted(lines, key=str.lower)) + "\n"


def _probe(python: Path) -> dict[str, Any] | None:
    """trl's, torch's and transformers' versions as the trl environment's Python sees them; None without trl."""
    code = (
        "import json, torch, transformers\n"
        "try:\n    import trl; v = trl.__version__\nexcept ImportError:\n    v = None\n"
        "print(json.dumps({'trl': v, 'torch': torch.__version__, 'transformers': transformers.__version__}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return None
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return None


def _run_shown(command: list[str], what: str) -> None:
    """Run an install step with its output shown as it comes; a failure names the command."""
    print(f"ppoz bench train: {what}: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    except OSError as e:
        raise SystemExit(f"ppoz bench train: {what} failed to start ({e}): {' '.join(command)}") from e
    if done.returncode != 0:
        raise SystemExit(f"ppoz bench train: {what} failed (exit {done.returncode}): {' '.join(command)}")


def ensure_trl(venv: Path) -> Path:
    """The trl environment's Python, with trl TRL_VERSION and this environment's torch and transformers."""
    import torch
    import transformers

    python = venv_python(venv)
    if not python.exists():
        _run_shown([sys.executable, "-m", "venv", str(venv)], f"creating the trl leg's environment in {venv}")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # site.addsitedir, not a plain path line: it also reads the .pth files there (PPOZ's editable install)
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in this_environment_dirs())
    pth = Path(purelib) / "ppoz_environment.pth"
    if not pth.exists() or pth.read_text() != lines:
        pth.write_text(lines)
    found = _probe(python)
    if found is None or found["trl"] != TRL_VERSION:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="ppoz-pins-", delete=False) as f:
            f.write(pins())
        try:
            command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", f"trl=={TRL_VERSION}", "-c", f.name]
            _run_shown(command, f"installing trl {TRL_VERSION} into {venv} (once)")
        finally:
            os.unlink(f.name)
        found = _probe(python)
    expected = {"trl": TRL_VERSION, "torch": torch.__version__, "transformers": transformers.__version__}
    if found != expected:
        raise SystemExit(f"ppoz bench train: the trl environment {venv} has {found}, expected {expected}; remove it to build it anew")
    return python


# --- running a leg -------------------------------------------------------------------------------
@dataclass
class LegRun:
    samples: int  # responses generated for training
    seconds: float  # training seconds
    val_before: float | None
    val_after: float | None
    first_at_target_s: float | None
    wall_s: float  # the leg's process, start to exit
    cpu_s: float  # user + system of the process and the descendants it waited for
    peak_rss_mb: float  # the largest resident set of any one of those processes
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def responses_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "responses_per_s": round(self.responses_per_s, 2),
            "samples": self.samples,
            "seconds": self.seconds,
            "val_before": self.val_before,
            "val_after": self.val_after,
            f"first_at_{TARGET}_s": self.first_at_target_s,
            "wall_s": round(self.wall_s, 1),
            "cpu_s": round(self.cpu_s, 1),
            "cores": round(self.cores, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
        }


def run_process(command: list[str], name: str, timeout_s: float) -> tuple[list[str], int, float, resource.struct_rusage]:
    """Run a leg's process, its output echoed to stderr line by line as it comes. Its lines, exit code, wall
    seconds and resource use (os.wait4: the process and every descendant it waited for, this leg's alone)."""
    lines: list[str] = []
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1)
    killer = threading.Timer(timeout_s, process.kill)  # a leg that hangs must not hang the bench
    killer.daemon = True
    killer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            print(f"  {name} | {line}", file=sys.stderr, flush=True)
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        killer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage: Popen must not wait again
    return lines, process.returncode, time.monotonic() - started, usage


def last_json(lines: list[str]) -> dict[str, Any] | None:
    """The last line that is a JSON object (a leg's summary; its processes may print around it)."""
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def first_time_at(rows: list[dict[str, Any]], key: str = "reward_mean", target: float = TARGET) -> float | None:
    """The `time` of the first row whose `key` is at least `target` (None if none is)."""
    for row in rows:
        value = row.get(key)
        if value is not None and value >= target:
            return float(row["time"])
    return None


def _leg_run(name: str, command: list[str], seconds: float, first_at: Any) -> LegRun:
    lines, code, wall, usage = run_process(command, name, timeout_s=seconds + 900)
    summary = last_json(lines)
    if code != 0 or summary is None:
        tail = " / ".join(lines[-3:])[-400:]
        raise RuntimeError(f"exit {code}{'' if summary else ', no JSON summary'}: {tail}")
    return LegRun(
        samples=int(summary["samples"]),
        seconds=float(summary["seconds"]),
        val_before=summary.get("val_before"),
        val_after=summary.get("val_after"),
        first_at_target_s=first_at(summary),
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_mb=usage.ru_maxrss / 1024,  # kilobytes on Linux
        summary=summary,
    )


def run_ppoz(seconds: float) -> LegRun:
    with tempfile.TemporaryDirectory(prefix="ppoz-bench-train-") as out:
        command = [sys.executable, "-m", "ppoz.cli", "demo", "--task", "arithmetic", "--advantage", "grpo"]
        command += ["--minutes", repr(seconds / 60), "--json", "--out", out, "--report-every", str(PPOZ_REPORT_EVERY_S)]

        def first_at(_: dict[str, Any]) -> float | None:
            progress = Path(out) / "train" / "progress.jsonl"
            rows = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()] if progress.exists() else []
            return first_time_at(rows)

        return _leg_run("ppoz", command, seconds, first_at)


def run_trl(python: Path, seconds: float, threads: int = 0) -> LegRun:
    command = [str(python), "-m", "ppoz.bench.trl_grpo", "--seconds", repr(seconds), "--threads", str(threads)]
    return _leg_run("trl", command, seconds, lambda summary: summary.get(f"first_at_{TARGET}_s"))


# --- figures -------------------------------------------------------------------------------------
def leg_order(legs: list[str], repeats: int) -> list[str]:
    """Legs alternating: A B, B A, A B, ... (each repeat reversed from the last), so drift hits both alike."""
    order: list[str] = []
    for repeat in range(repeats):
        order += legs if repeat % 2 == 0 else legs[::-1]
    return order


def _spread(values: list[float | None]) -> dict[str, float] | None:
    """Median, min and max of the values given (None ones left out); None if there are none."""
    known = [v for v in values if v is not None]
    return {"median": statistics.median(known), "min": min(known), "max": max(known)} if known else None


def summarise(runs: list[LegRun]) -> dict[str, Any]:
    """Medians with min and max over a leg's runs; the first time at the target over the runs that reached it."""
    reached: list[float | None] = [r.first_at_target_s for r in runs if r.first_at_target_s is not None]
    return {
        "runs": len(runs),
        "responses_per_s": _spread([r.responses_per_s for r in runs]),
        "val_before": _spread([r.val_before for r in runs]),
        "val_after": _spread([r.val_after for r in runs]),
        f"first_at_{TARGET}_s": _spread(reached),
        "reached_target": len(reached),
        "cores": _spread([r.cores for r in runs]),
        "peak_rss_mb": _spread([r.peak_rss_mb for r in runs]),
        "seconds": statistics.median(r.seconds for r in runs),
        "samples": statistics.median(r.samples for r in runs),
    }


def ratio(result: dict[str, Any], top: str = "ppoz", bottom: str = "trl") -> float | None:
    """top's median responses/s over bottom's (None unless both ran)."""
    if top not in result or bottom not in result:
        return None
    below = result[bottom]["responses_per_s"]["median"]
    return result[top]["responses_per_s"]["median"] / below if below else None


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers

    legs = [leg for leg in args.legs.split(",") if leg]
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown or not legs:
        raise SystemExit(f"ppoz bench train: unknown legs {', '.join(unknown) or '(none given)'}; known: {', '.join(LEGS)}")
    if args.repeats < 1 or not 0 < args.seconds <= 24 * 3600 or args.trl_threads < 0:
        given = f"got --repeats {args.repeats}, --seconds {args.seconds:g}, --trl-threads {args.trl_threads}"
        raise SystemExit(f"ppoz bench train: --repeats must be at least 1, --seconds positive and --trl-threads not negative; {given}")
    load = load_at_start("train")
    python = ensure_trl(Path(args.trl_venv).expanduser()) if "trl" in legs else None
    runs: dict[str, list[LegRun]] = {leg: [] for leg in legs}
    errors: dict[str, str] = {}
    order = leg_order(legs, args.repeats)
    for i, leg in enumerate(order):
        if leg in errors:
            continue
        print(f"ppoz bench train: {leg}, run {i + 1} of {len(order)}, {args.seconds:g} s", file=sys.stderr, flush=True)
        try:
            if leg == "ppoz":
                run = run_ppoz(args.seconds)
            else:
                assert python is not None  # made above when trl is among the legs
                run = run_trl(python, args.seconds, args.trl_threads)
        except Exception as e:  # noqa: BLE001 - a leg that fails is reported beside the other's figures
            log.warning("%s failed: %s: %s", leg, type(e).__name__, e)
            errors[leg] = f"{type(e).__name__}: {e}"
            continue
        runs[leg].append(run)
    result: dict[str, Any] = {leg: summarise(runs[leg]) for leg in legs if runs[leg]}
    result["ppoz_over_trl"] = ratio(result)
    result["runs"] = {leg: [r.figures() for r in runs[leg]] for leg in legs}
    result["errors"] = errors
    result["measures"] = {f"first_at_{TARGET}_s": {leg: MEASURES[leg] for leg in legs}, "peak_rss_mb": PEAK_MEASURE}
    result["setup"] = {
        "seconds": args.seconds,
        "repeats": args.repeats,
        "order": order,
        "load_average_at_start": load,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": TRL_VERSION if python else None,
        "trl_torch_threads": runs["trl"][-1].summary.get("torch_threads") if runs.get("trl") else None,
    }
    if args.json:
        print(json.dumps(result))
        return 0 if not errors else 1
    s = result["setup"]
    print(
        f"the arithmetic demo's work, {s['seconds']:g} s per run, medians of {args.repeats} runs (min-max); {s['machine']}; "
        f"load average {load:.2f} at start; torch {s['torch']}, transformers {s['transformers']}"
        + (f", trl {s['trl']}" if s["trl"] else "")
        + (f"; trl leg on {s['trl_torch_threads']} torch threads" if s["trl_torch_threads"] else "")
    )
    print(f"{'leg':<6}{'responses/s':>12}{'(min-max)':>16}{'val before':>11}{'val after':>10}{'(min-max)':>14}{'first at 0.7':>13}", end="")
    print(f"{'cores':>7}{'peak MB':>9}")
    for leg in legs:
        if leg not in result:
            print(f"{leg:<6}  failed: {errors.get(leg, '')[:200]}")
            continue
        v = result[leg]
        rate, after, first = v["responses_per_s"], v["val_after"], v[f"first_at_{TARGET}_s"]
        rate_spread = f"({rate['min']:.1f}-{rate['max']:.1f})"
        before = f"{v['val_before']['median']:.2f}" if v["val_before"] else "-"
        after_text = f"{after['median']:.2f}" if after else "-"
        after_spread = f"({after['min']:.2f}-{after['max']:.2f})" if after else ""
        first_text = f"{first['median']:.0f} s ({v['reached_target']}/{v['runs']})" if first else f"- (0/{v['runs']})"
        print(
            f"{leg:<6}{rate['median']:>12.1f}{rate_spread:>16}{before:>11}{after_text:>10}{after_spread:>14}"
            f"{first_text:>13}{v['cores']['median']:>7.2f}{v['peak_rss_mb']['median']:>9.0f}"
        )
    if result["ppoz_over_trl"] is not None:
        print(f"ppoz / trl, median responses/s: {result['ppoz_over_trl']:.2f}x")
    print(f"first at {TARGET}, seconds of training:")
    for leg in legs:
        print(f"  {leg}: {MEASURES[leg]}")
    print(f"cores: CPU seconds over wall seconds of the leg's process tree; peak MB: {PEAK_MEASURE}")
    return 0 if not errors else 1
