"""The learner's optimizer: Adam, with float32 master weights for any parameter trained in 16 bits.

A full fine-tune on a GPU loads its weights in bfloat16 (`dtype = "auto"`), and so do peft's trained copies of
a bf16 model's modules (`lora_trainable`). bfloat16 keeps 8 bits of mantissa: a weight of 0.02 moves only by
steps of 1.2e-4, so an Adam step of 1e-6 (a full fine-tune's learning rate) rounds away and the policy does
not move however long it trains. Mixed-precision training keeps a float32 master copy of every such weight,
steps it, and computes with its 16-bit rounding (Micikevicius et al. 2018, "Mixed Precision Training";
Megatron-LM's and DeepSpeed's fp32 master weights).

Here the model keeps its 16-bit parameters, so learner and actors compute exactly the same function with the
weights it publishes, and the optimizer keeps, per 16-bit parameter, the float32 part the 16 bits cannot hold
(`master_residual`: master = parameter + residual). It is optimizer state, so a checkpoint (torch.save of the
state dict, or DCP under FSDP) saves and restores it, and `TrainableSnapshot` undoes it with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from learner_node import gradients
from learner_node.gradients import SIXTEEN_BITS

FUSED_ADAM_DEVICES = ("cpu", "cuda")  # where torch has a fused Adam kernel for floating-point parameters
RESIDUAL = "master_residual"
# 16-bit elements whose float32 masters and gradients exist at once while MasterWeightAdam steps (1 GB of each)
MASTER_SLICE = 1 << 28


def adam(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """The learner's optimizer: Adam (eps 1e-5, as CleanRL's PPO), fused into one kernel where torch has one,
    with float32 master weights (`MasterWeightAdam`) when a parameter is trained in 16 bits.

    Fused is the same algorithm, one kernel for all parameters instead of a dozen tensor ops per parameter: on
    the demo's 21 parameters a step took 0.25 ms fused against 3.3 ms one tensor at a time (0.74 ms `foreach`),
    which on small models is most of the optimizer's share of an update (docs/benchmarks.md).

    Parameters FSDP2 shards (DTensors) take the fused kernel too, but not in one list with whole ones (a LoRA
    adapter sharded beside peft's modules_to_save, learner_node/sharding.py): the fused and foreach kernels refuse
    such a list, so it is stepped one tensor at a time."""
    trained = list(params)
    kind = MasterWeightAdam if any(p.dtype in SIXTEEN_BITS for p in trained) else torch.optim.Adam
    sharded = sum(isinstance(p, DTensor) for p in trained)
    if 0 < sharded < len(trained):
        return kind(trained, lr=lr, eps=1e-5, foreach=False)
    fused = bool(trained) and all(p.device.type in FUSED_ADAM_DEVICES and p.is_floating_point() for p in trained)
    return kind(trained, lr=lr, eps=1e-5, fused=fused or None)


class MasterWeightAdam(torch.optim.Adam):
    """torch's Adam, stepping each 16-bit parameter's float32 master (the parameter plus its `master_residual`)
    with the gradient in float32 (the learner's float32 sum over micro-batches, learner_node/gradients.py, where it
    has one), then rounding the master back into the parameter. Its moments are float32 too.
    Parameters in float32 are stepped as plain Adam steps them, in the same kernel."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Adam on the masters, a slice of the parameters at a time (`_slices`): a float32 master and gradient
        exist only for the slice being stepped, not for the whole model at once (1.5B parameters in bf16: 12.4 GB)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        try:
            for part in self._slices():
                self.param_groups = part
                with self._as_masters(with_grads=True) as masters:
                    super().step()
                    for p, half in masters:
                        rounded = p.data.to(half.dtype)
                        residual = self.state[p].get(RESIDUAL)
                        if residual is None:
                            self.state[p][RESIDUAL] = p.data - rounded.float()
                        else:  # in place: no second residual of the model alive beside the first
                            torch.sub(p.data, rounded.float(), out=residual)
                        half.copy_(rounded)
        finally:
            self.param_groups = groups
        return loss

    def _slices(self) -> Iterator[list[dict[str, Any]]]:
        """The param groups cut into slices of at most MASTER_SLICE 16-bit elements (a parameter larger than that is
        a slice alone), each a list of groups that share their settings and hold part of their parameters. Adam
        steps each parameter on its own state, so stepping the slices one after another is the same step."""
        part: list[dict[str, Any]] = []
        size = 0
        for group in self.param_groups:
            for p in group["params"]:
                n = p.numel() if p.dtype in SIXTEEN_BITS else 0
                if part and size + n > MASTER_SLICE:
                    yield part
                    part, size = [], 0
                if not part or part[-1]["_group"] is not group:
                    part.append({**group, "params": [], "_group": group})
                part[-1]["params"].append(p)
                size += n
        if part:
            yield part

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts each loaded state tensor to its parameter's dtype: with the parameters in 16 bits that would
        # round the moments and the residuals away, so they are loaded while the parameters are float32
        with self._as_masters(with_grads=False):
            super().load_state_dict(state_dict)

    @contextmanager
    def _as_masters(self, with_grads: bool) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Within: each 16-bit parameter's data is its float32 master (and its gradient float32); yields
        (parameter, its 16-bit data) pairs. After: the 16-bit data and gradients are the parameters' again."""
        swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    summed = gradients.grad(p)  # its float32 sum over micro-batches, where the learner keeps one
                    if p.dtype not in SIXTEEN_BITS or (with_grads and summed is None):
                        continue  # Adam leaves a parameter with no gradient as it is: no state made for it here either
                    half, grad = p.data, p.grad
                    residual = self.state[p].get(RESIDUAL) if p in self.state else None
                    p.data = half.float() + residual if residual is not None else half.float()
                    if with_grads and summed is not None:
                        p.grad = summed.float()
                    swapped.append((p, half, grad))
            yield [(p, half) for p, half, _ in swapped]
        finally:
            for p, half, grad in swapped:
                p.data = half
                p.grad = grad
