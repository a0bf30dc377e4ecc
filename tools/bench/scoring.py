"""`ppoz bench scoring`: three ways to score Kea-shaped observations, side by side on one model.

- `full_sequences`: one padded sequence per candidate, the whole batch at once,
  logits at every position (the TWOSOME way).
- `kv_per_action`: the prompt's KV once, then one forward per candidate on a deep
  copy of that cache, logits at every position (what the PPOAPI server meant to do).
- `kv_per_action_lean`: the same made as cheap as it gets (LM head only at scored
  positions, the cache cropped back instead of copied), to show what the
  packed layout gains beyond the LM head.
- `ppoz`: this actor's packed path (models/scoring.py).
 The model is a Llama-style decoder with
random weights (timing needs no training); token ids are random. Every method's
log-probabilities are compared with `full_sequences`.

`peak_fraction` = (the FLOPs the work needs at least: the prompt once, each
candidate once, attention, and the LM head at scored positions) / (this
machine's fp32 matmul rate, measured in the same run) / (the time taken).
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from models.kv_cache import cache_kwargs, returned_cache
from ppoz.flags import add_device_flag, add_json_flag, add_repeats_flag
from tools.bench import add_model_shape_flags, printed_as_json

log = logging.getLogger(__name__)

SHAPES = [(1024, 3), (1024, 11), (1024, 32), (4096, 3), (4096, 11), (4096, 32)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_shape_flags(
        parser, hidden=512, layers=8, vocab=32000, hidden_help="model width (default 512: about 58M parameters with --layers 8)"
    )
    add_device_flag(parser)
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: bfloat16 on GPU, float32 on CPU")
    add_repeats_flag(parser, "timed runs per method (median); a method slower than 5 s runs once")
    parser.add_argument("--shapes", default="", help="prompt x candidates list, e.g. 1024x32,4096x32 (default: all six Kea shapes)")
    parser.add_argument("--history-steps", type=int, default=16, help="steps of the growing-history case (default: 16)")
    add_json_flag(parser)


def build_model(hidden: int, layers: int, vocab: int, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model: Any = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def observation(prompt: int, n_actions: int, vocab: int, gen: torch.Generator):
    from models.scoring import Tokenized

    ctx = tuple(torch.randint(3, vocab, (prompt,), generator=gen).tolist())
    acts = tuple(
        tuple(torch.randint(3, vocab, (int(torch.randint(45, 56, (1,), generator=gen)),), generator=gen).tolist()) for _ in range(n_actions)
    )
    return Tokenized(ctx, acts, tuple(1 for _ in acts))


def full_sequences(model: Any, item: Any, logits_budget_mb: int = 2048) -> torch.Tensor:
    """TWOSOME's way: every candidate as its own padded sequence, logits at every position.

    The sequences go through in batches small enough that their full logits fit
    `logits_budget_mb` (at 4k x 32 all at once they would need 17 GB)."""
    device = next(model.parameters()).device
    c = len(item.context)
    longest = max(len(a) for a in item.actions)
    per_sequence = (c + longest) * model.config.vocab_size * 4 * 2  # logits + their log-softmax, float32
    chunk = max(1, int(logits_budget_mb * 2**20 // per_sequence))
    sums = []
    for start in range(0, len(item.actions), chunk):
        actions = item.actions[start : start + chunk]
        ids = torch.zeros(len(actions), c + longest, dtype=torch.long, device=device)
        attn = torch.zeros(len(actions), c + longest, dtype=torch.long, device=device)
        for j, a in enumerate(actions):
            ids[j, : c + len(a)] = torch.tensor(list(item.context) + list(a), device=device)
            attn[j, : c + len(a)] = 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
        sums += [logp[j, c - 1 : c - 1 + len(a)].gather(-1, torch.tensor(a, device=device)[:, None]).sum() for j, a in enumerate(actions)]
        del logp
    return torch.stack(sums)


def full_sequences_scores(model: Any, item: Any) -> torch.Tensor:
    """One padded sequence per candidate, the LM head only at scored positions (the learner bench's baseline)."""
    from models.scoring import model_parts, token_logprobs

    decoder, head, cap = model_parts(model)
    device = next(model.parameters()).device
    c, k = len(item.context), len(item.actions)
    longest = max(len(a) for a in item.actions)
    ids = torch.zeros(k, c + longest, dtype=torch.long, device=device)
    attn = torch.zeros(k, c + longest, dtype=torch.long, device=device)
    for j, a in enumerate(item.actions):
        ids[j, : c + len(a)] = torch.tensor(list(item.context) + list(a), device=device)
        attn[j, : c + len(a)] = 1
    hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state
    return torch.stack(
        [
            token_logprobs(head, cap, hidden[j, c - 1 : c - 1 + len(a)], torch.tensor(a, device=device)).sum()
            for j, a in enumerate(item.actions)
        ]
    )


def kv_per_action(model: Any, item: Any) -> torch.Tensor:
    """What the PPOAPI server meant to do: the prompt's KV once, then per candidate a forward on a
    fresh copy of that cache (its bug was reusing one cache), logits at every position."""
    import copy

    device = next(model.parameters()).device
    c = len(item.context)
    out = model(input_ids=torch.tensor([item.context], device=device), use_cache=True)
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    sums = []
    for a in item.actions:
        lp = first[a[0]]
        if len(a) > 1:
            pos = torch.arange(c, c + len(a) - 1, device=device)[None]
            logits = model(
                input_ids=torch.tensor([a[:-1]], device=device),
                position_ids=pos,
                **cache_kwargs(model, copy.deepcopy(returned_cache(out))),
            ).logits[0]
            lp = lp + torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(a[1:], device=device)[:, None]).sum()
        sums.append(lp)
    return torch.stack(sums)


