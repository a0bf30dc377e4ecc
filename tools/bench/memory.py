"""`ppoz bench memory`: the peak memory of each part of PPOZ at a real model's shape, on the GPU it runs on.

No GPU here, and a CPU cannot run a 7B model's update at Kea's shapes (one pass of a 64-observation rollout
through the LM head alone is ~48 TFLOP at Qwen2.5-1.5B's width: minutes a pass on two cores). So each part runs
the product's own code (the learner's Trainer, the actor's LLMPolicy and GenerationEngine) on the meta device
(tools/bench/meta_trace.py): every op allocates its output as the GPU would and computes nothing, and every
storage is counted while it lives (tools/bench/memory_peak.py): what the GPU's caching allocator is asked for,
not its rounding or fragmentation. The model has the shape's real width, heads and 151,936-token vocabulary in
bf16; its depth is measured at DEPTHS layers, fitted linearly, and the fit gives the model's own depth, with its
largest residual on the measured depths. `--check` runs one part at a reduced size both on the CPU for real and
traced, and says how close the two peaks are.

The workloads (the issue's): `candidate_update` a learner update of 64 Kea transitions (1,024-token prompts, 32
candidates of 40-60 tokens), LoRA, the learner's defaults, gradient checkpointing as on a GPU (auto); it runs two
update cycles (features for GAE, the undo snapshot, the update), so the optimizer's state is there the second
time. `generation_update` 64 responses of 64-1,024 tokens after 256-token prompts, 8,192 tokens a micro-batch.
`full_finetune_1gpu` the generation update with every weight trained (lora_rank 0: Adam with float32 masters, a
frozen reference copy). `full_finetune_fsdp2` and `full_finetune_fsdp4` the same on one rank of 2 or 4 under FSDP2
(tools/bench/memory_sharded.py: traced on fake tensors, not on meta). `actor_scoring` a full scoring batch
(`max_batch` = 8 Kea observations) twice, with the prefix cache. `actor_generation` 64 rows of 2,048-token
contexts (1,984 prompt tokens, 64 new). `startup_actor` and `startup_learner` the peak while a process builds its
model and runs its start-up checks, against what it holds after (its steady memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tools.bench.memory_workloads import GB, LORA_RANK, Measured, Text, generated_segments, kea_segments, learner_config, words_tokenizer
from tools.bench.train_tasks import MODEL_SHAPES, shape_config

SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "tiny-qwen2")  # the last: the suite's, Qwen2.5's vocabulary at hidden 64
DEPTHS = (2, 4, 6)
BUDGETS_GB: dict[str, dict[str, float]] = {  # the budgets; parts without one are reported
    "qwen2.5-1.5b": {"candidate_update": 20, "generation_update": 20, "full_finetune_1gpu": 40, "actor_generation": 16},
    "qwen2.5-7b": {"candidate_update": 40, "generation_update": 40, "full_finetune_fsdp4": 60},
}
STARTUP_RATIO = 1.2  # start-up's peak against the steady memory after it


def meta_model(shape: str, layers: int, lora_rank: int) -> Any:
    """The shape's model in bf16 with `layers` decoder layers and a LoRA adapter of `lora_rank` (0: none), on meta."""
    from transformers import AutoModelForCausalLM

    from models.policy_model import ModelSpec, with_adapter

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape, layers), dtype=torch.bfloat16, attn_implementation="sdpa")
        model = with_adapter(model, ModelSpec(model=shape, device="meta", lora_rank=lora_rank))
    return model.eval()


