"""`ppoz bench learner --parallel ddp,fsdp`: memory per rank and update time of the learner on 2 ranks,
data parallel (every rank holds the whole model) against FSDP2 (learner_node/sharding.py).

Each leg is 2 fresh processes (gloo on the CPU, NCCL on GPUs), so its memory is its own. Each rank builds the
learner's models from a random Llama-style model saved once by the parent (all weights trained, so a frozen
reference copy too, as `lora_rank 0` does), shards them for fsdp, makes the optimizers, and runs
`--updates` of the learner's own generation update (`generation_update`, learner_node/update.py's loop) on one
fixed batch of responses of different lengths. Measured per rank:
- `held`: the bytes its tensors hold after the updates: weights, gradients, Adam's moments, the reference (of a
  sharded tensor its local shard);
- `resident`, `peak`: the resident set after the updates and its peak during them (activations and FSDP's
  gathered blocks too), above the resident set before the model was built (/proc/self/status; on a GPU
  torch.cuda's allocated and peak), the peak reset after the models are built;
- `load_peak`: the peak while the models are built (ddp: loaded whole, the reference copied; fsdp: as the learner
  loads them, straight into each rank's shards, learner_node/sharded_load.py); `process_peak`: the larger of the two.
Legs alternate (ddp, fsdp, fsdp, ddp, ...); medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from ppoz.ports import free_port
from tools.bench import load_at_start, printed_as_json, status_kb


def _held_mb(modules: list[Any], optimizers: list[torch.optim.Optimizer]) -> float:
    """The bytes this rank's tensors hold for `modules` (weights, gradients) and `optimizers` (Adam's moments): of a
    sharded parameter its local shard, each storage counted once."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for module in modules:
        for p in module.parameters():
            add(p)
            add(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                add(value)
    return total / 2**20


def _batch(responses: int, longest: int) -> Any:
    """`responses` generated responses of 8 to `longest` tokens after prompts of 8 to 64, one segment each."""
    from common.segments import GeneratedResponse, GenerateObservation, Segment, Transition
    from learner_node.token_update import build_generation_batch

    g = torch.Generator().manual_seed(0)
    segments = []
    for i in range(responses):
        prompt = torch.randint(3, 250, (8 + (i * 7) % 57,), generator=g).tolist()
        response = torch.randint(3, 250, (8 + (i * 13) % (longest - 7),), generator=g).tolist()
        t = Transition(
            obs=GenerateObservation(prompt, {"max_new_tokens": longest}),
            action=0,
            logprob=-1.0,
            probs=[],
            policy_version=0,
            mode="generate",
            reward=float(i % 3) - 1.0,
            done=True,
            truncated=False,
            generation=GeneratedResponse(response, [-5.5] * len(response), "stop", 1.0),
        )
        segments.append(Segment(f"s{i}", f"t{i}", 0, "done", True, False, None, [t]))
    return build_generation_batch(segments, current_version=0, max_policy_lag=4)


def _rank(rank: int, world: int, port: int, model_dir: str, parallelism: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from learner_node.config import GenerationConfig, UpdateConfig
    from learner_node.optim import adam
    from learner_node.policy import LearnerPolicy
    from learner_node.sharded_load import load_sharded_policy
    from learner_node.token_update import generation_update
    from models.policy_model import ModelSpec, load_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = f"cuda:{rank}" if cuda else "cpu"
    batch = _batch(args.responses, args.longest)
    before_kb = status_kb("VmRSS")
    torch.manual_seed(0)
    spec = ModelSpec(model=model_dir, device=device, lora_rank=0, dtype="float32")
    if parallelism == "fsdp":  # as the learner loads it: straight into each rank's shards, and the reference too
        mixed = spec.resolved_dtype() != torch.float32  # the learner's rule (learner_node/worker.py): float32 here
        model, tok = load_sharded_policy(spec, mixed_precision=mixed)
        frozen = load_sharded_policy(spec, mixed_precision=mixed, trained=False)[0]
    else:
        model, tok = load_policy(spec)
        frozen = None  # LearnerPolicy copies the reference (lora_rank 0) from the whole model
    lp = LearnerPolicy(model, tok, "token", 1.0, [16], token_value_hidden=[16], frozen=frozen)
    policy_opt, value_opt = adam(lp.trainable_parameters(), 1e-5), adam(lp.token_value_head.parameters(), 1e-3)
    cfg = UpdateConfig(update_epochs=1, policy_minibatch=args.responses, value_minibatch=args.responses, value_epochs=1, target_kl=0.0)
    gen = GenerationConfig(micro_batch_tokens=args.micro_tokens, kl_coef=0.05, value_hidden=[16])
    load_peak_kb = status_kb("VmHWM") - before_kb
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here on, the updates' own (the load's is load_peak_mb)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    times = []
    for update in range(args.updates):
        dist.barrier()
        start = time.perf_counter()
        generation_update(lp, policy_opt, value_opt, batch, cfg, gen, update_index=update)
        dist.barrier()
        times.append(time.perf_counter() - start)
    result = {
        "rank": rank,
        "update_s": times,
        "held_mb": _held_mb([m for m in (lp.model, lp.frozen, lp.token_value_head) if m is not None], [policy_opt, value_opt]),
        "resident_mb": (status_kb("VmRSS") - before_kb) / 1024,
        "peak_mb": (status_kb("VmHWM") - before_kb) / 1024,
        "load_peak_mb": load_peak_kb / 1024,
        "parameters": sum(p.numel() for p in model.parameters()) if parallelism == "ddp" else None,
    }
    if cuda:
        result["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["gpu_resident_mb"] = torch.cuda.memory_allocated() / 2**20
        result["gpu_base_mb"] = base_gpu / 2**20
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from models.tiny_models import build_tiny_model

    legs_wanted = [leg.strip() for leg in args.parallel.split(",") if leg.strip()]
    unknown = sorted(set(legs_wanted) - {"ddp", "fsdp"})
    if unknown:
        raise SystemExit(f"ppoz bench learner --parallel: unknown {', '.join(unknown)}; ddp, fsdp")
    load = load_at_start("learner --parallel")
    work = Path(tempfile.mkdtemp(prefix="ppoz-bench-parallel-"))
    model_dir = build_tiny_model(
        work / "model",
        "llama",
        hidden=args.hidden,
        intermediate=int(args.hidden * 2.75),
        layers=args.layers,
        heads=max(1, args.hidden // 64),
        kv_heads=max(1, args.hidden // 64),
        max_positions=512,
    )
    # glibc raises its mmap threshold (up to 32 MB) each time a big block is freed, after which freed blocks stay
    # in the heap, resident: the whole model each rank loads before sharding would count as held. A fixed
    # threshold keeps big tensors in mmaps, given back when freed, so the resident set follows what is held.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    runs: dict[str, list[list[dict[str, Any]]]] = {leg: [] for leg in legs_wanted}
    for repeat in range(args.repeats):
        for leg in legs_wanted if repeat % 2 == 0 else legs_wanted[::-1]:
            out = tempfile.mkdtemp(dir=work)
            started = time.perf_counter()
            mp.spawn(_rank, args=(2, free_port(), str(model_dir), leg, args, out), nprocs=2, join=True)
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
            runs[leg].append(ranks)
            print(
                f"  run {repeat + 1} {leg}: {max(r['held_mb'] for r in ranks):.0f} MB held, "
                f"{max(r['resident_mb'] for r in ranks):.0f} MB resident a rank, "
                f"update {statistics.median(ranks[0]['update_s']):.1f} s ({time.perf_counter() - started:.0f} s in all)",
                file=sys.stderr,
                flush=True,
            )
    medians = {}
    for leg, legs in runs.items():
        medians[leg] = {
            key: statistics.median(max(rank[key] for rank in ranks) for ranks in legs)  # the larger rank's, per run
            for key in ("held_mb", "resident_mb", "peak_mb", "load_peak_mb")
            + (("gpu_peak_mb", "gpu_resident_mb") if "gpu_peak_mb" in legs[0][0] else ())
        }
        # the process's peak over its life: loading, or the updates
        medians[leg]["process_peak_mb"] = statistics.median(
            max(max(rank["peak_mb"], rank["load_peak_mb"]) for rank in ranks) for ranks in legs
        )
        medians[leg]["update_s"] = statistics.median(statistics.median(ranks[0]["update_s"][1:] or ranks[0]["update_s"]) for ranks in legs)
    shutil.rmtree(work, ignore_errors=True)
    parameters = next((ranks[0]["parameters"] for legs in runs.values() for ranks in legs if ranks[0]["parameters"]), None)
    ratios = {}
    if "ddp" in medians and "fsdp" in medians:
        ratios = {key: medians["fsdp"][key] / medians["ddp"][key] for key in medians["ddp"]}
    return {
        "bench": "learner --parallel",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "load_at_start": load,
        "model": {"hidden": args.hidden, "layers": args.layers, "parameters": parameters, "trained": "all weights, reference copy"},
        "batch": {"responses": args.responses, "longest": args.longest, "micro_tokens": args.micro_tokens},
        "updates": args.updates,
        "repeats": args.repeats,
        "medians": medians,
        "fsdp_over_ddp": ratios,
        "runs": runs,
    }


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if printed_as_json(args, result):
        return 0
    model = result["model"]
    print(f"learner bench, 2 ranks ({result['device']}): {model['parameters']} parameters, {model['trained']}; medians of {args.repeats}")
    for leg, m in result["medians"].items():
        print(
            f"  {leg:<5} held {m['held_mb']:8.0f} MB a rank, resident {m['resident_mb']:8.0f} MB, peak {m['peak_mb']:8.0f} MB, "
            f"loading's peak {m['load_peak_mb']:8.0f} MB, process peak {m['process_peak_mb']:8.0f} MB, update {m['update_s']:6.2f} s"
        )
    for key, ratio in result["fsdp_over_ddp"].items():
        print(f"  fsdp / ddp {key}: {ratio:.2f}")
    return 0
