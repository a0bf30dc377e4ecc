"""`ppoz bench generate`: PPOZ's generation engine against transformers' ways of generating, side by side.

Legs, each given the same requests on the same model (a Llama-style decoder with random
weights and the actor's default LoRA adapter, saved and loaded through `from_pretrained`):
- `one_at_a_time`: `model.generate` on one request after another, in arrival order
  (PPOAPI's server: every client waits for the ones before it);
- `static_batch`: `model.generate` on all requests as one left-padded batch, started when
  the last one has arrived, run to the longest budget;
- `generate_batch`: transformers' continuous batching (`model.generate_batch`, its paged
  KV cache), started when the last request has arrived, run to the longest budget;
- `ppoz`: PPOZ's engine (actor_node/generation_engine.py) in this process, requests added as
  they arrive, with the LoRA adapter folded into the base weights while rows run (its
  default, actor_node/lora_merge.py);
- `ppoz_unfolded`: the same engine computing the adapter as peft does, as the
  transformers legs do: the difference from `ppoz` is the fold, the rest is the engine;
- `ppoz_broker`: the same requests from concurrent clients through a real broker
  (embedded Redis) to one actor process's thread: the whole path a client sees.

Cases: `default` (16 prompts of 512 tokens, 128 greedy tokens each, all arriving at once);
`long_tail` (prompts of 32 to 2,048 tokens and budgets of 16 to 512, both log-uniform,
arriving over `--spread` seconds); `rollout` (4 prompts, 8 seeded samples of each at
temperature 1, as `rollout_n` = 8 asks).

A leg's tokens are the response tokens each request asked for (up to its budget or its
end-of-sequence token); tokens/s is their sum over the leg's wall time, from the first
arrival to the last answer. Latency is from a request's arrival to its answer. Legs run in
alternating order (A B C, C B A, ...) `--repeats` times; medians are reported with min and
max. `peak_fraction` is the FLOPs the work needs at least (each token once through the
layers, attention to its context, the LM head at generated positions) over the leg's time,
as a fraction of a large matmul's rate measured in the same run. Greedy legs' outputs are
compared token by token with one_at_a_time's.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ppoz.flags import add_device_flag, add_json_flag, add_repeats_flag
from tools.bench import load_at_start, measured_legs, printed_as_json
from tools.bench.generate_legs import (
    LegRun,
    Request,
    generate_batch,
    one_at_a_time,
    ppoz_broker,
    ppoz_engine,
    static_batch,
)

log = logging.getLogger(__name__)

LEGS = ("one_at_a_time", "static_batch", "generate_batch", "ppoz", "ppoz_unfolded", "ppoz_broker")
CASES = ("default", "long_tail", "rollout")
SHAPES = ("llama", "qwen2.5-0.5b", "qwen2.5-1.5b", "tiny-qwen2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    parser.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)} (default: all)")
    add_repeats_flag(parser, "runs of every leg, in alternating order (default: 3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="rounds of every leg before the timed ones, not counted (default: 1): a GPU's captures"
    )
    parser.add_argument(
        "--clients", type=int, default=16, help="requests of the default and long_tail cases, and the engine's rows (default: 16)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt, default and rollout cases (default: 512)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per response, default and rollout cases (default: 128)")
    parser.add_argument("--spread", type=float, default=2.0, help="long_tail: requests arrive over this many seconds (default: 2)")
    parser.add_argument(
        "--shape",
        default="llama",
        choices=SHAPES,
        help="llama: a Llama of --hidden x --layers and a byte tokenizer (default); qwen2.5-0.5b: Qwen2.5-0.5B's configuration "
        "(hidden 896, 24 layers, 14 heads, 2 KV heads, a 151,936-token vocabulary, tied embeddings), random weights, "
        "a byte-level BPE (ppoz bench train's real-shape model; --hidden and --layers do not apply); qwen2.5-1.5b: "
        "Qwen2.5-1.5B's (hidden 1536, 28 layers, 12 heads, 2 KV heads); tiny-qwen2: the same vocabulary at hidden 64 x 2 layers",
    )
    parser.add_argument("--hidden", type=int, default=512, help="model width, --shape llama (default: 512)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, --shape llama (default: 4)")
    add_device_flag(parser, "cpu, cuda or auto (default)")
    add_json_flag(parser, "print one JSON object instead of tables")


def build_model(path: Path, hidden: int, layers: int) -> str:
    from transformers import AutoModelForCausalLM

    from models.tiny_models import build_byte_tokenizer, tiny_config

    tokenizer = build_byte_tokenizer(path)
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden=hidden, layers=layers, heads=heads, kv_heads=heads)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


def letters(n_tokens: int, rng: random.Random) -> str:
    """A prompt of the start token and n - 1 letters: n tokens with a byte tokenizer, at most n with a BPE."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n_tokens - 1))


