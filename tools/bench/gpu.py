"""`ppoz bench gpu`: every figure a GPU run is asked for, in one command of at most --budget-s, as one JSON object.

On a GPU (`--device cuda`, or `auto` where there is one) at users' shapes; on a CPU (`--device cpu`) the same
code at tiny sizes, which CI runs so that the command keeps working between the rare GPU runs. Each part reports
its figures, or the error that stopped it; the command exits 1 if a part failed.

- gae: `core_algos.gae` on 131,072 tokens (target: at most 50 ms).
- head: the LM head a decode step runs (a bf16 head of 151,936 tokens, hidden 1,536 on a GPU, 896 on a CPU), its
  float32 copy kept against upcast on every call.
- update: one generation PPO update with the learner's own defaults ([learner] and [generation] settings: LoRA
  rank 8, micro-batches of 8,192 tokens, gradient checkpointing on a GPU, bf16 there) on long-tailed responses,
  at Qwen2.5-1.5B's shape (random weights): seconds and peak memory (target on a GPU: at most 20 GB).
- scoring, generate, weights: `ppoz bench scoring|generate|weights --json` in a process each, at the sizes
  below (generate's targets on a GPU: 5x one request at a time, 2x the static batch at 64 rows).
- train: `ppoz bench train --tasks long` against trl, with `--trl-python` only (a machine without a package
  index cannot make trl's environment); otherwise reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import torch

from ppoz.flags import add_device_flag, add_json_flag
from ppoz.up import ppoz_command
from tools.bench import load_at_start, status_kb

GAE_TOKENS = 131_072
# generate's legs and case: the engine against one request at a time and the static batch, once
GENERATE_LEGS = ("--cases", "default", "--legs", "one_at_a_time,static_batch,ppoz", "--repeats", "1")
# Per device kind: the sub-benches' arguments, and the update part's shape and batch.
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {
        "scoring": [
            "--hidden",
            "1536",
            "--layers",
            "28",
            "--vocab",
            "151936",
            "--shapes",
            "1024x32",
            "--history-steps",
            "4",
            "--repeats",
            "3",
        ],
        "generate": ["--shape", "qwen2.5-1.5b", "--clients", "64", "--prompt-tokens", "128", "--new-tokens", "32", *GENERATE_LEGS],
        "weights": ["--repeats", "1", "--no-hosts", "--swaps", "5"],
        "train": ["--tasks", "long", "--seconds", "60", "--repeats", "1"],
        "update": {"shape": "qwen2.5-1.5b", "responses": 16, "min_len": 256, "max_len": 1024, "prompt": 256},
        "decode": {"shape": "qwen2.5-1.5b", "rows": 64, "prompt": 128, "steps": 32},
    },
    "cpu": {
        "scoring": ["--hidden", "64", "--layers", "2", "--vocab", "1024", "--shapes", "64x4", "--history-steps", "2", "--repeats", "1"],
        "generate": [
            *("--shape", "llama", "--hidden", "64", "--layers", "2", "--clients", "4", "--prompt-tokens", "16", "--new-tokens", "8"),
            *GENERATE_LEGS,
            *("--warmup", "0"),  # nothing to capture on a CPU: the suite's run without the warm-up round
        ],
        "weights": ["--hidden", "64", "--layers", "2", "--chunk-mb", "1", "--repeats", "1", "--no-hosts", "--swaps", "3"],
        "train": ["--tasks", "demo", "--seconds", "20", "--repeats", "1"],
        "update": {"shape": "tiny-qwen2", "responses": 4, "min_len": 8, "max_len": 32, "prompt": 16},
        "decode": {"shape": "tiny-qwen2", "rows": 4, "prompt": 16, "steps": 8},
    },
}
PART_LIMITS_S = {"scoring": 90.0, "generate": 180.0, "weights": 90.0, "update": 150.0, "train": 240.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flag(parser, "cuda, cpu (tiny sizes, for CI), or auto: cuda where there is one (default)", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's wall-clock budget in seconds (default: 480)")
    parser.add_argument("--trl-python", default="", help="a Python that imports trl: runs the train part (ppoz bench train --trl-python)")
    add_json_flag(parser, "print one JSON object instead of a summary")


def gae_part(device: torch.device) -> dict[str, Any]:
    from learner_node import core_algos

    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(GAE_TOKENS, generator=gen).to(device), torch.randn(GAE_TOKENS, generator=gen).to(device)
    dones = (torch.rand(GAE_TOKENS, generator=gen) < 1e-3).to(device)
    seconds = []
    for _ in range(6):  # the first is a warm-up
        start = time.perf_counter()
        core_algos.gae(rewards, values, dones, 0.0, 1.0, 0.95)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    ms = statistics.median(seconds[1:]) * 1e3
    return {"tokens": GAE_TOKENS, "ms": round(ms, 2), "target_ms": 50.0, "met": ms <= 50.0}


def head_part(device: torch.device, hidden: int, rows: int = 32, runs: int = 5) -> dict[str, Any]:
    """The LM head as a decode step calls it (`scoring.head_logits` on a bf16 head of a 151,936-token vocabulary: on
    a GPU 16-bit inputs multiplied into float32, no float32 copy; on the CPU its float32 copy kept per weight
    version) against a float32 matmul of the weight upcast on every call, alternating; and its logits against
    float64's within the bound exact products give (width x 2^-24 x sum |h w| a logit: only the sums round)."""
    from models import scoring
    from models.scoring.lm_head import FLOAT32_COPY
    from tools.bench.train_tasks import REAL_SHAPE_VOCAB

    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, REAL_SHAPE_VOCAB, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
    states = torch.randn(rows, hidden, generator=generator).to(device, torch.bfloat16)
    legs = {
        "head_logits": lambda: scoring.head_logits(head, states),
        "upcast_per_call": lambda: torch.nn.functional.linear(states.float(), head.weight.float()),
    }
    seconds: dict[str, list[float]] = {name: [] for name in legs}
    with torch.inference_mode():
        for leg in legs.values():
            leg()  # warm-up, and on the CPU the kept copy made
        for run in range(2 * runs):
            for name in list(legs) if run % 2 == 0 else list(legs)[::-1]:
                start = time.perf_counter()
                legs[name]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds[name].append(time.perf_counter() - start)
        got = scoring.head_logits(head, states).double()
        exact = states.double() @ head.weight.double().T
        bound = hidden * 2.0**-24 * (states.double().abs() @ head.weight.double().abs().T)
        within = bool(((got - exact).abs() <= bound).all())
    ms = {name: statistics.median(times) * 1e3 for name, times in seconds.items()}
    return {
        "vocab": REAL_SHAPE_VOCAB,
        "hidden": hidden,
        "rows": rows,
        **{f"{name}_ms": round(value, 3) for name, value in ms.items()},
        "speedup": round(ms["upcast_per_call"] / ms["head_logits"], 2),
        "within_exact_bound": within,
        "float32_copy_kept": hasattr(head.weight, FLOAT32_COPY),
    }


