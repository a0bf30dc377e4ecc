"""`ppoz bench update`: the generation learner's update throughput, packed rows against right-padded rows.

One PPO update is what the learner runs per rollout of generated responses (learner_node/token_update.py's
`generation_update`, the one update loop of learner_node/update.py): the proximal and reference log-probs,
the critic's token values and GAE, the critic's epochs, then the policy's epochs of forward, backward and
optimizer steps through a LoRA adapter. The figure is response tokens trained per second of that update.

Both legs run the same update on the same data from the same weights; only the layout of a forward differs:
- `packed`: responses with their prompts one after another in rows as long as the longest sequence, the
  mask built by transformers from position ids that restart at 0 (the learner's own layout);
- `padded`: one sequence per row, right-padded to the longest sequence of the batch (of the micro-batch, in the
  policy's forwards), under a padding mask: a batch as a trainer without packing holds it.
Response lengths are long-tailed (log-normal, clipped to [--min-len, --max-len]): most answers are short,
a few run to the limit, as in real rollouts. After one untimed update, the legs alternate (packed, padded,
padded, packed, ...) so that drift on a shared machine hits both; the losses and the post-update weights of the two legs must agree to
1e-5 in float32, or the speed figure compares different computations.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import time
from typing import Any

import torch

from common.learner_figures import GENERATION, UpdateFigure
from ppoz.flags import add_device_flag, add_json_flag
from tools.bench import add_model_shape_flags

LEGS = ("packed", "padded")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--responses", type=int, default=32, help="responses per update (default: 32)")
    parser.add_argument("--min-len", type=int, default=16, help="shortest response, tokens (default: 16)")
    parser.add_argument("--max-len", type=int, default=512, help="longest response, tokens (default: 512)")
    parser.add_argument(
        "--median",
        type=float,
        default=0.2,
        help="median response length, as a fraction of the way from --min-len to --max-len (default: 0.2)",
    )
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (default: 64)")
    add_model_shape_flags(parser, hidden=256, layers=4, vocab=8192)
    parser.add_argument(
        "--micro-tokens", type=int, default=4096, help="tokens per forward, [generation] micro_batch_tokens (default: 4096)"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank of the adapter trained; 0: a full fine-tune (default: 8)")
    parser.add_argument("--runs", type=int, default=3, help="updates per leg, alternating legs (default: 3)")
    add_device_flag(parser)
    add_json_flag(parser)


def response_lengths(n: int, low: int, high: int, median_frac: float = 0.2, seed: int = 0) -> list[int]:
    """Long-tailed lengths: log-normal (sigma 0.8) with its median `median_frac` of the way up, clipped to
    [low, high]; the longest one is set to `high` so that every run pads to the same limit."""
    gen = torch.Generator().manual_seed(seed)
    median = low + (high - low) * median_frac
    raw = torch.exp(math.log(median) + 0.8 * torch.randn(n, generator=gen)).round().long().clamp(low, high).tolist()
    raw[0] = high
    return [int(x) for x in raw]


def make_batch(args: argparse.Namespace, model: Any) -> Any:
    """On-policy responses: behaviour log-probs are the model's own, rewards alternate, one chain per response."""
    from learner_node.packed_forward import response_logprobs
    from learner_node.token_update import Chain, GenerationBatch

    gen = torch.Generator().manual_seed(1)
    lengths = response_lengths(args.responses, args.min_len, args.max_len, args.median)
    batch = GenerationBatch()
    for i, n in enumerate(lengths):
        batch.prompts.append(torch.randint(3, args.vocab, (args.prompt,), generator=gen).tolist())
        batch.responses.append(torch.randint(3, args.vocab, (n,), generator=gen).tolist())
        batch.temperatures.append(1.0)
        batch.rewards.append(float(i % 2))
        batch.dones.append(True)
        batch.lags.append(0)
        batch.chains.append(Chain([i], None))
    with torch.no_grad():
        own, _ = response_logprobs(model, batch.prompts, batch.responses, batch.temperatures, args.micro_tokens)
    batch.behaviour = [x.float().cpu().tolist() for x in own]
    return batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    from learner_node.config import GenerationConfig, UpdateConfig
    from learner_node.policy import LearnerPolicy
    from learner_node.token_update import generation_update
    from models.policy_model import ModelSpec, peft_warnings_silenced
    from tools.bench.scoring import build_model

    device = ModelSpec(model="bench", device=args.device).resolved_device()
    base = build_model(args.hidden, args.layers, args.vocab, device, torch.float32)
    if args.lora_rank:
        with peft_warnings_silenced():
            model = get_peft_model(
                base, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear", task_type="CAUSAL_LM")
            )
    else:
        model = base
    model.eval()
    with torch.no_grad():  # an adapter that has moved from the base: the KL to the reference is not zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01, generator=torch.Generator(device=p.device).manual_seed(2))
    batch = make_batch(args, model)
    tokens = sum(len(r) for r in batch.responses)
    cfg = UpdateConfig(
        update_epochs=2, policy_minibatch=max(1, args.responses // 2), value_epochs=2, value_minibatch=args.responses, target_kl=0
    )
    gen = GenerationConfig(micro_batch_tokens=args.micro_tokens, value_hidden=[64])
    start_weights = copy.deepcopy(model.state_dict())

    pushed = [0]  # tokens through the decoder, padding included: the work a layout costs

    def count(_: Any, args: tuple, kwargs: dict) -> None:
        pushed[0] += int(kwargs["input_ids"].numel())

    model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
    decoder_tokens: dict[str, int] = {}
    optimizers: list[torch.optim.Optimizer] = []  # the last update's, for the snapshot's cost

    def one_update(layout: str) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
        model.load_state_dict(start_weights)
        pushed[0] = 0
        torch.manual_seed(0)  # the same critic to start from
        lp = LearnerPolicy(model, None, "token", 1.0, [16], token_value_hidden=gen.value_hidden, generation_layout=layout)
        popt = torch.optim.Adam(lp.trainable_parameters(), lr=1e-4)
        vopt = torch.optim.Adam(lp.token_value_head.parameters(), lr=1e-3)
        optimizers[:] = [popt, vopt]
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = generation_update(lp, popt, vopt, batch, cfg, gen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        decoder_tokens[layout] = pushed[0]
        weights = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
        return elapsed, metrics, weights

    one_update("padded")  # untimed: one-time costs (allocations, first calls) hit neither leg's figures
    order = [LEGS[(i // 2 + i) % 2] for i in range(2 * args.runs)]  # packed, padded, padded, packed, packed, padded, ...
    seconds: dict[str, list[float]] = {leg: [] for leg in LEGS}
    results: dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]] = {}
    for leg in order:
        elapsed, metrics, weights = one_update(leg)
        seconds[leg].append(elapsed)
        results[leg] = (metrics, weights)
    (m_packed, w_packed), (m_padded, w_padded) = results["packed"], results["padded"]
    snapshot = snapshot_cost(optimizers, device, args.runs)
    loss_diff = max(
        abs(m_packed[k.of(GENERATION)] - m_padded[k.of(GENERATION)])
        for k in (UpdateFigure.POLICY_LOSS, UpdateFigure.VALUE_LOSS, UpdateFigure.KL_REF, UpdateFigure.ENTROPY)
    )
    weight_diff = max(float((w_packed[k] - w_padded[k]).abs().max()) for k in w_packed)
    per_leg: dict[str, dict[str, Any]] = {
        leg: {
            "seconds": [round(s, 3) for s in seconds[leg]],
            "tokens_per_s": round(tokens / statistics.median(seconds[leg]), 1),
            "decoder_tokens": decoder_tokens[leg],
        }
        for leg in LEGS
    }
    lengths = [len(r) for r in batch.responses]
    return {
        "bench": "update",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {device}",
        "model": f"llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        + (f"LoRA r={args.lora_rank} all-linear" if args.lora_rank else "full fine-tune"),
        "responses": args.responses,
        "response_tokens": tokens,
        "lengths": {
            "min": min(lengths),
            "median": statistics.median(lengths),
            "mean": round(tokens / len(lengths), 1),
            "max": max(lengths),
        },
        "median_frac": args.median,
        "prompt": args.prompt,
        "micro_tokens": args.micro_tokens,
        "order": order,
        **per_leg,
        "speedup": round(float(per_leg["packed"]["tokens_per_s"]) / float(per_leg["padded"]["tokens_per_s"]), 2),
        "padding_factor": round(decoder_tokens["padded"] / decoder_tokens["packed"], 2),  # the decoder work packing saves
        "max_loss_diff": loss_diff,
        "max_weight_diff": weight_diff,
        "equal": loss_diff <= 1e-5 and weight_diff <= 1e-5,
        "trainable_params": sum(p.numel() for opt in optimizers for g in opt.param_groups for p in g["params"]),
        **snapshot,
        "snapshot_share": round(float(snapshot["snapshot_s"]) / statistics.median(seconds["packed"]), 4),
    }


def snapshot_cost(optimizers: list[torch.optim.Optimizer], device: torch.device, runs: int) -> dict[str, Any]:
    """What the learner's guard against non-finite updates costs per update: copying the trained parameters and
    the optimizers' states (learner_node/undo.py TrainableSnapshot), and, when an update is discarded,
    putting them back; and whether the copy put back is exact after the parameters and moments have moved."""
    from learner_node.undo import TrainableSnapshot

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    taken, restored = [], []
    for _ in range(runs):
        sync()
        started = time.perf_counter()
        snapshot = TrainableSnapshot.of(optimizers)
        sync()
        taken.append(time.perf_counter() - started)
        saved = [(p, p.detach().clone()) for p, _ in snapshot.params]
        moments = {k: v.clone() for k, v in optimizers[0].state[snapshot.params[0][0]].items()}
        with torch.no_grad():  # an update's worth of change, as a discarded one would have left
            for opt in optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.add_(1.0)
                        for value in opt.state[p].values():
                            if value.dim():
                                value.add_(1.0)
        sync()
        started = time.perf_counter()
        snapshot.restore()
        sync()
        restored.append(time.perf_counter() - started)
        exact = all(torch.equal(p, copy_) for p, copy_ in saved) and all(
            torch.equal(optimizers[0].state[snapshot.params[0][0]][k], v) for k, v in moments.items()
        )
        if not exact:
            break
    return {
        "snapshot_s": round(statistics.median(taken), 5),
        "restore_s": round(statistics.median(restored), 5),
        "snapshot_restores_exactly": exact,
    }


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"{result['machine']}; {result['model']}")
        print(f"{result['responses']} responses, {result['response_tokens']} tokens, lengths {result['lengths']}")
        for leg in LEGS:
            print(
                f"  {leg:7s} {result[leg]['tokens_per_s']:9.1f} response tokens/s (update seconds {result[leg]['seconds']}),"
                f" {result[leg]['decoder_tokens']} tokens through the decoder"
            )
        diffs = f"losses equal to {result['max_loss_diff']:.1e}, weights to {result['max_weight_diff']:.1e}"
        print(f"  packed / padded: {result['speedup']}x (padding factor {result['padding_factor']}x); {diffs}")
        print(
            f"  the guard's snapshot of {result['trainable_params']} trained parameters and their optimizer states: "
            f"{result['snapshot_s']} s per update ({100 * result['snapshot_share']:.2f}% of a packed update), "
            f"{result['restore_s']} s to put back, exact: {result['snapshot_restores_exactly']}"
        )
    return 0 if result["equal"] and result["snapshot_restores_exactly"] else 1
