"""`ppoz bench learner`: memory and speed of one PPO policy step, packed layout vs one sequence per candidate.

Each (shape, method) runs in a fresh process, so its peak memory is its own:
on CPU the peak resident set during the step minus the resident set before it;
on a GPU `torch.cuda.max_memory_allocated` minus the memory in use before. The
step is what the learner does per transition: candidate log-probabilities with
gradients through a LoRA adapter, the PPO loss, backward, optimizer step.
Both methods apply the LM head only at scored positions, so the difference is
the layout alone: `full_sequences` pushes prompt + candidate through the model
once per candidate; `ppoz` (models/scoring.py, the actor's own function) pushes
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

from ppoz.flags import add_device_flag, add_json_flag, add_repeats_flag
from tools.bench import printed_as_json

SHAPES = [(1024, 32), (4096, 32)]
# The generation case: 16 responses of 64 to 512 tokens after 1k-token prompts, one token-level policy step.
GEN_RESPONSES = 16
GEN_PROMPT = 1024
GEN_LENGTHS = (64, 512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hidden", type=int, default=None, help="model width (default 256: about 20M parameters with 4 layers; --parallel: 1024)"
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4; --parallel: 16, 202M parameters)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: 32000)")
    add_device_flag(parser)
    parser.add_argument("--shapes", default="", help="prompt x candidates list (default: 1024x32,4096x32)")
    parser.add_argument(
        "--gen-micro-tokens", type=int, default=8192, help="generation case: tokens per packed forward (default: 8192, as the learner)"
    )
    parser.add_argument("--no-generation", action="store_true", help="leave out the generation case")
    add_json_flag(parser)
    parser.add_argument(
        "--parallel",
        default="",
        metavar="LEGS",
        help="instead: the learner on 2 ranks, e.g. ddp,fsdp: memory per rank and update time of each (tools/bench/parallel.py)",
    )
    parser.add_argument("--responses", type=int, default=8, help="--parallel: responses in the update's batch (default 8)")
    parser.add_argument("--longest", type=int, default=64, help="--parallel: the longest response, tokens (default 64)")
    parser.add_argument("--micro-tokens", type=int, default=512, help="--parallel: tokens per packed forward (default 512)")
    parser.add_argument("--updates", type=int, default=2, help="--parallel: updates per run, the first not timed (default 2)")
    add_repeats_flag(parser, "--parallel: runs of each leg, alternating (default 3)")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "PROMPT", "N"), help=argparse.SUPPRESS)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def generation_step(model: Any, method: str, vocab: int, micro_tokens: int) -> int:
    """One token-level policy step on GEN_RESPONSES responses: the PPO surrogate at ratio 1 on every response token,
    backward per forward (gradient accumulation), one optimizer step by the caller. Returns the tokens pushed
    through the model (padding included). `packed`: learner_node.packed_forward's path, rows of at most
    `micro_tokens` real tokens; `padded`: the whole batch right-padded to its longest sequence, one forward."""
    from learner_node.packed_forward import head_logprobs, response_logprobs
    from models import scoring

    gen = torch.Generator().manual_seed(0)
    lengths = torch.linspace(GEN_LENGTHS[0], GEN_LENGTHS[1], GEN_RESPONSES).round().long().tolist()
    prompts = [torch.randint(3, vocab, (GEN_PROMPT,), generator=gen).tolist() for _ in lengths]
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    total = sum(len(r) for r in responses)
    if method == "packed":
        from learner_node.packed_forward import pack

        pushed = 0
        for row in pack([len(p) + len(r) for p, r in zip(prompts, responses)], micro_tokens):
            logp, _ = response_logprobs(model, [prompts[i] for i in row], [responses[i] for i in row], [1.0] * len(row), micro_tokens)
            flat = torch.cat(logp)
            (-(flat - flat.detach()).exp().sum() / total).backward()
            pushed += sum(len(prompts[i]) + len(responses[i]) - 1 for i in row)
        return pushed
    decoder, head, post = scoring.model_parts(model)
    device = next(model.parameters()).device
    longest = max(len(p) + len(r) - 1 for p, r in zip(prompts, responses))
    ids = torch.zeros(len(lengths), longest, dtype=torch.long, device=device)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long, device=device)
    rows, cols, targets = [], [], []
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r[:-1]
        ids[b, : len(seq)] = torch.tensor(seq, device=device)
        mask[b, : len(seq)] = 1
        rows += [b] * len(r)
        cols += list(range(len(p) - 1, len(p) - 1 + len(r)))
        targets += r
    hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    picked = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
    flat, _ = head_logprobs(head, post, picked, torch.tensor(targets, device=device), torch.ones(len(targets), device=device))
    (-(flat - flat.detach()).exp().sum() / total).backward()
    return int(ids.numel())


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One policy step in this process; prints its peak memory and time."""
    from peft import LoraConfig, get_peft_model

    from models import scoring
    from models.policy_model import ModelSpec, peft_warnings_silenced
    from tools.bench.scoring import build_model, full_sequences_scores, observation

    method, prompt, n = args.child[0], int(args.child[1]), int(args.child[2])
    device = ModelSpec(model="bench", device=args.device).resolved_device()
    model = build_model(args.hidden, args.layers, args.vocab, device, torch.float32)
    with peft_warnings_silenced():
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    item = observation(prompt, n, args.vocab, torch.Generator().manual_seed(0)) if not method.startswith("gen_") else None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _rss_mb()
    start = time.perf_counter()
    pushed = 0
    if item is None:  # the generation case
        layout = method[len("gen_") :]
        if layout == "packed_checkpointed":  # the learner's gradient_checkpointing: dropout 0, layers recomputed in backward
            from models.policy_model import enable_gradient_checkpointing

            enable_gradient_checkpointing(model)
            model.train()
            layout = "packed"
        pushed = generation_step(model, layout, args.vocab, args.gen_micro_tokens)
    else:
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
    return {"peak_mb": round(peak, 1), "seconds": round(elapsed, 3), "tokens_pushed": pushed}


