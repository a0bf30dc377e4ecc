"""`ppoz bench generate`: responses for many clients at once, PPOAPI's way and PPOZ's, side by side on one model.

- `sequential`: one request at a time with transformers' `model.generate` (PPOAPI's
  server: every client waits for the ones before it). All requests arrive at once,
  so a request's latency is its own generation plus everything generated before it.
- `ppoz`: the same requests from `--clients` client threads at once, through a real
  broker (embedded Redis) to one actor serving the same model: its generation
  engine batches them in one KV cache (actor_node/generation.py).

Greedy decoding (temperature 0) on both, so the outputs can be compared: `outputs_equal`
says whether every response's text is the same. The model is a Llama-style decoder
with random weights (timing needs no training) and a byte-level tokenizer, saved and
loaded through `from_pretrained` as the actor loads any model, with the default LoRA
adapter (identity at start) on both sides. Prompts are random letters, one token each.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients, one request each per round (default: 16)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default: 512)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per response (default: 128)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of requests, each client one request per round (default: 1)")
    parser.add_argument("--hidden", type=int, default=512, help="model width (default: 512)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def build_model(path: Path, hidden: int, layers: int) -> str:
    from transformers import AutoModelForCausalLM

    from common.tiny_models import build_byte_tokenizer, tiny_config

    tokenizer = build_byte_tokenizer(path)
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden=hidden, layers=layers, heads=heads, kv_heads=heads)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


def prompts(n: int, tokens: int, seed: int = 0) -> list[str]:
    """n prompts of `tokens` byte tokens each (the start token and tokens - 1 letters)."""
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(tokens - 1)) for _ in range(n)]


def percentiles(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"p50_ms": statistics.median(ordered), "p99_ms": ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]}


def sequential(model: Any, tokenizer: Any, texts: list[str], new_tokens: int) -> tuple[dict[str, float], list[str]]:
    """One request at a time with model.generate, all arriving at time 0."""
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    outputs, latencies, tokens = [], [], 0
    started = time.perf_counter()
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").to(device)
            out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
            response = out[0, ids["input_ids"].shape[1] :]
            tokens += int(response.shape[0])
            outputs.append(tokenizer.decode(response, skip_special_tokens=True))
            latencies.append((time.perf_counter() - started) * 1000)
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": tokens / elapsed, **percentiles(latencies), "seconds": elapsed, "tokens": tokens}, outputs


def through_ppoz(model_dir: str, device: str, rounds: list[list[str]], new_tokens: int) -> tuple[dict[str, float], list[str]]:
    """The same requests from concurrent clients through a real broker and one actor."""
    from actor_node.config import ActorConfig
    from actor_node.main import run_actor
    from broker.config import BrokerConfig
    from broker.server import Broker
    from client import Client
    from common.redis_server import EmbeddedRedis, connect
    from common.shared_settings import PolicySpec

    clients = len(rounds[0])
    outputs: list[str] = [""] * sum(len(r) for r in rounds)
    latencies: list[float] = []
    tokens = 0
    lock = threading.Lock()
    with EmbeddedRedis() as redis_server:
        broker = Broker(
            BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", redis_url=redis_server.url, segment_len=1),
            connect(redis_server.url),
        )
        broker.start()
        threading.Thread(target=broker.run, name="broker", daemon=True).start()
        stop = threading.Event()
        actor_cfg = ActorConfig(
            broker=broker.backend_endpoint,
            policy=PolicySpec(model=model_dir),
            device=device,
            credits=clients,
            max_generate_rows=clients,
            prefix_cache_mb=0,  # every prompt is new: the cache would only cost
        )
        actor = threading.Thread(target=run_actor, args=(actor_cfg, stop), name="actor", daemon=True)
        actor.start()
        with Client(broker.frontend_endpoint, deadline=600, attempt_timeout=600) as probe:
            end = time.monotonic() + 300
            while not probe.status()["actors"]:
                if time.monotonic() > end:
                    raise SystemExit("ppoz bench generate: the actor did not start within 300 s")
                time.sleep(0.1)
        started = time.perf_counter()
        for index, batch in enumerate(rounds):
            barrier = threading.Barrier(clients)

            def one(i: int, text: str, slot: int, barrier: threading.Barrier = barrier) -> None:
                nonlocal tokens
                with Client(broker.frontend_endpoint, deadline=600, attempt_timeout=600) as client:
                    task = client.attach()
                    barrier.wait()
                    sent = time.perf_counter()
                    reply = client.generate(task, text, max_new_tokens=new_tokens, temperature=0.0)
                    took = (time.perf_counter() - sent) * 1000
                    client.feedback(task, 0.0, done=True)
                with lock:
                    outputs[slot] = reply["text"]
                    latencies.append(took)
                    tokens += int(reply["n_tokens"])

            threads = [threading.Thread(target=one, args=(i, t, index * clients + i)) for i, t in enumerate(batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elapsed = time.perf_counter() - started
        stop.set()
        actor.join(30)
        broker.stop()
    return {"tokens_per_s": tokens / elapsed, **percentiles(latencies), "seconds": elapsed, "tokens": tokens}, outputs


def main(args: argparse.Namespace) -> int:
    from common.policy_model import ModelSpec, load_policy
    from common.shared_settings import PolicySpec

    if min(args.clients, args.prompt_tokens, args.new_tokens, args.rounds, args.layers) < 1 or args.hidden < 64 or args.hidden % 64:
        raise SystemExit("ppoz bench generate: counts must be positive and --hidden a multiple of 64")
    for noisy in ("broker", "actor_node", "common", "client"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.hidden, args.layers)
        spec = ModelSpec.of(PolicySpec(model=model_dir), args.device)
        model, tokenizer = load_policy(spec)
        texts = prompts(args.clients * args.rounds, args.prompt_tokens)
        log.info("sequential: %d requests one at a time", len(texts))
        seq, seq_out = sequential(model, tokenizer, texts, args.new_tokens)
        del model
        log.info("ppoz: %d clients at once through a broker and one actor", args.clients)
        rounds = [texts[i : i + args.clients] for i in range(0, len(texts), args.clients)]
        ours, ours_out = through_ppoz(model_dir, args.device, rounds, args.new_tokens)
    result = {
        "sequential": {k: seq[k] for k in ("tokens_per_s", "p50_ms", "p99_ms")},
        "ppoz": {k: ours[k] for k in ("tokens_per_s", "p50_ms", "p99_ms")},
        "outputs_equal": seq_out == ours_out,
        "speedup": ours["tokens_per_s"] / seq["tokens_per_s"],
        "differing_outputs": sum(a != b for a, b in zip(seq_out, ours_out)),
        "tokens": {"sequential": seq["tokens"], "ppoz": ours["tokens"]},
        "setup": {
            "clients": args.clients,
            "rounds": args.rounds,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "hidden": args.hidden,
            "layers": args.layers,
            "device": str(spec.resolved_device()),
            "dtype": str(spec.resolved_dtype()).replace("torch.", ""),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        },
    }
    if args.json:
        print(json.dumps(result))
        return 0
    s: dict[str, Any] = result["setup"]  # type: ignore[assignment]
    print(
        f"{s['clients']} clients x {s['rounds']} rounds, {s['prompt_tokens']}-token prompts, {s['new_tokens']}-token greedy responses; "
        f"Llama hidden {s['hidden']} x {s['layers']} layers on {s['device']} ({s['dtype']})"
    )
    print(f"{'method':<12}{'tokens/s':>12}{'p50 ms':>12}{'p99 ms':>12}")
    for name in ("sequential", "ppoz"):
        v: dict[str, float] = result[name]  # type: ignore[assignment]
        print(f"{name:<12}{v['tokens_per_s']:>12.1f}{v['p50_ms']:>12.0f}{v['p99_ms']:>12.0f}")
    print(f"ppoz / sequential: {result['speedup']:.2f}x tokens/s; outputs equal: {result['outputs_equal']}")
    return 0