def kv_per_action_lean(model: Any, item: Any) -> torch.Tensor:
    """kv_per_action made as cheap as it gets: the LM head only at scored positions, and the
    cache cropped back after each candidate instead of copied."""
    from models.scoring import model_parts, token_logprobs

    decoder, head, cap = model_parts(model)
    device = next(model.parameters()).device
    c = len(item.context)
    out = decoder(input_ids=torch.tensor([item.context], device=device), use_cache=True)
    cache, last = returned_cache(out), out.last_hidden_state[:, -1]
    sums = []
    for a in item.actions:
        lp = token_logprobs(head, cap, last, torch.tensor(a[:1], device=device)).sum()
        if len(a) > 1:
            pos = torch.arange(c, c + len(a) - 1, device=device)[None]
            h = decoder(
                input_ids=torch.tensor([a[:-1]], device=device), position_ids=pos, **cache_kwargs(decoder, cache)
            ).last_hidden_state[0]
            cache.crop(-(len(a) - 1))  # back to the prompt alone for the next candidate
            lp = lp + token_logprobs(head, cap, h, torch.tensor(a[1:], device=device)).sum()
        sums.append(lp)
    return torch.stack(sums)


def ppoz_packed(model: Any, item: Any) -> torch.Tensor:
    from models.scoring import score_packed

    return score_packed(model, [item])[0]


METHODS = {"full_sequences": full_sequences, "kv_per_action": kv_per_action, "kv_per_action_lean": kv_per_action_lean, "ppoz": ppoz_packed}


def floor_flops(model: Any, items: list[Any]) -> float:
    """FLOPs the scoring needs at least: each token once through the layers, attention, head at scored positions."""
    cfg = model.config
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_token = 2 * layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)
    total = 0.0
    for item in items:
        c, sizes = len(item.context), [len(a) for a in item.actions]
        tokens = c + sum(sizes)
        keys = c * (c + 1) / 2 + sum(s * c + s * (s + 1) / 2 for s in sizes)
        total += per_token * tokens + 4 * layers * h * keys + 2 * h * cfg.vocab_size * sum(sizes)
    return total


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of a large matmul on this device, measured now."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Median wall time (ms) over up to `repeats` runs, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            result = fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
        if times[-1] > 5000:
            break
    return statistics.median(times), result


def growing_history(model: Any, args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    """16 steps of one task; each prompt is the previous one plus 200 tokens; 3 candidates."""
    from actor_node.prefix_cache import PrefixCache
    from models.scoring import Tokenized, score_packed, score_packed_kv

    base = observation(1024, 3, args.vocab, gen)
    steps = []
    ctx = list(base.context)
    for _ in range(args.history_steps):
        steps.append(Tokenized(tuple(ctx), observation(1, 3, args.vocab, gen).actions, (1, 1, 1)))
        ctx += torch.randint(3, args.vocab, (200,), generator=gen).tolist()

    def without_cache() -> list[torch.Tensor]:
        return [score_packed(model, [s])[0] for s in steps]

    def with_cache() -> list[torch.Tensor]:
        cache = PrefixCache(budget_mb=4096)
        out = []
        for s in steps:
            (scores,), (kv,) = score_packed_kv(model, [s], [cache.lookup(s.context)])
            cache.insert("task", s.context, kv)
            out.append(scores)
        return out

    ms_plain, plain = timed(without_cache, device, args.repeats)
    ms_cached, cached = timed(with_cache, device, args.repeats)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(plain, cached))
    return {
        "case": f"growing history, {args.history_steps} steps",
        "prompt_tokens": [len(steps[0].context), len(steps[-1].context)],
        "n_actions": 3,
        "ppoz_no_cache": round(ms_plain, 1),
        "ppoz": round(ms_cached, 1),
        "speedup": round(ms_plain / ms_cached, 2),
        "max_abs_logprob_diff": diff,
    }


