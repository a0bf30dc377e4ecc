"""The product's code run on the meta device, as it would run on a GPU, for the memory it allocates there.

A meta tensor has a shape, a dtype and storage of its size, but no data: every op runs its shape logic and
allocates its output (so `tools/bench/memory_peak.py` counts exactly what the real device would be asked for)
and computes nothing, so a 7B model's update at Kea's shapes takes seconds on a CPU and no memory. What the code
reads back to the host is answered here (`traced`): a scalar as 0.0 (float), 0 (int) or True (bool), a copy to
the host as ones of its shape (a copy into a host buffer leaves it as it is); a mask's selection (`nonzero`) as if
every element were selected, the largest shape it can have. The meta device takes the GPU's path where the product
branches on the device (the LM head's 16-bit product, the host copy of an update's undo snapshot): the figures are a
GPU's.

Sharded work (FSDP2 over N ranks, `fake_ranks`) cannot run on meta: FSDP2 refuses meta parameters and DTensor has
no meta mesh. It runs instead as rank 0 of N on fake CPU tensors (torch's FakeTensorMode: shapes and storages of
their size, no data, nothing computed) with torch's fake process group, whose collectives move nothing; every
buffer FSDP2 allocates for them (a block's all-gathered parameters, its gradients before the reduce-scatter) is
allocated as on a GPU. The fake CPU stands for the GPU: the product's GPU branches are taken for it, and an undo
copy bound for the host is made on meta, so that it is not counted with the GPU's memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _traced(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.device.type == "meta" or isinstance(t, FakeTensor))


class _HostAnswers(TorchDispatchMode):
    """Values the host reads from a meta tensor, made up (see the module's docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], FakeTensor):
            return _fake_answer(func, args, kwargs)
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


def _fake_answer(func: Any, args: Any, kwargs: Any) -> Any:
    """The host's reads of a fake tensor (`fake_ranks`), as of a meta one: a scalar as True, 0.0 or 0, unless
    FakeTensorMode knows its value (a constant made from a Python number and kept so, such as Adam's step count);
    a selection by mask as if every element were selected (FakeTensorMode has no rule of its own for an output's
    size that depends on the data)."""
    t = args[0]
    if t.constant is not None:
        return func(*args, **kwargs)
    if func is aten.is_nonzero.default:
        return True
    if func in (aten._local_scalar_dense.default, aten.item.default):
        return True if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
    if func is aten.nonzero.default:
        return t.new_empty((t.numel(), t.dim()), dtype=torch.long)
    if func is aten.masked_select.default:
        return t.new_empty((torch.broadcast_shapes(t.shape, args[1].shape).numel(),))
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(_is_mask(i) for i in args[1]):
        indices: list[Any] = []
        for i in args[1]:  # a mask of d dimensions indexes as d index lists, each as long as the mask has elements
            indices += [i.new_empty((i.numel(),), dtype=torch.long)] * i.dim() if _is_mask(i) else [i]
        return func(args[0], indices, *args[2:], **kwargs)
    return func(*args, **kwargs)


def _is_mask(index: Any) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


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
        if not _traced(query):
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


_CPU_BRANCHES: list[bool] = []  # non-empty within `cpu_branches`


@contextlib.contextmanager
def cpu_branches() -> Iterator[None]:
    """Within: `fake_ranks` leaves the product on its CPU branches, as a real CPU run takes them."""
    _CPU_BRANCHES.append(True)
    try:
        yield
    finally:
        _CPU_BRANCHES.pop()


@contextlib.contextmanager
def fake_ranks(world: int, fake_tensors: bool = True) -> Iterator[Any]:
    """Within: this process is rank 0 of `world` in torch's fake process group, tensors are fake (on the CPU, which
    stands for rank 0's GPU), the product takes its GPU branches for them, and the host's reads and attention are
    answered as in `traced` (see the module's docstring). Yields the device mesh to shard over. Once a process: a
    second fake run in the same process crashed in FakeTensorMode's shared dispatch cache (a segfault, torch 2.13),
    so tools/bench/memory_sharded.py runs each in a process of its own. `fake_tensors` off
    (the instrument's check): real CPU tensors, computed, on the CPU's branches (the CPU has no 16-bit product
    with a float32 output), so run the fake leg it is checked against with `cpu_branches`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from learner_node import undo
    from models.scoring import lm_head

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    saved = (lm_head.EXACT_PRODUCT_DEVICES, undo.UNDO_ON_HOST, undo.HOST)
    try:
        mesh = init_device_mesh("cpu", (world,))  # before the fake mode: a mesh reads its ranks back to the host
        if fake_tensors and not _CPU_BRANCHES:
            lm_head.EXACT_PRODUCT_DEVICES = (*saved[0], "cpu")
            undo.UNDO_ON_HOST, undo.HOST = (*saved[1], "cpu"), torch.device("meta")
        if fake_tensors:
            with FakeTensorMode(allow_non_fake_inputs=True), traced():
                yield mesh
        else:
            yield mesh
    finally:
        lm_head.EXACT_PRODUCT_DEVICES, undo.UNDO_ON_HOST, undo.HOST = saved
        dist.destroy_process_group()
