"""The peak memory of a piece of work, by the bytes of the tensor storages it keeps alive at once.

Every op torch dispatches while the work runs is seen (a TorchDispatchMode): each storage it returns is counted
from then until it is freed (a weakref finalizer), on its own device: the CPU's tensors here, a GPU's there,
fake CUDA tensors under FakeTensorMode. What it counts is what a caching allocator is asked for (the allocator's
rounding and fragmentation are not counted), which is the figure that decides whether a part fits. torch's own
MemTracker counts the same way but hooks every parameter's gradient, which a frozen model refuses."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
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
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

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
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor with no storage of its own (sparse, nested)
            return
        if storage in self.seen:
            return
        size, device = storage.nbytes(), _device_key(t.device)
        self.seen[storage] = size
        self.live[device] += size
        self.peak[device] = max(self.peak[device], self.live[device])
        weakref.finalize(storage, self._free, device, size)

    def _free(self, device: str, size: int) -> None:
        self.live[device] -= size


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
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
        for t in (*module.parameters(), *module.buffers()):
            if _device_key(t.device) == key:
                alive[t.untyped_storage()] = t.untyped_storage().nbytes()
    before = sum(alive.values())
    mode = _LiveStorages({key: before})
    for storage, size in alive.items():  # an op that returns one of them (a view, an in-place op) adds nothing
        mode.seen[storage] = size
    with mode:
        work()
    return Peak(int(mode.peak[key]), before, int(mode.live[key]))