def _shape(text: str) -> tuple[int, int]:
    """`PROMPTxACTIONS` (for example 4096x11), as --shapes gives it."""
    try:
        prompt, n_actions = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not PROMPTxACTIONS (for example 4096x11)") from None
    return prompt, n_actions


def run(args: argparse.Namespace) -> dict[str, Any]:
    from models.policy_model import ModelSpec

    spec = ModelSpec(model="bench", device=args.device, dtype=args.dtype)
    device, dtype = spec.resolved_device(), spec.resolved_dtype()
    model = build_model(args.hidden, args.layers, args.vocab, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    rate = matmul_rate(device, dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES
    if args.shapes:
        shapes = [_shape(s) for s in args.shapes.split(",")]
    cases = []
    for prompt, n in shapes:
        item = observation(prompt, n, args.vocab, gen)
        timed(functools.partial(ppoz_packed, model, item), device, 1)  # warm-up
        case: dict[str, Any] = {"prompt_tokens": prompt, "n_actions": n, "candidate_tokens": sum(len(a) for a in item.actions)}
        results = {}
        for name, fn in METHODS.items():
            ms, results[name] = timed(functools.partial(fn, model, item), device, args.repeats)
            case[name] = round(ms, 1)
        flops = floor_flops(model, [item])
        case["max_abs_logprob_diff"] = {
            k: float((results[k].float() - results["full_sequences"].float()).abs().max()) for k in METHODS if k != "full_sequences"
        }
        case["peak_fraction"] = {k: round(flops / rate / (case[k] / 1000), 4) for k in METHODS}
        case["speedup_vs"] = {k: round(case[k] / case["ppoz"], 2) for k in METHODS if k != "ppoz"}
        log.info("%s", case)
        cases.append(case)
    cases.append(growing_history(model, args, device, gen))
    return {
        "bench": "scoring",
        "model": {
            "arch": "llama",
            "parameters": params,
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": args.vocab,
            "device": str(device),
            "dtype": str(dtype).replace("torch.", ""),
        },
        "matmul_gflops": round(rate / 1e9, 1),
        "cases": cases,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        + (torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
    }


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if printed_as_json(args, result):
        return 0
    m = result["model"]
    print(
        f"scoring bench: llama-style, {m['parameters'] / 1e6:.0f}M parameters, {m['device']} {m['dtype']}, "
        f"matmul {result['matmul_gflops']} GFLOP/s"
    )
    print(
        f"{'prompt x cands':>15} {'full_seq ms':>12} {'kv_per_act ms':>14} {'kv_lean ms':>11} {'ppoz ms':>9} "
        f"{'vs full':>8} {'vs kv':>6} {'vs lean':>8} {'ppoz peak':>9} {'max diff':>9}"
    )
    for c in result["cases"]:
        if "full_sequences" not in c:
            continue
        v = c["speedup_vs"]
        print(
            f"{c['prompt_tokens']:>8} x {c['n_actions']:<4} {c['full_sequences']:>12.1f} {c['kv_per_action']:>14.1f} "
            f"{c['kv_per_action_lean']:>11.1f} {c['ppoz']:>9.1f} {v['full_sequences']:>7.1f}x {v['kv_per_action']:>5.1f}x "
            f"{v['kv_per_action_lean']:>7.1f}x {c['peak_fraction']['ppoz']:>9.3f} {max(c['max_abs_logprob_diff'].values()):>9.1e}"
        )
    g = result["cases"][-1]
    print(
        f"{g['case']} (prompt {g['prompt_tokens'][0]} -> {g['prompt_tokens'][1]} tokens, 3 candidates): "
        f"{g['ppoz_no_cache']:.0f} ms without the prefix cache, {g['ppoz']:.0f} ms with it ({g['speedup']}x), "
        f"max diff {g['max_abs_logprob_diff']:.1e}"
    )
    return 0