# --- the learner's parts -------------------------------------------------------------------------------------------
def learner_cycles(shape: str, layers: int, lora_rank: int, segments: list[Any], cycles: int = 2) -> Measured:
    """The learner's update cycle (learner_node/worker.py: build with the critic's values, the undo snapshot, the
    update) `cycles` times on the same segments, from a fresh model: the peak on the device."""
    from common.shared_settings import PolicyStamp
    from learner_node.policy import LearnerPolicy
    from learner_node.trainer import Trainer
    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import traced

    cfg = learner_config(lora_rank)
    tokenizer = words_tokenizer()

    def run() -> None:
        model = meta_model(shape, layers, lora_rank)
        lp = LearnerPolicy(model, tokenizer, "token", 1.0, cfg.value_hidden, "packed", cfg.generation.value_hidden, True, "packed")
        trainer = Trainer(cfg, lp, True)
        stamp = PolicyStamp(run="bench", normalisation="token", temperature=1.0, lora_rank=lora_rank, greedy=False)
        for update in range(cycles):
            batches = trainer.build(segments, 0, stamp)
            undo = trainer.snapshot()
            trainer.update(trainer.parts(batches), True, update)
            del undo, batches

    with traced():
        return Measured(peak_memory(run, device="meta").total)


# --- the actor's parts ---------------------------------------------------------------------------------------------
def actor_policy(shape: str, layers: int, **sampling: Any) -> Any:
    """An actor's LLMPolicy as actor_node/main.py builds it (the scoring path checked at start), on meta."""
    from actor_node.config import ActorConfig
    from actor_node.llm_policy import LLMPolicy, SamplingConfig

    defaults = ActorConfig.__dataclass_fields__
    settings = SamplingConfig(capture_decode=False, **sampling)
    prefix_cache_mb = float(defaults["prefix_cache_mb"].default)  # type: ignore[arg-type]
    return LLMPolicy(meta_model(shape, layers, LORA_RANK), words_tokenizer(), settings, "auto", prefix_cache_mb)


def actor_scoring(shape: str, layers: int) -> Measured:
    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import traced

    segments = kea_segments(16)
    jobs = [{"job": i, "task_id": f"t{i % 8}", "obs": t.obs.to_wire()} for i, t in enumerate(t for s in segments for t in s.transitions)]

    def run() -> None:
        policy = actor_policy(shape, layers)
        with torch.inference_mode():
            for start in range(0, len(jobs), 8):  # the actor's max_batch: 8 requests a forward
                policy.choose_batch(jobs[start : start + 8])

    with traced():
        return Measured(peak_memory(run, device="meta").total)


def actor_generation(shape: str, layers: int, rows: int = 64, context: int = 2048, new: int = 64) -> Measured:
    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import traced

    text = Text(1)
    jobs = [
        {
            "job": i,
            "task_id": f"r{i}",
            "deadline_ms": 3_600_000,
            "obs": {"prompt": text.words(context - new - 1), "sampling": {"max_new_tokens": new}},
        }
        for i in range(rows)
    ]

    def run() -> None:
        policy = actor_policy(shape, layers, max_generate_rows=rows, max_generate_positions=context)
        engine = policy.generation_engine()
        with torch.inference_mode():
            engine.add(jobs)
            while engine.active:
                engine.step()

    with traced():
        return Measured(peak_memory(run, device="meta").total)


# --- start-up ------------------------------------------------------------------------------------------------------
def startup(build: Callable[[], Any]) -> Measured:
    """The peak while `build()` makes a process's model and runs its start-up checks, and what is alive after it
    (the steady memory it serves or trains with)."""
    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import traced

    kept: list[Any] = []
    with traced():
        peak = peak_memory(lambda: kept.append(build()), device="meta")
    return Measured(peak.total, peak.end)


def startup_actor(shape: str, layers: int) -> Measured:
    return startup(lambda: actor_policy(shape, layers))


def startup_learner(shape: str, layers: int) -> Measured:
    """learner_node/loading.py's steps: the model, the scoring path and generation layout checks, the policy."""
    from learner_node.packed_forward import check_layout
    from learner_node.policy import LearnerPolicy
    from models import scoring

    cfg = learner_config(LORA_RANK)

    def build() -> Any:
        model = meta_model(shape, layers, LORA_RANK)
        path = scoring.select_path(model)
        layout = check_layout(model, cfg.generation.micro_batch_tokens)
        return LearnerPolicy(model, words_tokenizer(), "token", 1.0, cfg.value_hidden, path, cfg.generation.value_hidden, True, layout)

    return startup(build)


