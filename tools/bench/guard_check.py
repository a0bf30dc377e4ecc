"""A device check of the learner's guard against non-finite updates (issue 28), for a GPU machine where the
test suite (which needs Redis) does not run: a NaN gradient at the second optimizer step of a generation update
and a reward of 1e300 both raise NonFiniteUpdate, the snapshot puts the weights and Adam's state back bit for
bit, and a clean update afterwards applies and stays finite. Exit status 0 when all of that holds.

    python -m tools.bench.guard_check --device cuda --dtype bfloat16

The results on an H200 are in docs/benchmarks.md; tests/learner_node/test_nonfinite.py checks the same on the
CPU through the learner process's own code."""

import argparse
import math
import sys
import time
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from common.learner_figures import GENERATION, UpdateFigure
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.token_update import generation_update
from learner_node.undo import TrainableSnapshot
from learner_node.update import NonFiniteUpdate
from tools.bench.scoring import build_model
from tools.bench.update import make_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    opts = parser.parse_args()
    device = torch.device(opts.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]
    base = build_model(512, 4, 4096, device, dtype)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")).eval()
    args = argparse.Namespace(responses=16, min_len=8, max_len=200, median=0.2, prompt=32, vocab=4096, micro_tokens=2048)
    batch = make_batch(args, model)
    cfg = UpdateConfig(update_epochs=2, policy_minibatch=8, value_epochs=2, value_minibatch=16, target_kl=0)
    gen = GenerationConfig(micro_batch_tokens=args.micro_tokens, value_hidden=[64])
    lp = LearnerPolicy(model, None, "token", 1.0, [16], token_value_hidden=gen.value_hidden)
    popt = torch.optim.Adam(lp.trainable_parameters(), lr=1e-4)
    vopt = torch.optim.Adam(lp.token_value_head.parameters(), lr=1e-3)
    generation_update(lp, popt, vopt, batch, cfg, gen)  # moments that are not zero

    def state():
        w = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
        w.update({f"head.{k}": v.detach().clone() for k, v in lp.token_value_head.state_dict().items()})
        return w, [{k: {n: t.clone() for n, t in s.items()} for k, s in enumerate(opt.state.values())} for opt in (popt, vopt)]

    def same(a, b):
        (wa, ma), (wb, mb) = a, b
        return all(torch.equal(wa[k], wb[k]) for k in wa) and all(
            torch.equal(ma[i][k][n], mb[i][k][n]) for i in range(2) for k in ma[i] for n in ma[i][k]
        )

    results: dict[str, Any] = {}
    lora = next(p for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n)
    calls = [0]

    def nan_on_the_second_backward(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.full_like(grad, math.nan) if calls[0] == 2 else grad

    def poisoned(name: str) -> None:
        """One update that must raise NonFiniteUpdate, undone from its snapshot: `name`_raised (what it said) and
        `name`_restored_exactly in `results`."""
        snap = TrainableSnapshot.of([popt, vopt])
        try:
            generation_update(lp, popt, vopt, batch, cfg, gen)
            results[f"{name}_raised"] = False
        except NonFiniteUpdate as e:
            results[f"{name}_raised"] = e.what
        snap.restore()
        results[f"{name}_restored_exactly"] = same(before, state())

    before = state()
    handle = lora.register_hook(nan_on_the_second_backward)
    poisoned("nan_gradient")
    handle.remove()
    batch.rewards[3] = 1e300
    poisoned("reward_1e300")

    batch.rewards[3] = 1.0
    sync()
    t0 = time.perf_counter()
    m = generation_update(lp, popt, vopt, batch, cfg, gen)
    sync()
    after = state()
    results["clean_update_s"] = round(time.perf_counter() - t0, 3)
    results["clean_update_finite"] = all(bool(torch.isfinite(v).all()) for v in after[0].values())
    results["clean_update_moved"] = not same(before, after)
    results["policy_loss"] = m[UpdateFigure.POLICY_LOSS.of(GENERATION)]
    print(opts.dtype, results, flush=True)
    ok = all(results[k] for k in results if k not in ("policy_loss", "clean_update_s"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