def make_case(name: str, args: argparse.Namespace) -> list[Request]:
    rng = random.Random(0)
    if name == "default":
        return [Request(letters(args.prompt_tokens, rng), args.prompt_tokens, args.new_tokens, 0.0) for _ in range(args.clients)]
    if name == "long_tail":

        def log_uniform(low: int, high: int) -> int:
            return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))

        arrivals = sorted(rng.uniform(0, args.spread) for _ in range(args.clients))
        requests = []
        for arrival in arrivals:
            n = log_uniform(32, 2048)
            requests.append(Request(letters(n, rng), n, log_uniform(16, 512), arrival))
        return requests
    if name == "rollout":
        prompts = [letters(args.prompt_tokens, rng) for _ in range(4)]
        return [Request(p, args.prompt_tokens, args.new_tokens, 0.0, 1.0, 8 * i + k) for i, p in enumerate(prompts) for k in range(8)]
    raise SystemExit(f"ppoz bench generate: unknown case {name!r}; known: {', '.join(CASES)}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- figures -------------------------------------------------------------------------------------
def floor_flops(config: Any, requests: list[Request], outputs: list[list[int]]) -> float:
    """FLOPs the work needs at least: every token once through the layers, attention to its context, the head where generated."""
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_token = 2 * layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    total = 0.0
    for r, out in zip(requests, outputs):
        tokens = r.prompt_tokens + len(out)
        total += per_token * tokens + 4 * layers * h * tokens * (tokens + 1) / 2 + 2 * h * config.vocab_size * len(out)
    return total


def texts_of(run: LegRun, tokenizer: Any) -> list[str]:
    return run.texts if run.texts is not None else [tokenizer.decode(o, skip_special_tokens=True) for o in run.outputs]


def summarise(runs: list[LegRun]) -> dict[str, Any]:
    rates = [run.tokens / run.seconds for run in runs]
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "p50_ms": statistics.median(statistics.median(run.latencies_ms) for run in runs),
        "p99_ms": statistics.median(percentile(run.latencies_ms, 0.99) for run in runs),
        "seconds": statistics.median(run.seconds for run in runs),
        "tokens": runs[-1].tokens,
    }


ENGINE_ROWS = 64  # the engine's rows at most: the static batch's, so both legs decode the same number at once


def run_case(
    name: str, args: argparse.Namespace, legs: list[str], model: Any, tokenizer: Any, model_dir: str, peak: float
) -> dict[str, Any]:
    requests = make_case(name, args)
    rows = min(len(requests), ENGINE_ROWS)
    calls: dict[str, Callable[[], LegRun]] = {
        "one_at_a_time": lambda: one_at_a_time(model, tokenizer, requests),
        "static_batch": lambda: static_batch(model, tokenizer, requests),
        "generate_batch": lambda: generate_batch(model, tokenizer, requests),
        "ppoz": lambda: ppoz_engine(model, tokenizer, requests, rows),
        "ppoz_unfolded": lambda: ppoz_engine(model, tokenizer, requests, rows, fold_lora=False),
        "ppoz_broker": lambda: ppoz_broker(model_dir, args.device, tokenizer, requests, rows),
    }
    runs: dict[str, list[LegRun]] = {leg: [] for leg in legs}
    errors: dict[str, str] = {}
    for repeat in range(-args.warmup, args.repeats):  # the warm-up rounds first, not counted: a GPU's captures, its caches
        order = legs if repeat % 2 == 0 else legs[::-1]
        for leg in order:
            if leg in errors:
                continue
            log.info("%s: %s, %s", name, leg, f"run {repeat + 1} of {args.repeats}" if repeat >= 0 else "warm-up")
            try:
                with torch.inference_mode():
                    run = calls[leg]()
                if repeat >= 0:
                    runs[leg].append(run)
            except Exception as e:  # noqa: BLE001 - a baseline this transformers cannot run is reported, not fatal
                log.warning("%s: %s failed: %s: %s", name, leg, type(e).__name__, e)
                errors[leg] = f"{type(e).__name__}: {e}"
    result: dict[str, Any] = {"requests": len(requests), "rows": rows, "errors": errors}
    greedy = all(r.temperature == 0 for r in requests)
    reference = runs.get("one_at_a_time", [None])[-1] if runs.get("one_at_a_time") else None
    for leg in legs:
        if not runs[leg]:
            continue
        figures = summarise(runs[leg])
        if runs[leg][-1].decode is not None:
            figures["decode_step"] = runs[leg][-1].decode  # captures, eager buckets, replays: a timed run should capture nothing
        figures["peak_fraction"] = floor_flops(model.config, requests, runs[leg][-1].outputs) / figures["seconds"] / peak
        if greedy and reference is not None:
            figures["differing_outputs"] = sum(a != b for a, b in zip(texts_of(reference, tokenizer), texts_of(runs[leg][-1], tokenizer)))
        result[leg] = figures
    for base in ("one_at_a_time", "static_batch"):
        if base in result:
            for leg in legs:
                if leg in result:
                    result[leg][f"vs_{base}"] = result[leg]["tokens_per_s"] / result[base]["tokens_per_s"]
    return result


