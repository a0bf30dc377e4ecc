"""Where a decode step of the actor's engine goes: `python -m tools.bench.decode_profile --tasks long,real-shape`.

The stack's settings for `ppoz bench train`'s tasks (32 rows sampled at temperature 1: 8 of the task's prompts in
groups of 4), on a fresh engine (the first pass after loading) and again (warm), with the prefix cache on (the
actor's default) and off; then `model.generate` on the same 32 rows twice. The second pass of each engine runs
steps 20 to 30 under torch's profiler and prints its table (self CPU time first: on a GPU the decode step is
bound by the host). A diagnostic, not a bench: it prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time

from ppoz.flags import add_device_flag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", default="long,real-shape", help="ppoz bench train's tasks (default: long,real-shape)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per response (default: 128)")
    add_device_flag(parser, "cpu, cuda or auto (default)")
    args = parser.parse_args(argv)

    import torch

    from actor_node.generation_engine import GenerationEngine
    from models.policy_model import ModelSpec, load_policy
    from tools.bench.train_tasks import TASKS

    for name in args.tasks.split(","):
        task = TASKS[name]
        model, tok = load_policy(ModelSpec(model=str(task.model()), device=args.device, lora_rank=0))
        on_gpu = model.device.type == "cuda"
        rows = task.train_rows()[:8]
        sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0}
        jobs = [
            {
                "job": 4 * i + k,
                "task_id": f"t{i}",
                "deadline_ms": 3_600_000,
                "obs": {"prompt": r["prompt"], "sampling": {**sampling, "seed": 4 * i + k}},
            }
            for i, r in enumerate(rows)
            for k in range(4)
        ]
        for cache_mb in (512.0, 0.0):
            for attempt in ("first", "again, profiled"):
                engine = GenerationEngine(model, tok, max_rows=32, prefix_cache_mb=cache_mb, max_positions=args.new_tokens + 64)
                started, steps, tokens, profiler = time.perf_counter(), 0, 0, None
                engine.add(jobs)
                while engine.active:
                    if attempt != "first" and steps == 20:
                        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
                        profiler = torch.profiler.profile(activities=activities)
                        profiler.__enter__()
                    for _, answer in engine.step():
                        if isinstance(answer, Exception):
                            raise answer
                        tokens += len(answer.response_ids)
                    steps += 1
                    if profiler is not None and steps == 30:
                        profiler.__exit__(None, None, None)
                        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
                        profiler = None
                if on_gpu:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                print(
                    f"{name}, prefix cache {cache_mb:g} MB, {attempt}: {steps} steps, {tokens} tokens, {seconds:.2f} s, "
                    f"{1000 * seconds / steps:.1f} ms a step, {tokens / seconds:.0f} tokens/s",
                    flush=True,
                )
                engine.reset()
        tok.padding_side = "left"
        batch = tok([r["prompt"] for r in rows for _ in range(4)], return_tensors="pt", padding=True).to(model.device)
        for attempt in ("first", "again"):
            started = time.perf_counter()
            out = model.generate(
                **batch, max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id
            )
            if on_gpu:
                torch.cuda.synchronize()
            seconds, steps = time.perf_counter() - started, out.shape[1] - batch["input_ids"].shape[1]
            print(f"{name}, model.generate, {attempt}: {steps} steps, {seconds:.2f} s, {1000 * seconds / steps:.1f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