def update_part(device: torch.device, size: dict[str, Any], deadline: float = math.inf) -> dict[str, Any]:
    """One generation update as the learner makes it, on a model of size["shape"]; frees the model after."""
    from common.shared_settings import PolicySpec, StoreSettings
    from learner_node.config import LearnerConfig
    from learner_node.optim import adam
    from learner_node.policy import LearnerPolicy
    from learner_node.token_update import generation_update
    from models.policy_model import ModelSpec, load_policy
    from tools.bench.train_tasks import real_shape_model
    from tools.bench.update import make_batch

    model_dir = str(real_shape_model(size["shape"]))
    cfg = LearnerConfig(policy=PolicySpec(model=model_dir), store=StoreSettings(redis_url="redis://unused"), device=str(device))
    model, tokenizer = load_policy(ModelSpec.of(cfg.policy, str(device)))
    checkpointing = cfg.checkpoints_layers(str(device))
    lp = LearnerPolicy(
        model,
        tokenizer,
        "token",
        1.0,
        cfg.value_hidden,
        token_value_hidden=cfg.generation.value_hidden,
        gradient_checkpointing=checkpointing,
    )
    vocab = model.config.vocab_size
    batch_args = argparse.Namespace(
        **{k: v for k, v in size.items() if k != "shape"}, median=0.2, vocab=vocab, micro_tokens=cfg.generation.micro_batch_tokens
    )
    batch = make_batch(batch_args, model)
    popt = adam(lp.trainable_parameters(), cfg.resolved_policy_lr())
    vopt = adam(lp.token_value_head.parameters(), cfg.value_lr)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        held_gb = torch.cuda.memory_allocated(device) / 1e9
    start = time.perf_counter()
    generation_update(lp, popt, vopt, batch, cfg, cfg.generation)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(r) for r in batch.responses) + sum(len(p) for p in batch.prompts)
    out: dict[str, Any] = {
        "shape": size["shape"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "lora_rank": cfg.policy.lora_rank,
        "gradient_checkpointing": checkpointing,
        "micro_batch_tokens": cfg.generation.micro_batch_tokens,
        "responses": len(batch.responses),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "within_budget": time.monotonic() <= deadline,  # one update cannot be cut short: said when it ran past the budget
    }
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        out.update(weights_gb=round(held_gb, 2), peak_gb=round(peak, 2), target_peak_gb=20.0, met=peak <= 20.0)
    else:
        out["process_peak_rss_mb"] = round(status_kb("VmHWM") / 1024, 1)
    del lp, model, popt, vopt, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def decode_part(device: torch.device, size: dict[str, Any], deadline: float = math.inf) -> dict[str, Any]:
    """The actor engine's decode step at size["rows"] rows, warm (on a GPU: its graphs captured): the wall time of a
    step against the GPU's own time for its kernels (torch's profiler), target at most 2x. Its warm-up and timed
    steps stop at `deadline` (the run's budget), with at least one timed step."""
    from actor_node.generation_engine import GenerationEngine
    from common.shared_settings import PolicySpec
    from models.policy_model import ModelSpec, load_policy
    from tools.bench.train_tasks import real_shape_model

    model, tokenizer = load_policy(ModelSpec.of(PolicySpec(model=str(real_shape_model(size["shape"]))), str(device)))
    model.requires_grad_(False)  # as the actor serves it
    rows, steps = size["rows"], size["steps"]
    text = " ".join(f"w{i}" for i in range(size["prompt"]))
    prompt_tokens = len(tokenizer(text)["input_ids"])
    engine = GenerationEngine(model, tokenizer, max_rows=rows, max_positions=prompt_tokens + 4 * steps + 16)
    engine.end_ids = set()  # random weights may sample an end token: every row runs its whole budget
    sampling = {"max_new_tokens": 4 * steps, "temperature": 1.0, "stop": []}
    engine.add([{"job": i, "obs": {"prompt": text, "sampling": {**sampling, "seed": i}}, "deadline_ms": 3_600_000} for i in range(rows)])
    for _ in range(steps):  # prefill, then warm: the buckets these steps use captured
        engine.step()
        if time.monotonic() > deadline:
            break

    def timed(engine: GenerationEngine, n: int) -> float:
        start = time.perf_counter()
        done = 0
        while done < n and (done == 0 or time.monotonic() < deadline):
            engine.step()  # each step ends in its copy of results to the host: nothing left running
            done += 1
        return (time.perf_counter() - start) / done * 1e3

    wall_ms = timed(engine, steps)
    out: dict[str, Any] = {
        "shape": size["shape"],
        "rows": rows,
        "prompt_tokens": prompt_tokens,
        "active": engine.active,
        "wall_ms_per_step": round(wall_ms, 3),
        "captured": len(engine.decode_step.graphs) if engine.decode_step is not None else 0,
        "eager_buckets": len(engine.decode_step.eager) if engine.decode_step is not None else 0,
    }
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            timed(engine, steps)
        events = prof.key_averages()
        kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
        kernel_ms = kernel_us / 1e3 / steps
        out.update(
            kernel_ms_per_step=round(kernel_ms, 3),
            wall_over_kernel=round(wall_ms / kernel_ms, 2) if kernel_ms else None,
            target=2.0,
            met=bool(kernel_ms) and wall_ms / kernel_ms <= 2.0,
        )
    engine.reset()
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_part(name: str, device: torch.device, extra: list[str], limit_s: float) -> dict[str, Any]:
    """`ppoz bench NAME --json` in a process of its own: its JSON object, or the error that stopped it."""
    device_args = [] if name == "weights" else ["--device", device.type]
    argv = ppoz_command("bench", name, "--json", *device_args, *extra, log_level=None)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s)  # the part's own limit, within the budget
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {limit_s:.0f} s", "command": " ".join(argv[2:])}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}", "command": " ".join(argv[2:])}
    return {"command": " ".join(argv[2:]), **json.loads(lines[-1])}


