"""What undoes an update: copies of the trained parameters and of their optimizers' states, taken before it.

The learner takes a `TrainableSnapshot` before each update and restores it when the update would put a
non-finite number into the weights (learner_node/update.py `NonFiniteUpdate`, learner_node/worker.py), so that
nothing of that update is kept. With LoRA the copies are the adapter and the value heads: a few MB. A full
fine-tune copies every trained weight and its Adam moments (and MasterWeightAdam's residuals): 12 bytes a
parameter besides the weights. On a GPU the copies go to the host, so the GPU does not hold them twice: a 1.5B
full fine-tune's 18 GB, and a 7B one's under FSDP2 (4 ranks) 20 GB a rank of its shards (`ppoz bench memory`,
docs/benchmarks.md). A sharded tensor (an FSDP2 DTensor) is copied by its rank's own shard.

Restoring copies the values back into the tensors the model and the optimizers hold, in place: no second set of
moments is made on the GPU to replace the first (an optimizer's load_state_dict would), and a DTensor keeps its
sharding. State the update created where there was none (the first update's moments) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from learner_node import gradients

UNDO_ON_HOST: tuple[str, ...] = ("cuda", "meta")  # devices whose undo copies go to the host; meta traces a GPU (tools/bench/meta_trace.py)
HOST = torch.device("cpu")  # where they go (`ppoz bench memory` traces a sharded GPU's on meta instead)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds: a DTensor's own shard (a view of it), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` (of its own shard if it is a DTensor) to undo an update with: on the host where it is on a
    GPU, else a clone where it is. The host copy is pageable memory: pinned, torch's caching host allocator would
    round each block up to a power of two and keep it (a 7B model's 271 MB moments in 512 MB blocks, up to 1.9x the
    snapshot, none of it swappable beside the actors), for a copy about twice as fast."""
    local = _local(tensor.detach())
    if local.device.type not in UNDO_ON_HOST:
        return local.clone()
    return torch.empty(local.shape, dtype=local.dtype, device=HOST).copy_(local)


def _copied(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _kept(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _put_back(target: torch.Tensor, saved: torch.Tensor) -> None:
    _local(target).copy_(saved)  # from the host: copy_ waits for the host-to-device copy it started


@dataclass
class TrainableSnapshot:
    """Copies of what an update changes, taken before it, so that a NonFiniteUpdate can be undone whole: each
    trained parameter, and each optimizer's per-parameter state (moments, step, residual) and group settings."""

    params: list[tuple[torch.nn.Parameter, torch.Tensor]]
    optimizer_states: list[tuple[torch.optim.Optimizer, dict[Any, dict[str, Any]], list[dict[str, Any]]]]

    @classmethod
    def of(cls, optimizers: list[torch.optim.Optimizer]) -> TrainableSnapshot:
        params = [(p, _kept(p)) for opt in optimizers for group in opt.param_groups for p in group["params"]]
        # tensors copied, dicts rebuilt, numbers shared: deepcopy's per-object bookkeeping took 4% of a small
        # model's update cycle (arithmetic demo)
        states = [
            (
                opt,
                {p: _copied(state) for p, state in opt.state.items()},
                [_copied({k: v for k, v in group.items() if k != "params"}) for group in opt.param_groups],
            )
            for opt in optimizers
        ]
        return cls(params, states)

    def restore(self) -> None:
        with torch.no_grad():
            for param, saved in self.params:
                _put_back(param, saved)
                param.grad = None
            gradients.clear([param for param, _ in self.params])
            for opt, states, settings in self.optimizer_states:
                for p in [p for p in opt.state if p not in states]:  # made by the update: none before it
                    del opt.state[p]
                for p, saved_state in states.items():
                    state = opt.state[p]
                    for key in [k for k in state if k not in saved_state]:  # made by the update (a first residual)
                        del state[key]
                    for key, value in saved_state.items():
                        _write_back(state, key, value)
                for group, kept in zip(opt.param_groups, settings, strict=True):
                    for key, value in kept.items():
                        _write_back(group, key, value)


def _write_back(holder: dict[str, Any], key: str, value: Any) -> None:
    """`holder[key]` (an optimizer's state or group setting) as `value`: a tensor written into the one held, in place."""
    if not isinstance(value, torch.Tensor):
        holder[key] = value
        return
    current = holder.get(key)
    if not isinstance(current, torch.Tensor) or _local(current).shape != value.shape or current.dtype != value.dtype:
        raise RuntimeError(f"the optimizer's {key!r} changed its shape or dtype, or went away, in the update: it cannot be undone")
    _put_back(current, value)
