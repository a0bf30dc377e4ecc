"""What one learner forward keeps for its backward, by layer layout: `ppoz bench activations [--json]`.

A Qwen2 of a real model's width (--shape, default Qwen2.5-1.5B: hidden 1,536, 12 heads, 2 KV heads, MLP
8,960) with --layers layers in bf16, a float32 LoRA adapter of rank 8 on every linear layer (the learner's
default, as peft keeps it), one sequence of --tokens tokens. The tensors autograd saves for the backward
are counted through torch's saved-tensor hooks (each storage once), four ways: plain, under bf16 autocast,
with gradient checkpointing (the learner's default on a GPU), and both. Bytes are exact and the same on
any device; the LM head is left out (the learner computes it in chunks).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ppoz.flags import add_json_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="a MODEL_SHAPES name of ppoz bench train (default: qwen2.5-1.5b)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2; per-layer figures scale)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the one sequence (default: 1024)")
    add_json_flag(parser, "print one JSON object")


def saved_bytes(model: Any, ids: Any, autocast: bool) -> int:
    import torch

    seen: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
    hidden.float().sum().backward()
    return sum(seen.values())


def main(args: argparse.Namespace) -> int:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from models.policy_model import enable_gradient_checkpointing
    from tools.bench.train_tasks import shape_config

    config = shape_config(args.shape, layers=args.layers)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    results: dict[str, Any] = {}
    for name, checkpointing, autocast in (
        ("plain", False, False),
        ("autocast", False, True),
        ("checkpointing", True, False),
        ("checkpointing_autocast", True, True),
    ):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))  # adapters float32
        if checkpointing:  # as the learner turns it on (training mode around the forward, no KV cache)
            enable_gradient_checkpointing(model)
            model.enable_input_require_grads()
        model.train()
        nbytes = saved_bytes(model, ids, autocast)
        results[name] = {"mb": nbytes / 2**20, "bytes_per_token_per_layer": nbytes / args.tokens / args.layers}
    results["setup"] = {"shape": args.shape, "hidden": config.hidden_size, "layers": args.layers, "tokens": args.tokens}
    if args.json:
        print(json.dumps(results))
    else:
        for name, r in results.items():
            if name != "setup":
                print(f"{name:24s} {r['mb']:9.1f} MB  {r['bytes_per_token_per_layer']:9.0f} bytes per token per layer")
    return 0
