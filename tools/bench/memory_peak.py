"""The peak memory of a piece of work, by the bytes of the tensor storages it keeps alive at once.

Every op torch dispatches while the work runs is seen (a TorchDispatchMode): each storage it returns is counted
from then until it is freed (a weakref finalizer), on its own device: the CPU's tensors here, a GPU's there, fake
tensors under FakeTensorMode; a DTensor by its own shard. What it counts is what a caching allocator is asked for
(the allocator's rounding and fragmentation are not counted), which is the figure that decides whether a part
fits. torch's own MemTracker counts the same way but hooks every parameter's gradient, which a frozen model refuses."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class Peak:
    """The most bytes live at once on a device while the work ran, and of them the bytes that were alive before it
    started (the modules' parameters and buffers given)."""

    total: int
    before: int
    end: int = 0  # alive when the work ended

    @property
    def work(self) -> int:
        """What the work added on top of what was alive before it, at its peak."""
        return self.total - self.before


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages ops returned, per device, while they live; the most at once."""

    def __init__(self, before: dict[str, int]) -> None:
        super().__init__()
        self.live = collections.Counter(before)
        self.peak = collections.Counter(before)
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Held

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # what the op was given (its inputs, an out= tensor) existed before it: an output sharing one of their
        # storages (a view, an in-place or out= op) allocated nothing
        given = {_storage_id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_id(t) not in given:
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        try:
            storage = _local(t).untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor with no storage of its own (sparse, nested)
            return
        if storage in self.seen:
            return
        held = _Held(_device_key(t.device), 0)
        self.seen[storage] = held
        self._add(held, storage.nbytes())
        weakref.finalize(storage, self._add, held, 0)

    def _add(self, held: _Held, size: int) -> None:
        """`held`'s storage now holds `size` bytes (0: freed)."""
        self.live[held.device] += size - held.size
        self.peak[held.device] = max(self.peak[held.device], self.live[held.device])
        held.size = size

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage counted here changed its size in place: FSDP2 frees a block's all-gathered parameters after its
        forward and backward by resizing their storage to 0, and allocates them again by resizing it back."""
        held = self.seen.get(storage)
        if held is not None:
            self._add(held, storage.nbytes())


@dataclass
class _Held:
    device: str
    size: int


def _local(t: torch.Tensor) -> torch.Tensor:
    """What holds a tensor's memory on this process: a DTensor's own shard (FSDP2's parameters, their gradients and
    Adam moments), else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return int(_local(t).untyped_storage()._cdata)
    except (NotImplementedError, RuntimeError):
        return None


def _device_key(device: torch.device) -> str:
    return device.type if device.index is None else f"{device.type}:{device.index}"


def peak_memory(work: Callable[[], Any], modules: Iterable[torch.nn.Module] = (), device: str | torch.device = "cpu") -> Peak:
    """Run `work()` and return its peak on `device`, counting `modules`' parameters and buffers (each storage once)
    as alive from the start."""
    key = _device_key(torch.device(device))
    alive: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages, not tensors: tied weights count once
    for module in modules:
        for t in map(_local, (*module.parameters(), *module.buffers())):
            if _device_key(t.device) == key:
                alive[t.untyped_storage()] = t.untyped_storage().nbytes()
    before = sum(alive.values())
    mode = _LiveStorages({key: before})
    for storage, size in alive.items():  # an op that returns one of them (a view, an in-place op) adds nothing
        mode.seen[storage] = _Held(key, size)
    resize = torch.UntypedStorage.resize_  # a storage's own method, which no dispatch mode sees

    def counted_resize(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        mode.resized(storage)
        return out

    torch.UntypedStorage.resize_ = counted_resize  # type: ignore[method-assign,assignment]
    try:
        with mode:
            work()
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
    return Peak(int(mode.peak[key]), before, int(mode.live[key]))