def main(args: argparse.Namespace) -> int:
    from common.shared_settings import PolicySpec
    from models.policy_model import ModelSpec, load_policy
    from tools.bench.scoring import matmul_rate

    legs = [leg for leg in args.legs.split(",") if leg]
    cases = [case for case in args.cases.split(",") if case]
    unknown = [x for x in legs if x not in LEGS] + [x for x in cases if x not in CASES]
    if unknown:
        raise SystemExit(f"ppoz bench generate: unknown {', '.join(unknown)}; legs: {', '.join(LEGS)}; cases: {', '.join(CASES)}")
    if min(args.clients, args.prompt_tokens, args.new_tokens, args.repeats, args.layers) < 1 or args.hidden < 64 or args.hidden % 64:
        raise SystemExit("ppoz bench generate: counts must be positive and --hidden a multiple of 64")
    if not 0 <= args.spread <= 600:
        raise SystemExit(f"ppoz bench generate: --spread must be from 0 to 600 seconds, got {args.spread}")
    for noisy in ("broker", "actor_node", "common", "client"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    load = load_at_start("generate")
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "llama":
            model_dir = build_model(Path(tmp) / "model", args.hidden, args.layers)
        else:  # built once into the cache, as ppoz bench train's real-shape task builds it
            from tools.bench.train_tasks import real_shape_model

            model_dir = str(real_shape_model(args.shape))
        spec = ModelSpec.of(PolicySpec(model=model_dir), args.device)
        model, tokenizer = load_policy(spec)
        device, dtype = spec.resolved_device(), spec.resolved_dtype()
        peak = matmul_rate(device, dtype)
        for case in cases:
            result[case] = run_case(case, args, legs, model, tokenizer, model_dir, peak)
        peak = max(peak, matmul_rate(device, dtype))  # measured again after the legs: the better of the two
    result["setup"] = {
        "shape": args.shape,
        "architecture": model.config.model_type,
        "hidden": model.config.hidden_size,
        "layers": model.config.num_hidden_layers,
        "vocab": model.config.vocab_size,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "clients": args.clients,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "spread_s": args.spread,
        "repeats": args.repeats,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_gflops": peak / 1e9,
        "load_average_at_start": load,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    if printed_as_json(args, result):
        return 0
    s = result["setup"]
    print(
        f"{s['architecture']} hidden {s['hidden']} x {s['layers']} layers, vocabulary {s['vocab']:,}, + LoRA on {s['device']} "
        f"({s['gpu'] or s['dtype']}{', ' + s['dtype'] if s['gpu'] else ''}), {s['machine']}; "
        f"matmul {s['matmul_gflops']:.0f} GFLOP/s; load average {load:.2f} at start; medians of {args.repeats} runs"
    )
    for case in cases:
        c = result[case]
        print(f"\n{case}: {c['requests']} requests, {c['rows']} engine rows")
        header = f"{'leg':<16}{'tokens/s':>10}{'(min-max)':>16}{'p50 ms':>9}{'p99 ms':>9}"
        print(f"{header}{'vs 1-by-1':>10}{'vs static':>10}{'peak':>7}{'differ':>7}")
        for leg, v in measured_legs(c, legs, width=16, error_chars=100):
            spread = f"({v['tokens_per_s_min']:.0f}-{v['tokens_per_s_max']:.0f})"
            vs1 = f"{v['vs_one_at_a_time']:.2f}x" if "vs_one_at_a_time" in v else "-"
            vs2 = f"{v['vs_static_batch']:.2f}x" if "vs_static_batch" in v else "-"
            print(
                f"{leg:<16}{v['tokens_per_s']:>10.1f}{spread:>16}{v['p50_ms']:>9.0f}{v['p99_ms']:>9.0f}{vs1:>10}{vs2:>10}"
                f"{v['peak_fraction']:>7.2f}{v.get('differing_outputs', '-'):>7}"
            )
    return 0