def generate_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The engine's speed-ups over one request at a time and the static batch, against the issue's GPU targets."""
    engine = result.get("default", {}).get("ppoz", {})
    vs_one, vs_static = engine.get("vs_one_at_a_time"), engine.get("vs_static_batch")
    return {
        "vs_one_at_a_time": vs_one,
        "vs_static_batch": vs_static,
        "met": vs_one is not None and vs_static is not None and vs_one >= 5.0 and vs_static >= 2.0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ppoz bench gpu: --device cuda, but torch sees no CUDA GPU")
    if args.budget_s <= 0:
        raise SystemExit(f"ppoz bench gpu: --budget-s must be positive, got {args.budget_s}")
    sizes = SIZES[device.type]
    deadline = time.monotonic() + args.budget_s
    load = load_at_start("gpu")
    result: dict[str, Any] = {}

    def remaining(part: str) -> float:
        return min(PART_LIMITS_S[part], deadline - time.monotonic())

    for name in ("scoring", "generate", "weights"):
        left = remaining(name)
        result[name] = bench_part(name, device, sizes[name], left) if left > 5 else {"error": "skipped: the budget was spent"}
    if "error" not in result["generate"]:
        result["generate_targets"] = generate_targets(result["generate"])
    result["gae"] = gae_part(device)
    result["head"] = head_part(device, 1536 if device.type == "cuda" else 896)
    for name, part in (("update", update_part), ("decode", decode_part)):
        if deadline - time.monotonic() <= 5:
            result[name] = {"error": "skipped: the budget was spent"}
            continue
        try:
            result[name] = part(device, sizes[name], deadline)
        except Exception as e:  # reported as the part's error (out of memory, say): the other parts' figures still count
            result[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
    left = remaining("train")
    if not args.trl_python:
        result["train"] = {"skipped": "no --trl-python: trl's environment cannot be made without a package index"}
    elif left <= 5:
        result["train"] = {"error": "skipped: the budget was spent"}
    else:
        result["train"] = bench_part("train", device, [*sizes["train"], "--trl-python", args.trl_python], left)
    result["setup"] = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "load_average_at_start": load,
        "budget_s": args.budget_s,
        "seconds": round(args.budget_s - (deadline - time.monotonic()), 1),
    }
    return result


def main(args: argparse.Namespace) -> int:
    result = run(args)
    failed = [name for name, part in result.items() if isinstance(part, dict) and "error" in part]
    if args.json:
        print(json.dumps(result))
    else:
        s = result["setup"]
        print(f"ppoz bench gpu on {s['gpu'] or s['device']} ({s['machine']}), {s['seconds']} s")
        g, u = result["gae"], result["update"]
        print(f"gae: {g['tokens']:,} tokens in {g['ms']} ms (target 50 ms)")
        h = result["head"]
        copy = "a float32 copy kept" if h["float32_copy_kept"] else "no float32 copy"
        exact = f"within float64's exact-product bound: {h['within_exact_bound']}"
        print(f"head: {h['head_logits_ms']} ms ({copy}, {exact}), {h['upcast_per_call_ms']} ms upcast per call")
        if "error" not in u:
            memory = f"peak {u['peak_gb']} GB" if "peak_gb" in u else f"process peak RSS {u['process_peak_rss_mb']} MB"
            print(f"update: {u['shape']}, {u['tokens']:,} tokens in {u['seconds']} s, {memory}")
        d = result["decode"]
        if "error" not in d and "kernel_ms_per_step" in d:
            print(f"decode: {d['wall_ms_per_step']} ms a step at {d['rows']} rows, {d['kernel_ms_per_step']} ms of it kernels")
        if "generate_targets" in result:
            t = result["generate_targets"]
            print(f"generate: engine {t['vs_one_at_a_time']}x one at a time, {t['vs_static_batch']}x the static batch")
        for name in failed:
            print(f"{name}: {result[name]['error'][:300]}")
    return 1 if failed else 0
