"""`ppoz bench learner`: memory and speed of one PPO policy step, packed layout vs one sequence per candidate.

Each (shape, method) runs in a fresh process, so its peak memory is its own:
on CPU the peak resident set during the step minus the resident set before it;
on a GPU `torch.cuda.max_memory_allocated` minus the memory in use before. The
step is what the learner does per transition: candidate log-probabilities with
gradients through a LoRA adapter, the PPO loss, backward, optimizer step.
Both methods apply the LM head only at scored positions, so the difference is
the layout alone: `full_sequences` pushes prompt + candidate through the model
once per candidate; `ppoz` (common/scoring.py, the actor's own function) pushes
the prompt once and the candidates packed behind it.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from typing import Any

import torch

SHAPES = [(1024, 32), (4096, 32)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256: about 20M parameters with 4 layers)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: 32000)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    parser.add_argument("--shapes", default="", help="prompt x candidates list (default: 1024x32,4096x32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "PROMPT", "N"), help=argparse.SUPPRESS)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One policy step in this process; prints its peak memory and time."""
    from peft import LoraConfig, get_peft_model

    from common import scoring
    from common.policy_model import ModelSpec
    from ppoz.bench.scoring import build_model, full_sequences_scores, observation

    method, prompt, n = args.child[0], int(args.child[1]), int(args.child[2])
    device = ModelSpec(model="bench", device=args.device).resolved_device()
    model = build_model(args.hidden, args.layers, args.vocab, device, torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    item = observation(prompt, n, args.vocab, torch.Generator().manual_seed(0))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _rss_mb()
    start = time.perf_counter()
    sums = full_sequences_scores(model, item) if method == "full_sequences" else scoring.score_packed(model, [item])[0]
    logp = scoring.policy_logprobs(scoring.normalise(sums.float(), item, "token"), 1.0)
    ratio = (logp[0] - logp[0].detach()).exp()
    loss = -(ratio * 1.0) - 0.01 * -(logp.exp() * logp).sum()  # PPO surrogate at ratio 1, advantage 1, entropy bonus
    loss.backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    elapsed = time.perf_counter() - start
    return {"peak_mb": round(peak, 1), "seconds": round(elapsed, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    cases = []
    for prompt, n in shapes:
        case: dict[str, Any] = {"prompt_tokens": prompt, "n_actions": n}
        for method in ("full_sequences", "ppoz"):
            cmd = [
                sys.executable,
                "-m",
                "ppoz.bench.learner",
                "--hidden",
                str(args.hidden),
                "--layers",
                str(args.layers),
                "--vocab",
                str(args.vocab),
                "--device",
                args.device,
                "--child",
                method,
                str(prompt),
                str(n),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                case[method] = {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
                continue
            got = json.loads(out.stdout.strip().splitlines()[-1])
            case[method] = {"peak_mb": got["peak_mb"], "transitions_per_s": round(1 / got["seconds"], 4), "seconds": got["seconds"]}
        if "peak_mb" in case.get("full_sequences", {}) and "peak_mb" in case.get("ppoz", {}):
            case["memory_ratio"] = round(case["full_sequences"]["peak_mb"] / max(case["ppoz"]["peak_mb"], 1e-6), 2)
            case["speedup"] = round(case["ppoz"]["transitions_per_s"] / case["full_sequences"]["transitions_per_s"], 2)
        cases.append(case)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    return {
        "bench": "learner",
        "model": {"arch": "llama", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "lora_rank": 8, "device": device},
        "cases": cases,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
    }


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"learner bench: one PPO policy step, llama-style {args.hidden}x{args.layers}, LoRA rank 8, {result['model']['device']}")
    for c in result["cases"]:
        parts = []
        for method in ("full_sequences", "ppoz"):
            r = c.get(method, {})
            parts.append(f"{method} " + (f"{r['peak_mb']:.0f} MB, {r['seconds']:.2f} s" if "peak_mb" in r else r.get("error", "?")))
        extra = f"  memory {c['memory_ratio']}x less, {c['speedup']}x faster" if "memory_ratio" in c else ""
        print(f"  {c['prompt_tokens']} x {c['n_actions']}: " + "; ".join(parts) + extra)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args()
    if parsed.child:
        print(json.dumps(child(parsed)))
    else:
        sys.exit(main(parsed))
