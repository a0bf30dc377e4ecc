"""The product's code run on the meta device, as it would run on a GPU, for the memory it allocates there.

A meta tensor has a shape, a dtype and storage of its size, but no data: every op runs its shape logic and
allocates its output (so `tools/bench/memory_peak.py` counts exactly what the real device would be asked for)
and computes nothing, so a 7B model's update at Kea's shapes takes seconds on a CPU and no memory. What the code
reads back to the host is answered here (`traced`): a scalar as 0.0 (float), 0 (int) or True (bool), a copy to
the host as ones of its shape (a copy into a host buffer leaves it as it is); a mask's selection (`nonzero`) as if
every element were selected, the largest shape it can have. The meta device takes the GPU's path where the product
branches on the device (the LM head's 16-bit product, the host copy of an update's undo snapshot): the figures are a
GPU's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class _HostAnswers(TorchDispatchMode):
    """Values the host reads from a meta tensor, made up (see the module's docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # `item` and `bool()` reach a mode whole under inference mode (no autograd key to decompose them), else as
        # the dense op they decompose into
        if func is aten.is_nonzero.default and args[0].device.type == "meta":
            return True
        if func in (aten._local_scalar_dense.default, aten.item.default) and args[0].device.type == "meta":
            t = args[0]
            return True if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        # a copy to the host: `_to_copy`, or under inference mode the `to` overloads it is made of
        copies = (aten._to_copy.default, aten.to.dtype_layout, aten.to.device)
        if func in copies and args[0].device.type == "meta" and str(kwargs.get("device", args[1] if len(args) > 1 else "meta")) == "cpu":
            t = args[0]
            return torch.ones(t.shape, dtype=kwargs.get("dtype") or t.dtype, device="cpu")
        if func is aten.copy_.default and args[1].device.type == "meta" and args[0].device.type == "cpu":
            # left as it is: such a copy is a host buffer filled for later (an update's undo copy), which the traced
            # work never reads; writing it would commit the host's memory for it (a 7B full fine-tune's: 35 GB)
            return args[0]
        return func(*args, **kwargs)


class _FusedAttention(torch.autograd.Function):
    """Attention as a GPU's fused kernels (FlashAttention, memory-efficient attention) allocate it: the output and
    a float32 log-sum-exp per query, kept for the backward with the inputs; the backward allocates the three input
    gradients. The meta device would otherwise run torch's math attention, which materialises every query-key
    score ([batch, heads, queries, keys] in float32): what the fused kernels never hold."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention(real: Any) -> Any:
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if query.device.type != "meta":
            return real(query, key, value, *args, **kwargs)
        if kwargs.get("enable_gqa") and key.shape[-3] != query.shape[-3]:  # the kernel reads each KV head for its group
            key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], -3) for t in (key, value))
        return _FusedAttention.apply(query, key, value)

    return attention


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Within: meta tensors answer the host's reads (`_HostAnswers`), a selection by mask keeps every element, and
    attention on meta tensors allocates what a GPU's fused kernel does (`_FusedAttention`)."""
    import torch.fx.experimental._config as fx_config
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _attention(real)
    try:
        with fx_config.patch(meta_nonzero_assume_all_nonzero=True), _HostAnswers():  # type: ignore[attr-defined]
            yield
    finally:
        F.scaled_dot_product_attention = real
