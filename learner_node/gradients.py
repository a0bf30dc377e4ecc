"""An optimizer step's gradients: summed over micro-batches in float32, averaged over ranks, clipped.

autograd accumulates a parameter's gradient in the parameter's own dtype: a 16-bit trained parameter (a full
fine-tune in bf16, peft's trained copy of a bf16 head) would sum its micro-batches' gradients in bf16, losing
about log2(micro-batches) of its 8 significant bits, and ranks would all-reduce them in bf16. So after each
micro-batch's backward the gradient of every 16-bit trained parameter moves into a float32 sum kept as the
parameter's `main_grad` (Megatron-LM's name for it) and `.grad` is cleared; the sums are all-reduced and clipped
in float32, and `MasterWeightAdam` (learner_node/optim.py) steps the float32 master with them. Within one
backward autograd still sums in the parameter's dtype (a weight used by several chunks of the LM head, say),
as any 16-bit model's backward does.

With several processes, each rank's gradients are averaged before the step, so an update equals the one-process
update on the same batch; parameters FSDP2 shards (DTensors) were reduce-scattered by FSDP in each backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

SIXTEEN_BITS = (torch.bfloat16, torch.float16)
MAIN_GRAD = "main_grad"  # the attribute of a 16-bit trained parameter that holds its float32 gradient


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _summed_in_float32(p: torch.nn.Parameter) -> bool:
    return p.dtype in SIXTEEN_BITS and not isinstance(p, DTensor)


def accumulate(params: list[torch.nn.Parameter]) -> None:
    """After a micro-batch's backward: each 16-bit parameter's gradient added to its float32 sum, and cleared."""
    for p in params:
        if p.grad is None or not _summed_in_float32(p):
            continue
        total = getattr(p, MAIN_GRAD, None)
        if total is None:
            setattr(p, MAIN_GRAD, p.grad.float())
        else:
            total.add_(p.grad)
        p.grad = None


def grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient a step applies to `p`: its float32 sum if it has one, else its `.grad`."""
    total = getattr(p, MAIN_GRAD, None)
    return total if total is not None else p.grad


def clear(params: list[torch.nn.Parameter]) -> None:
    """Forget the float32 sums (the optimizer's `zero_grad` clears `.grad`)."""
    for p in params:
        if getattr(p, MAIN_GRAD, None) is not None:
            setattr(p, MAIN_GRAD, None)


def average(params: list[torch.nn.Parameter]) -> None:
    """Every rank's gradients averaged over the ranks (in float32 where summed so), but for FSDP2's sharded
    parameters, whose gradients FSDP reduce-scattered (averaged) in the backward."""
    _, world = rank_and_world()
    if world == 1:
        return
    for p in params:
        if isinstance(p, DTensor):
            continue
        g = grad(p)
        if g is None:  # a rank with no share of this minibatch, or a parameter no sample reached
            g = torch.zeros_like(p, dtype=torch.float32 if _summed_in_float32(p) else p.dtype)
            if _summed_in_float32(p):
                setattr(p, MAIN_GRAD, g)
            else:
                p.grad = g
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        g /= world


def clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the gradients a step applies (`grad`): the 2-norm over all of them, each
    scaled by min(1, max_norm / (norm + 1e-6)); returns the norm as a plain tensor, also when FSDP2 shards some
    parameters (DTensors) and not others (learner_node/sharding.py: a LoRA adapter's blocks sharded, peft's
    modules_to_save whole): torch's foreach kernels take no list that mixes the two, so each kind gets its norm
    alone and the norms are combined. The norm of sharded gradients is reduced over the ranks by DTensor; whole
    ones are the same on every rank already."""
    grads = [g for g in (grad(p) for p in params) if g is not None]
    if not grads:
        return torch.zeros(())
    sharded: list[torch.Tensor] = [g for g in grads if isinstance(g, DTensor)]
    groups = [group for group in (sharded, [g for g in grads if not isinstance(g, DTensor)]) if group]
    device = grads[0].device
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm(group)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device))
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for group in groups:
        torch._foreach_mul_(group, coefficient.to(group[0].device))
    return total