TRACED_ON = {f"full_finetune_fsdp{n}": f"fake tensors as rank 0 of {n}" for n in (2, 4)}


def sharded(shape: str, layers: int, world: int) -> Measured:
    """The full fine-tune's update on one rank of `world` (tools/bench/memory_sharded.py)."""
    from tools.bench.memory_sharded import in_own_process, sharded_cycles

    return in_own_process(sharded_cycles, shape, layers, world, generated_segments())


PARTS: dict[str, Callable[[str, int], Measured]] = {
    "candidate_update": lambda shape, layers: learner_cycles(shape, layers, LORA_RANK, kea_segments()),
    "generation_update": lambda shape, layers: learner_cycles(shape, layers, LORA_RANK, generated_segments()),
    "full_finetune_1gpu": lambda shape, layers: learner_cycles(shape, layers, 0, generated_segments()),
    "full_finetune_fsdp2": lambda shape, layers: sharded(shape, layers, 2),
    "full_finetune_fsdp4": lambda shape, layers: sharded(shape, layers, 4),
    "actor_scoring": actor_scoring,
    "actor_generation": actor_generation,
    "startup_actor": startup_actor,
    "startup_learner": startup_learner,
}


# --- depth, fit, report --------------------------------------------------------------------------------------------
def fitted(depths: tuple[int, ...], values: list[float], depth: int) -> tuple[float, float]:
    """(the least-squares line through (depth, value) at `depth`, its largest residual on the measured depths)."""
    slope, intercept = statistics.linear_regression(depths, values)
    residual = max(abs(v - (intercept + slope * d)) for d, v in zip(depths, values, strict=True))
    return intercept + slope * depth, residual


def measure_part(name: str, shape: str, depths: tuple[int, ...] = DEPTHS) -> dict[str, Any]:
    """One part at `shape`: measured at each depth, extrapolated to the model's own; its figure and budget."""
    full = MODEL_SHAPES[shape][2]
    started = time.monotonic()
    runs = [PARTS[name](shape, d) for d in depths]
    peak, residual = fitted(depths, [r.peak / GB for r in runs], full)
    out: dict[str, Any] = {
        "peak_gb": round(peak, 2),
        "measured_gb": {str(d): round(r.peak / GB, 3) for d, r in zip(depths, runs, strict=True)},
        "fit_residual_gb": round(residual, 3),
        "how": f"traced on {TRACED_ON.get(name, 'meta')} at {', '.join(map(str, depths))} layers, linear in depth to {full}",
        "seconds": round(time.monotonic() - started, 1),
    }
    budget = BUDGETS_GB.get(shape, {}).get(name)
    if runs[0].steady is not None:
        steady, _ = fitted(depths, [(r.steady or 0) / GB for r in runs], full)
        out["steady_gb"] = round(steady, 2)
        out["ratio"] = round(peak / steady, 3) if steady else None
        out["budget_ratio"] = STARTUP_RATIO
        out["met"] = bool(steady) and peak / steady <= STARTUP_RATIO
    elif budget is not None:
        out["budget_gb"] = budget
        out["met"] = peak <= budget
    return out


