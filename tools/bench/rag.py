"""`ppoz bench rag`: what retrieval adds to a step, side by side with the plain step on one model.

Simulated Kea tasks (envs/kea_sim.py) are played by the actor's own code; for
every observation the bench times, one after the other on the same model:

- `step`: scoring the client's observation (LLMPolicy.choose_batch);
- `retrieve`: rag_step's retrieval (embed the query and the newest history
  entry, rank against the corpus index and the history, build the prompt);
- `rag_step`: retrieval plus scoring the augmented observation.

Medians over the steps, and their ratio. The corpus is `--corpus DIR`, or a
synthetic one of `--docs` testing-guide pages written to a temporary folder.
The index build (every chunk embedded once, at actor start) is timed apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common.config import local_path
from ppoz.flags import add_device_flag, add_json_flag, add_model_flag

log = logging.getLogger(__name__)

TOPICS = ["login", "checkout", "settings", "search", "profile", "cart", "licences", "adverts", "sharing", "notifications"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser, "model directory (default: the demo's tiny model, built locally)")
    add_device_flag(parser, "torch device (default: cpu)", default="cpu")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank of the served model (0: none; default: 8)")
    parser.add_argument("--corpus", default="", type=local_path, help="folder of .md/.txt files (default: a synthetic corpus)")
    parser.add_argument("--docs", type=int, default=40, help="pages of the synthetic corpus (default: 40)")
    parser.add_argument("--tasks", type=int, default=4, help="simulated tasks (default: 4)")
    parser.add_argument("--steps", type=int, default=16, help="steps per task (default: 16)")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-context-tokens", type=int, default=256)
    parser.add_argument("--history-len", type=int, default=8)
    add_json_flag(parser)


def synthetic_corpus(folder: Path, pages: int, seed: int = 0) -> None:
    """Testing-guide pages, about 1.5 kB each, on app areas and tarpits."""
    rng = random.Random(seed)
    for i in range(pages):
        topic = TOPICS[i % len(TOPICS)]
        lines = [f"# {topic.title()} guide, part {i // len(TOPICS) + 1}"]
        for j in range(12):
            other = rng.choice(TOPICS)
            lines.append(
                f"On the {topic} screen, the {other} button opens the {other} screen; step {j}: check that Back returns to {topic}."
            )
        (folder / f"{topic}-{i:03d}.md").write_text("\n".join(lines) + "\n")


def _median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from actor_node.rag import Retriever
    from common.shared_settings import RetrievalConfig
    from envs.kea_sim import KeaSim, demo_app
    from models.policy_model import ModelSpec, load_policy

    model_path = args.model
    if not model_path:
        from models.tiny_models import build_tiny_model

        model_path = str(build_tiny_model(Path.home() / ".cache" / "ppoz" / "tiny-llama", "llama", hidden=64, layers=2))  # the demo's
    torch.manual_seed(0)
    model, tokenizer = load_policy(
        ModelSpec(model=model_path, device=args.device, lora_rank=args.lora_rank, lora_alpha=2 * max(args.lora_rank, 1))
    )
    policy = LLMPolicy(model, tokenizer, SamplingConfig(normalisation="token"), "auto", prefix_cache_mb=0.0)
    with tempfile.TemporaryDirectory(prefix="ppoz-rag-bench-") as tmp:
        corpus = args.corpus
        if not corpus:
            corpus = tmp
            synthetic_corpus(Path(tmp), args.docs)
        cfg = RetrievalConfig(corpus_dir=corpus, top_k=args.top_k, max_context_tokens=args.max_context_tokens, history_len=args.history_len)
        started = time.perf_counter()
        retriever = Retriever(cfg, model, tokenizer, device=args.device)
        index_s = time.perf_counter() - started
    step_s, retrieve_s, rag_s, prompt_tokens, added_tokens = [], [], [], [], []
    for task in range(args.tasks):
        env = KeaSim(demo_app(seed=0))
        obs = env.reset(seed=task)
        history: list[dict[str, Any]] = []
        for _ in range(args.steps):
            job = {"job": 0, "task_id": f"t{task}", "mode": "rag_step", "obs": obs, "history": history[-args.history_len :]}
            t0 = time.perf_counter()
            plain = policy.choose_batch([job])[0]
            if isinstance(plain, Exception):
                raise plain
            t1 = time.perf_counter()
            augmented, _ = retriever.augment_job(job)
            t2 = time.perf_counter()
            policy.choose_batch([dict(job, obs=augmented)])
            t3 = time.perf_counter()
            step_s.append(t1 - t0)
            retrieve_s.append(t2 - t1)
            rag_s.append(t3 - t1)
            prompt_tokens.append(len(tokenizer.encode(obs["prompt"], add_special_tokens=False)))
            added_tokens.append(len(tokenizer.encode(augmented["prompt"][len(obs["prompt"]) :], add_special_tokens=False)))
            result = env.step(plain.action)
            # As the broker keeps it (rag_history_chars, equal to query_chars by default).
            history.append({"prompt": obs["prompt"][-cfg.query_chars :], "action": obs["action"][plain.action], "reward": result.reward})
            obs = env.reset() if result.terminated or result.truncated else result.obs
    stats = retriever.stats()
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}, torch {torch.__version__}",
        "model": model_path,
        "device": args.device,
        "lora_rank": args.lora_rank,
        "corpus_chunks": len(retriever.index) if retriever.index is not None else 0,
        "index_build_s": round(index_s, 2),
        "steps": len(step_s),
        "prompt_tokens_median": statistics.median(prompt_tokens),
        "added_tokens_median": statistics.median(added_tokens),
        "added_tokens_max": max(added_tokens),
        "step_ms": _median_ms(step_s),
        "retrieve_ms": _median_ms(retrieve_s),
        "rag_step_ms": _median_ms(rag_s),
        "rag_over_step": round(statistics.median(rag_s) / statistics.median(step_s), 2),
        "embedding_cache_hit_rate": round(stats["cache_hits"] / max(stats["cache_hits"] + stats["cache_misses"], 1), 3),
    }


def main(args: argparse.Namespace) -> int:
    if args.tasks < 1 or args.steps < 1:
        raise SystemExit("ppoz bench rag: --tasks and --steps must be positive")
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"rag_step cost on {result['device']} ({result['machine']}), model {result['model']}, LoRA rank {result['lora_rank']}")
    print(f"corpus: {result['corpus_chunks']} chunks indexed in {result['index_build_s']} s (once, at actor start)")
    print(
        f"{result['steps']} steps; prompt {result['prompt_tokens_median']} tokens (median), retrieval adds "
        f"{result['added_tokens_median']} (median, max {result['added_tokens_max']})"
    )
    print(f"{'median per step':<28}{'ms':>10}")
    for key, name in (
        ("step_ms", "step (score plain obs)"),
        ("retrieve_ms", "retrieval alone"),
        ("rag_step_ms", "rag_step (retrieve + score)"),
    ):
        print(f"{name:<28}{result[key]:>10.2f}")
    print(f"rag_step / step: {result['rag_over_step']}x; embedding cache hit rate {result['embedding_cache_hit_rate']}")
    return 0