def _in_child(args: argparse.Namespace, method: str, prompt: int, n: int, transitions: int) -> dict[str, Any]:
    """Run one (method, shape) in a fresh process: its peak memory is its own."""
    cmd = [sys.executable, "-m", "tools.bench.learner", "--hidden", str(args.hidden), "--layers", str(args.layers)]
    cmd += ["--vocab", str(args.vocab), "--device", args.device, "--gen-micro-tokens", str(args.gen_micro_tokens)]
    out = subprocess.run([*cmd, "--child", method, str(prompt), str(n)], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    got = json.loads(out.stdout.strip().splitlines()[-1])
    result = {"peak_mb": got["peak_mb"], "transitions_per_s": round(transitions / got["seconds"], 4), "seconds": got["seconds"]}
    if got.get("tokens_pushed"):
        result["tokens_pushed"] = got["tokens_pushed"]
    return result


def _compare(case: dict[str, Any], baseline: str, ours: str) -> None:
    if "peak_mb" in case.get(baseline, {}) and "peak_mb" in case.get(ours, {}):
        case["memory_ratio"] = round(case[baseline]["peak_mb"] / max(case[ours]["peak_mb"], 1e-6), 2)
        case["speedup"] = round(case[ours]["transitions_per_s"] / case[baseline]["transitions_per_s"], 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    cases = []
    for prompt, n in shapes:
        case: dict[str, Any] = {"prompt_tokens": prompt, "n_actions": n}
        for method in ("full_sequences", "ppoz"):
            case[method] = _in_child(args, method, prompt, n, 1)
        _compare(case, "full_sequences", "ppoz")
        cases.append(case)
    if not args.no_generation:
        case = {"generation": True, "responses": GEN_RESPONSES, "prompt_tokens": GEN_PROMPT, "response_tokens": list(GEN_LENGTHS)}
        case["micro_batch_tokens"] = args.gen_micro_tokens
        for method in ("padded", "packed", "packed_checkpointed"):
            case[method] = _in_child(args, f"gen_{method}", GEN_PROMPT, GEN_RESPONSES, GEN_RESPONSES)
        _compare(case, "padded", "packed")
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
    if args.parallel:
        from tools.bench import parallel

        args.hidden, args.layers = args.hidden or 1024, args.layers or 16
        return parallel.main(args)
    args.hidden, args.layers = args.hidden or 256, args.layers or 4
    result = run(args)
    if printed_as_json(args, result):
        return 0
    print(f"learner bench: one PPO policy step, llama-style {args.hidden}x{args.layers}, LoRA rank 8, {result['model']['device']}")
    for c in result["cases"]:
        parts = []
        if c.get("generation"):
            for method in ("padded", "packed", "packed_checkpointed"):
                r = c.get(method, {})
                done = f"{r['peak_mb']:.0f} MB, {r['transitions_per_s']:.2f} responses/s" if "peak_mb" in r else r.get("error", "?")
                parts.append(f"{method} {done}")
            extra = f"  memory {c['memory_ratio']}x less, {c['speedup']}x faster" if "memory_ratio" in c else ""
            print(f"  generation, {c['responses']} responses of 64-512 tokens after {c['prompt_tokens']}: " + "; ".join(parts) + extra)
            continue
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