def cross_check(shape: str = "qwen2.5-1.5b") -> dict[str, Any]:
    """The instrument against the real thing: the candidate update at `shape`'s width and vocabulary, two layers, in
    float32, 8 observations of 256-token prompts and 8 candidates of 10-20 tokens, micro-batches of 2: run on the
    CPU for real (its storages counted as they are allocated) and traced on meta."""
    from transformers import AutoModelForCausalLM

    from common.shared_settings import PolicyStamp
    from learner_node.policy import LearnerPolicy
    from learner_node.trainer import Trainer
    from models.policy_model import ModelSpec, with_adapter
    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import traced

    segments = kea_segments(8, prompt=256, candidates=8, low=10, high=20)
    tokenizer = words_tokenizer()
    cfg = learner_config(LORA_RANK)
    cfg.micro_batch = 2
    peaks: dict[str, float] = {}
    for device in ("cpu", "meta"):

        def run(device: str = device) -> None:
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(shape_config(shape, 2), dtype=torch.float32, attn_implementation="sdpa")
                model = with_adapter(model, ModelSpec(model="bench", device=device, lora_rank=LORA_RANK))
            lp = LearnerPolicy(
                model.eval(), tokenizer, "token", 1.0, cfg.value_hidden, "packed", cfg.generation.value_hidden, True, "packed"
            )
            trainer = Trainer(cfg, lp, True)
            stamp = PolicyStamp(run="bench", normalisation="token", temperature=1.0, lora_rank=LORA_RANK, greedy=False)
            batches = trainer.build(segments, 0, stamp)
            trainer.update(trainer.parts(batches), True, 0)

        started = time.monotonic()
        if device == "meta":
            with traced():
                peaks[device] = peak_memory(run, device=device).total
        else:
            peaks[device] = peak_memory(run, device=device).total
        peaks[f"{device}_seconds"] = round(time.monotonic() - started, 1)
    return {
        "part": f"candidate_update at {shape}'s width, 2 layers, float32, 8 observations",
        "cpu_gb": round(peaks["cpu"] / GB, 3),
        "traced_gb": round(peaks["meta"] / GB, 3),
        "traced_over_cpu": round(peaks["meta"] / peaks["cpu"], 3),
        "cpu_seconds": peaks["cpu_seconds"],
        "traced_seconds": peaks["meta_seconds"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-1.5b", help="the model shape (default %(default)s)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts (default: all): " + ", ".join(PARTS))
    parser.add_argument(
        "--depths", default=",".join(map(str, DEPTHS)), help="decoder layers measured, fitted to the model's depth (default %(default)s)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also run the cross-check: one part on the CPU for real against its trace (and a sharded one with fsdp parts)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def main(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("models").setLevel(logging.WARNING)  # the start-up checks' lines, once per depth
    names = [p for p in args.parts.split(",") if p]
    try:
        depths = tuple(sorted({int(d) for d in args.depths.split(",") if d}))
    except ValueError:
        depths = ()
    if len(depths) < 2 or depths[0] < 1:
        print(f"ppoz bench memory: --depths takes two or more layer counts from 1, such as 2,4 (got {args.depths!r})", file=sys.stderr)
        return 2
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        print(f"ppoz bench memory: unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"shape": args.shape, "parts": {}}
    for name in names:
        if not args.json:
            print(f"  {name} ...", flush=True)
        result["parts"][name] = measure_part(name, args.shape, depths)
    if args.check:
        result["cross_check"] = cross_check(args.shape)
        if any(name.startswith("full_finetune_fsdp") for name in names):
            from tools.bench.memory_sharded import check

            result["sharded_check"] = check("qwen2.5-0.5b")
    if args.json:
        print(json.dumps(result))
        return 0
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    lines = [
        f"peak GPU memory at {result['shape']} (bf16), traced on this CPU",
        f"{'part':<20} {'peak GB':>8} {'budget':>12} {'met':>4}  fit residual",
    ]
    for name, part in result["parts"].items():
        if "ratio" in part:
            budget = f"<= {part['budget_ratio']}x {part['steady_gb']}"
        else:
            budget = f"<= {part['budget_gb']}" if "budget_gb" in part else "-"
        met = "" if "met" not in part else "yes" if part["met"] else "NO"
        lines.append(f"{name:<20} {part['peak_gb']:>8.2f} {budget:>12} {met:>4}  {part['fit_residual_gb']:.3f} GB")
    if "cross_check" in result:
        c = result["cross_check"]
        lines.append(f"cross-check ({c['part']}): CPU {c['cpu_gb']} GB, traced {c['traced_gb']} GB, ratio {c['traced_over_cpu']}")
    if "sharded_check" in result:
        c = result["sharded_check"]
        lines.append(f"sharded check ({c['part']}): CPU {c['cpu_gb']} GB, traced {c['traced_gb']} GB, ratio {c['traced_over_cpu']}")
    return "\n".join(lines)
