"""`ppoz bench memory`'s sharded parts: a full fine-tune's update on one rank of 2 or 4 (FSDP2, learner_node/sharding.py).

FSDP2 cannot run on the meta device, so these parts run the learner's own update as rank 0 of N on fake tensors
with torch's fake process group (tools/bench/meta_trace.py `fake_ranks`): each rank holds its shard of every
block's float32 master weights, gradients and Adam moments, and all-gathers a block's bf16 parameters for its
forward and backward; the embeddings, final norm and LM head stay whole on every rank, as `sharding.shard` leaves
them. The models are built and sharded as learner_node/loading.py does for a model that is no local safetensors
folder (whole, a frozen copy for the reference, both sharded); what is counted is the update cycle on top of the
sharded models, not their loading (a local folder loads straight into each rank's shards, learner_node/sharded_load.py).

`check` is the instrument against the real thing: the same sharded cycle at a small shape computed on real CPU
tensors (collectives still fake) and traced on fake ones.
"""

from __future__ import annotations

import copy
import multiprocessing
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import torch

from tools.bench.memory_workloads import GB, Measured, generated_segments, learner_config, words_tokenizer
from tools.bench.train_tasks import shape_config

T = TypeVar("T")


def sharded_cycles(shape: str, layers: int, world: int, segments: list[Any], cycles: int = 2, fake_tensors: bool = True) -> Measured:
    """Rank 0's peak while the learner's full fine-tune (lora_rank 0) runs `cycles` update cycles (the critic's values
    for GAE, the undo snapshot, the update) on `segments`, sharded over `world` ranks."""
    from transformers import AutoModelForCausalLM

    from common.shared_settings import PolicyStamp
    from learner_node import sharding
    from learner_node.policy import LearnerPolicy
    from learner_node.trainer import Trainer
    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import fake_ranks

    cfg = learner_config(0)
    tokenizer = words_tokenizer()
    stamp = PolicyStamp(run="bench", normalisation="token", temperature=1.0, lora_rank=0, greedy=False)
    with fake_ranks(world, fake_tensors) as mesh:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(shape_config(shape, layers), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        with warnings.catch_warnings():  # torch's deepcopy of a tensor asks a fake one for its data pointer
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            frozen = copy.deepcopy(model).requires_grad_(False)
        sharding.shard(frozen, True, mesh)
        sharding.shard(model, True, mesh)
        gen = cfg.generation
        lp = LearnerPolicy(model, tokenizer, "token", 1.0, cfg.value_hidden, "packed", gen.value_hidden, True, "packed", frozen=frozen)

        def run() -> None:
            trainer = Trainer(cfg, lp, True)
            for update in range(cycles):
                batches = trainer.build(segments, 0, stamp)
                undo = trainer.snapshot()
                trainer.update(trainer.parts(batches), True, update)
                del undo, batches

        peak = peak_memory(run, [model, frozen, lp.value_head, lp.token_value_head], device="cpu")
    return Measured(peak.total)


def in_own_process(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a fresh process (spawned: no torch state shared), its result returned: one fake
    process group and one fake run a process (see tools/bench/meta_trace.py `fake_ranks`)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def check(shape: str = "tiny-qwen2", world: int = 4) -> dict[str, Any]:
    """The sharded full fine-tune at `shape` (2 layers, 8 responses of 16-64 tokens) on `world` ranks, computed on
    real CPU tensors and traced on fake ones: rank 0's peaks and their ratio."""
    segments = generated_segments(8, prompt=16, low=16, high=64)
    out: dict[str, Any] = {"part": f"full fine-tune on {world} ranks at {shape}'s width, 2 layers, 8 responses"}
    for leg, fake in (("cpu", False), ("traced", True)):
        started = time.monotonic()
        out[f"{leg}_gb"] = round(in_own_process(_on_cpu_branches, shape, world, segments, fake).peak / GB, 3)
        out[f"{leg}_seconds"] = round(time.monotonic() - started, 1)
    out["traced_over_cpu"] = round(out["traced_gb"] / out["cpu_gb"], 3)
    return out


def _on_cpu_branches(shape: str, world: int, segments: list[Any], fake: bool) -> Measured:
    from tools.bench.meta_trace import cpu_branches

    with cpu_branches():
        return sharded_cycles(shape, 2, world, segments, fake_tensors=fake)
