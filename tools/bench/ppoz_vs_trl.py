"""`ppoz bench train`: PPOZ's training loop against Hugging Face trl's GRPOTrainer on the same work and budget.

Tasks (`--tasks`, tools/bench/train_tasks.py): `demo` (the arithmetic demo's sums, 2 new tokens), `long` (a digit
word said 16 to 255 times, 256 new tokens: responses of different lengths) and `real-shape` (the long task on
Qwen2.5-0.5B's shape with random weights: throughput only). For each task, legs, each given the same
wall-clock budget (`--seconds`, else the task's own) on this machine:
- `ppoz`: `ppoz train` with GRPO on the task as a process (tools/bench/train_leg.py: the stack of `ppoz demo
  --task arithmetic --advantage grpo`, embedded Redis, the broker, one actor, the learner, the driver workers),
  whose last line is its summary;
- `trl`: trl's `GRPOTrainer` on the same work (tools/bench/trl_grpo.py), run by the Python of a virtual
  environment of its own that this bench creates on first use (`--trl-venv`, tools/bench/trl_env.py: this
  environment's torch and transformers, trl beside them; trl is never a dependency of PPOZ), or by
  `--trl-python`, a Python that imports trl already.

Matched settings (both legs): the task's model and weights on `--device` in the dtype PPOZ's policy takes there
(bfloat16 weights on cuda, no autocast; float32 on cpu), prompts, reward and max_new_tokens, 4 responses per
prompt at temperature 1, all weights at the task's learning rate (constant), 32 responses per update in
minibatches of 16, 2 passes over each batch, clip 0.2, a KL penalty to the reference of 0.001 in the loss
(k3: PPOZ's GRPO default, trl's beta), token-mean loss, gradient norm clipped at 0.5, advantages scaled by the
group's std (both defaults); greedy validation on the task's held prompts every `--val-every-s` seconds of
training, before and after. What still differs is each trainer's own: PPOZ's learner stops an update's passes
past target_kl and has a dual clip, and its actor samples while the learner trains (policy lag, stale samples
dropped), its validation runs beside the drivers; trl alternates the three.

Figures per task and leg, medians of `--repeats` runs with min and max, legs alternating (A B, B A, A B, ...):
- responses/s and tokens/s: responses generated for training, and their tokens, over the training seconds
  (ppoz: the summary's `samples` and `response_tokens` over its `seconds`, the drivers' time; trl: those its
  reward function was given over the time from the first step to the stop, validation left out);
- validation reward (greedy, on the task's held prompts) before and after;
- the first time (seconds of training) a leg's validation reached the task's target (`first_at_target_s`);
- CPU cores used: CPU seconds (user + system) over the leg's wall seconds, the process and every
  descendant it waited for (os.wait4 on the leg's process);
- peak memory: the largest resident set of the leg's whole process tree at once (`peak_tree_mb`, sampled
  every TREE_SAMPLE_S from /proc), and of its largest process (`peak_rss_mb`, ru_maxrss).
- the ppoz learner's loop (`learner_cycle_shares`, from the summary's `learner_cycle`, learner_node/cycle.py):
  the share of its wall time reading the stream, idle (waiting for data), preparing batches (with the passes
  without gradients), updating, on checkpoints, publishing, and the rest, up to its last update.
Threads: the ppoz leg's processes share the cores (OMP_NUM_THREADS, ppoz/up.py: the cores over the torch
processes, 1 each for the actor and the learner on 2 cores); the trl leg is one process on torch's default
(every core) unless `--trl-threads` says otherwise. On a busy machine a process with more torch threads than
free cores slows down far more than one thread would: another reason to run the bench on an idle machine.
The budget is counted the same way for both legs: from the start of the leg's process after the model is
built (the ppoz leg before it starts its stack; the trl runner before it imports trl), so model loading, the
stack's start and the first validation are inside it for both. trl stops only between optimizer steps, so its
runs can outlast the budget; its rates are counted over its own training seconds.
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
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppoz.flags import add_device_flag, add_json_flag, add_repeats_flag
from tools.bench import load_at_start, measured_legs
from tools.bench.trl_env import DEFAULT_TRL_VENV, TRL_VERSION, ensure_trl, probe

if TYPE_CHECKING:
    from tools.bench.train_tasks import TrainTask

log = logging.getLogger(__name__)

LEGS = ("ppoz", "trl")
TREE_SAMPLE_S = 0.5  # how often a leg's process tree's resident memory is summed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tools.bench.train_tasks import TASKS

    budgets = ", ".join(f"{t.name} {t.seconds:g}" for t in TASKS.values())
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)} (default: all)")
    parser.add_argument(
        "--seconds", type=float, default=0.0, help=f"wall-clock budget of every run of a leg (default: the task's: {budgets})"
    )
    add_repeats_flag(parser, "runs of every leg, in alternating order (default: 3)")
    parser.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)} (default: all)")
    parser.add_argument(
        "--val-every-s", type=float, default=15.0, help="greedy validation every this many seconds of training (default: 15)"
    )
    parser.add_argument(
        "--trl-venv",
        default=str(DEFAULT_TRL_VENV),
        help=f"the trl leg's virtual environment, created with trl {TRL_VERSION} on first use (default: {DEFAULT_TRL_VENV})",
    )
    parser.add_argument(
        "--trl-python",
        default="",
        help="a Python that imports trl already, used as it is instead of --trl-venv (a machine without a package index)",
    )
    add_device_flag(
        parser,
        "both legs' device: auto (cuda if there is one; default), cpu or cuda; the weights in the dtype PPOZ's policy "
        "takes there (bfloat16 on cuda, float32 on cpu)",
        choices=("auto", "cpu", "cuda"),
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="the trl leg's torch CPU threads (default: 0, torch's default: every core, what a trl user gets; "
        "the ppoz leg's processes share the cores by OMP_NUM_THREADS, ppoz/up.py)",
    )
    add_json_flag(parser)


# --- running a leg -------------------------------------------------------------------------------
@dataclass
class LegRun:
    samples: int  # responses generated for training
    response_tokens: int  # their tokens
    seconds: float  # training seconds
    val_before: float | None
    val_after: float | None
    first_at_target_s: float | None
    wall_s: float  # the leg's process, start to exit
    cpu_s: float  # user + system of the process and the descendants it waited for
    peak_rss_mb: float  # the largest resident set of any one of those processes
    peak_tree_mb: float  # the largest resident set of the whole process tree at once
    summary: dict[str, Any] = field(default_factory=dict)
    cycle: dict[str, float] = field(default_factory=dict)  # the ppoz learner's seconds by part of its loop ({} for trl)

    @property
    def cycle_shares(self) -> dict[str, float]:
        """The learner's loop by part (read, idle, prepare, update, checkpoint, publish, other), as shares of its time."""
        total = sum(self.cycle.values())
        return {part: seconds / total for part, seconds in self.cycle.items()} if total > 0 else {}

    @property
    def responses_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "responses_per_s": round(self.responses_per_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "samples": self.samples,
            "response_tokens": self.response_tokens,
            "seconds": self.seconds,
            "val_before": self.val_before,
            "val_after": self.val_after,
            "first_at_target_s": self.first_at_target_s,
            "wall_s": round(self.wall_s, 1),
            "cpu_s": round(self.cpu_s, 1),
            "cores": round(self.cores, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "peak_tree_mb": round(self.peak_tree_mb, 1),
            **({"learner_cycle_shares": {k: round(v, 4) for k, v in self.cycle_shares.items()}} if self.cycle else {}),
        }


def tree_rss_kb(root: int) -> int:
    """The resident set of `root` and every process descended from it, in kB, from /proc (0 once it is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended while we looked
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])  # after the command's name, which may hold spaces
        children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, [root]
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page_kb
        except (OSError, ValueError, IndexError):
            pass
        todo += children.get(pid, [])
    return total


def run_process(command: list[str], name: str, timeout_s: float) -> tuple[list[str], int, float, resource.struct_rusage, float]:
    """Run a leg's process, its output echoed to stderr line by line as it comes. Its lines, exit code, wall
    seconds, resource use (os.wait4: the process and every descendant it waited for, this leg's alone) and the
    peak resident MB of its whole process tree."""
    lines: list[str] = []
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1)
    killer = threading.Timer(timeout_s, process.kill)  # a leg that hangs must not hang the bench
    killer.daemon = True
    killer.start()
    peak_kb, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(TREE_SAMPLE_S):
            peak_kb[0] = max(peak_kb[0], tree_rss_kb(process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            print(f"  {name} | {line}", file=sys.stderr, flush=True)
        done.set()
        sampler.join()
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        done.set()
        killer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage: Popen must not wait again
    return lines, process.returncode, time.monotonic() - started, usage, peak_kb[0] / 1024


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


def first_time_at(validations: list[list[float | None]], target: float | None) -> float | None:
    """The training seconds of the first validation [seconds, reward] at `target` or above (None if none is)."""
    if target is None:
        return None
    for at, value in validations:
        if value is not None and value >= target:
            return float(at)  # type: ignore[arg-type]
    return None


def _leg_run(name: str, command: list[str], seconds: float, target: float | None) -> LegRun:
    lines, code, wall, usage, peak_tree_mb = run_process(command, name, timeout_s=3 * seconds + 900)
    summary = last_json(lines)
    if code != 0 or summary is None:
        tail = " / ".join(lines[-3:])[-400:]
        raise RuntimeError(f"exit {code}{'' if summary else ', no JSON summary'}: {tail}")
    return LegRun(
        samples=int(summary["samples"]),
        response_tokens=int(summary.get("response_tokens") or 0),
        seconds=float(summary["seconds"]),
        val_before=summary.get("val_before"),
        val_after=summary.get("val_after"),
        first_at_target_s=first_time_at(summary.get("validations") or [], target),
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_mb=usage.ru_maxrss / 1024,  # kilobytes on Linux
        peak_tree_mb=peak_tree_mb,
        summary=summary,
        cycle={str(k): float(v) for k, v in (summary.get("learner_cycle") or {}).items()},
    )


def run_ppoz(task: TrainTask, seconds: float, val_every_s: float, device: str = "auto") -> LegRun:
    with tempfile.TemporaryDirectory(prefix="ppoz-bench-train-") as out:
        command = [sys.executable, "-m", "tools.bench.train_leg", "--task", task.name, "--seconds", repr(seconds), "--out", out]
        return _leg_run("ppoz", command + ["--val-every-s", repr(val_every_s), "--device", device], seconds, task.target)


def run_trl(python: Path, task: TrainTask, seconds: float, val_every_s: float, threads: int = 0, device: str = "auto") -> LegRun:
    command = [str(python), "-m", "tools.bench.trl_grpo", "--task", task.name, "--seconds", repr(seconds), "--threads", str(threads)]
    return _leg_run("trl", command + ["--val-every-s", repr(val_every_s), "--device", device], seconds, task.target)


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
        "tokens_per_s": _spread([r.tokens_per_s for r in runs]),
        "val_before": _spread([r.val_before for r in runs]),
        "val_after": _spread([r.val_after for r in runs]),
        "first_at_target_s": _spread(reached),
        "reached_target": len(reached),
        "cores": _spread([r.cores for r in runs]),
        "peak_tree_mb": _spread([r.peak_tree_mb for r in runs]),
        "peak_rss_mb": _spread([r.peak_rss_mb for r in runs]),
        "seconds": statistics.median(r.seconds for r in runs),
        "samples": statistics.median(r.samples for r in runs),
        **({"learner_cycle_shares": cycle_medians(runs)} if any(r.cycle for r in runs) else {}),
    }


def cycle_medians(runs: list[LegRun]) -> dict[str, float]:
    """The median share of each part of the learner's loop over the runs that reported a profile."""
    profiled = [r.cycle_shares for r in runs if r.cycle_shares]
    parts = dict.fromkeys(part for shares in profiled for part in shares)
    return {part: round(statistics.median(shares.get(part, 0.0) for shares in profiled), 4) for part in parts}


def ratio(result: dict[str, Any], top: str = "ppoz", bottom: str = "trl") -> float | None:
    """top's median responses/s over bottom's (None unless both ran)."""
    if top not in result or bottom not in result:
        return None
    below = result[bottom]["responses_per_s"]["median"]
    return result[top]["responses_per_s"]["median"] / below if below else None


def run_task(task: TrainTask, legs: list[str], args: argparse.Namespace, python: Path | None) -> dict[str, Any]:
    """Every leg's runs on one task, alternating; the medians, the ratio, every run's figures and the errors."""
    seconds = args.seconds or task.seconds
    runs: dict[str, list[LegRun]] = {leg: [] for leg in legs}
    errors: dict[str, str] = {}
    order = leg_order(legs, args.repeats)
    for i, leg in enumerate(order):
        if leg in errors:
            continue
        print(f"ppoz bench train: {task.name}, {leg}, run {i + 1} of {len(order)}, {seconds:g} s", file=sys.stderr, flush=True)
        try:
            if leg == "ppoz":
                run = run_ppoz(task, seconds, args.val_every_s, args.device)
            else:
                assert python is not None  # made before the tasks when trl is among the legs
                run = run_trl(python, task, seconds, args.val_every_s, args.trl_threads, args.device)
        except Exception as e:  # noqa: BLE001 - a leg that fails is reported beside the other's figures
            log.warning("%s %s failed: %s: %s", task.name, leg, type(e).__name__, e)
            errors[leg] = f"{type(e).__name__}: {e}"
            continue
        runs[leg].append(run)
    result: dict[str, Any] = {leg: summarise(runs[leg]) for leg in legs if runs[leg]}
    result["ppoz_over_trl"] = ratio(result)
    result["runs"] = {leg: [r.figures() for r in runs[leg]] for leg in legs}
    result["errors"] = errors
    result["setup"] = {"about": task.about, "seconds": seconds, "target": task.target, "order": order}
    return result


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from tools.bench.train_tasks import TASKS

    legs = [leg for leg in args.legs.split(",") if leg]
    tasks = [name for name in args.tasks.split(",") if name]
    unknown = [leg for leg in legs if leg not in LEGS] + [name for name in tasks if name not in TASKS]
    if unknown or not legs or not tasks:
        known = f"legs: {', '.join(LEGS)}; tasks: {', '.join(TASKS)}"
        raise SystemExit(f"ppoz bench train: unknown legs or tasks {', '.join(unknown) or '(none given)'}; {known}")
    if args.repeats < 1 or not 0 <= args.seconds <= 24 * 3600 or args.trl_threads < 0 or not 0 < args.val_every_s <= 24 * 3600:
        given = f"got --repeats {args.repeats}, --seconds {args.seconds:g}, --trl-threads {args.trl_threads}"
        given += f", --val-every-s {args.val_every_s:g}"
        raise SystemExit(
            f"ppoz bench train: --repeats must be at least 1, --seconds 0 (the task's) or positive, --trl-threads not negative"
            f" and --val-every-s positive; {given}"
        )
    load = load_at_start("train")
    python, trl_versions = None, None
    if "trl" in legs:
        python = Path(args.trl_python) if args.trl_python else ensure_trl(Path(args.trl_venv).expanduser())
        trl_versions = probe(python)
        if trl_versions is None or trl_versions["trl"] is None:
            raise SystemExit(f"ppoz bench train: {python} does not import trl (--trl-python); found {trl_versions}")
    from models.policy_model import ModelSpec

    on_gpu = ModelSpec(device=args.device).resolved_device().type == "cuda"  # where both legs' models go
    result: dict[str, Any] = {name: run_task(TASKS[name], legs, args, python) for name in tasks}
    result["setup"] = {
        "repeats": args.repeats,
        "val_every_s": args.val_every_s,
        "load_average_at_start": load,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": "cuda" if on_gpu else "cpu",
        "gpu": torch.cuda.get_device_name() if on_gpu else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl_versions["trl"] if trl_versions else None,
        "trl_torch_threads": args.trl_threads or torch.get_num_threads(),
    }
    failed = any(result[name]["errors"] for name in tasks)
    if args.json:
        print(json.dumps(result))
        return 1 if failed else 0
    s = result["setup"]
    where = f"{s['machine']}, {s['gpu']}" if s["gpu"] else s["machine"]
    print(
        f"medians of {args.repeats} runs (min-max); {where}; load average {load:.2f} at start; torch {s['torch']}, "
        f"transformers {s['transformers']}" + (f", trl {s['trl']} on {s['trl_torch_threads']} torch threads" if s["trl"] else "")
    )
    for name in tasks:
        print_task(name, result[name], legs)
    print("cores: CPU seconds over wall seconds of the leg's process tree; tree MB: the whole tree's peak resident set")
    return 1 if failed else 0


def print_task(name: str, r: dict[str, Any], legs: list[str]) -> None:
    setup = r["setup"]
    target = setup["target"]
    print(f"\n{name}: {setup['about']}; {setup['seconds']:g} s per run" + (f", validation target {target:g}" if target is not None else ""))
    print(f"{'leg':<6}{'responses/s':>12}{'(min-max)':>16}{'tokens/s':>10}{'val before':>11}{'val after':>10}", end="")
    print(f"{'first at target':>16}{'cores':>7}{'tree MB':>9}")
    for leg, v in measured_legs(r, legs, width=6, error_chars=200):
        rate, after, first = v["responses_per_s"], v["val_after"], v["first_at_target_s"]
        before = f"{v['val_before']['median']:.2f}" if v["val_before"] else "-"
        after_text = f"{after['median']:.2f}" if after else "-"
        first_text = f"{first['median']:.0f} s ({v['reached_target']}/{v['runs']})" if first else f"- (0/{v['runs']})"
        spread = f"({rate['min']:.1f}-{rate['max']:.1f})"
        print(
            f"{leg:<6}{rate['median']:>12.1f}{spread:>16}{v['tokens_per_s']['median']:>10.0f}"
            f"{before:>11}{after_text:>10}{first_text:>16}{v['cores']['median']:>7.2f}{v['peak_tree_mb']['median']:>9.0f}"
        )
    if r["ppoz_over_trl"] is not None:
        print(f"ppoz / trl, median responses/s: {r['ppoz_over_trl']:.2f}x")
    for leg in legs:
        if r.get(leg, {}).get("learner_cycle_shares"):
            shares = "  ".join(f"{part} {share:.0%}" for part, share in r[leg]["learner_cycle_shares"].items())
            print(f"{leg} learner's loop (median shares): {shares}")
