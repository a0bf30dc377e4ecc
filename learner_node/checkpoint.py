"""Checkpoints: everything needed to go on exactly where an update left off, written atomically.

A checkpoint is a directory `ckpt-<index>` (the learner's updates and discarded updates so far: every save
a new, larger index): the policy's trainable weights
(`policy.safetensors`, the adapter in peft's key names, or all weights without
one), the value head, both optimizers, RNG states and `state.json` (policy
version, update count, KL coefficient, the stream entries the update
consumed) and `recent_segments.msgpack` (the segment ids trained recently, which
the learner drops when they come again). It is written under a temporary name
and renamed, so a crash never leaves a half-written checkpoint that looks
complete.

A sharded learner (`[learner] parallelism = "fsdp"`) writes `sharded/` in place
of the weight and optimizer files: a torch.distributed.checkpoint directory to
which every rank writes its own shards (learner_node/sharding.py), readable by
any number of ranks, one process included. Every rank writes into the staging
folder rank 0 made (`staging`); rank 0 then adds the rest and renames it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

RECENT_FILE = "recent_segments.msgpack"
SHARDED = "sharded"  # the DCP folder of a sharded learner's weights and optimizer states


class RecentIds:
    """The last `maxlen` ids, for membership tests, and for every checkpoint as one msgpack array.

    Each id is encoded once, when it is added, and a checkpoint joins the encoded ids: re-encoding the whole
    window at every checkpoint (json.dumps of 100k ids: 33 ms, then 11 ms with msgpack) made a long run's
    checkpoint cost 72 ms against 21 ms with an empty window, as much as the demo's whole update.
    """

    def __init__(self, maxlen: int) -> None:
        self._ids: collections.deque[str] = collections.deque(maxlen=maxlen)
        self._packed: collections.deque[bytes] = collections.deque(maxlen=maxlen)
        self._set: set[str] = set()

    def add(self, seg_id: str) -> None:
        if len(self._ids) == self._ids.maxlen:
            self._set.discard(self._ids[0])
        self._ids.append(seg_id)
        self._packed.append(msgpack.packb(seg_id))
        self._set.add(seg_id)

    def __contains__(self, seg_id: object) -> bool:
        return seg_id in self._set

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def packed(self) -> bytes:
        """The ids, oldest first, as one msgpack array."""
        header = msgpack.Packer().pack_array_header(len(self._packed))
        return header + b"".join(self._packed)


def staging(directory: str | Path, update: int, create: bool) -> Path:
    """The temporary folder checkpoint `update` is written in before its rename; `create` empties and makes it
    (rank 0 of a sharded learner, before the others write their shards into it)."""
    root = Path(directory)
    tmp = root / f".ckpt-{update:08d}.tmp"
    if create:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)  # the weights and the run's settings are the owner's alone: 0700 folders, 0600 files
    return tmp


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, contiguous, each name with a storage of its own: safetensors refuses two names for one storage,
    which a model whose head is tied to its embedding (Qwen2, GPT-2) gives when all its weights train (on a CPU,
    where `.cpu()` copies nothing). Loading both names back into the tied model writes the same values twice."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def save(
    directory: str | Path,
    update: int,
    tensors: dict[str, torch.Tensor] | None,
    value_head: dict[str, torch.Tensor] | None,
    optimizers: dict[str, Any],
    state: dict[str, Any],
    keep: int,
    model: Any = None,
    recent: RecentIds | None = None,
) -> Path:
    """Write checkpoint `update`; with a peft `model`, also its adapter as `adapter/` (loadable with PeftModel.from_pretrained).

    `tensors` and `value_head` None: the ranks of a sharded learner have written `sharded/` into `staging` already
    (`optimizers` is then empty), and the rest is added to it."""
    begin(directory, update, model, create=tensors is not None)
    extra = {"optimizers": optimizers, "rng": rng_states()}
    return finish(directory, update, tensors, value_head, extra, state, recent.packed() if recent is not None else None, keep)


def rng_states() -> dict[str, Any]:
    """The random number generators' states, as a checkpoint restores them."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def begin(directory: str | Path, update: int, model: Any = None, create: bool = True) -> Path:
    """The first part of writing checkpoint `update`, done where the weights are consistent (it reads the live
    model): its staging folder (`create`: made afresh), and with a peft `model` the adapter's export, `adapter/`."""
    tmp = staging(directory, update, create=create)
    if model is not None and hasattr(model, "peft_config"):
        model.save_pretrained(str(tmp / "adapter"))
    return tmp


def finish(
    directory: str | Path,
    update: int,
    tensors: dict[str, torch.Tensor] | None,
    value_head: dict[str, torch.Tensor] | None,
    extra: dict[str, Any],
    state: dict[str, Any],
    recent: bytes | None,
    keep: int,
) -> Path:
    """The rest of checkpoint `update` into the staging folder `begin` made, from copies (it may run while training
    goes on: learner_node/checkpointer.py), each file synced, then the rename that makes it the latest, atomically.
    `extra`: `optim.pt`'s content, the optimizers' states and `rng_states()`; `recent`: `RecentIds.packed()`."""
    root = Path(directory)
    final = root / f"ckpt-{update:08d}"
    tmp = staging(root, update, create=False)
    if tensors is not None and value_head is not None:
        save_file(_unshared(tensors), str(tmp / "policy.safetensors"))
        save_file(_unshared(value_head), str(tmp / "value_head.safetensors"))
    torch.save(extra, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    (tmp / RECENT_FILE).write_bytes(recent if recent is not None else msgpack.packb([]))
    for path in tmp.rglob("*"):
        if path.is_dir():
            path.chmod(0o700)
            continue
        with open(path, "rb") as fh:
            os.fchmod(fh.fileno(), 0o600)
            os.fsync(fh.fileno())  # on disk before the rename makes it visible
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in sorted(root.glob("ckpt-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def discard_staging(directory: str | Path) -> None:
    """Remove the staging folders of checkpoints whose writing was cut short (a crash before their rename)."""
    for tmp in Path(directory).glob(".ckpt-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def latest(directory: str | Path) -> Path | None:
    found = sorted(Path(directory).glob("ckpt-*"))
    return found[-1] if found else None


def is_sharded(path: str | Path) -> bool:
    """Whether a checkpoint was written by a sharded learner (its weights in `sharded/`, see learner_node/sharding.py)."""
    return (Path(path) / SHARDED).is_dir()


def load(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(policy tensors, value head, optimizer states, state) of a checkpoint; RNG states are restored. A sharded
    checkpoint's weights are read by `sharding.load_sharded`: here its tensors and optimizer states are empty."""
    path = Path(path)
    # onto the host: optimizer.load_state_dict moves each state to its parameter's device, whereas a tensor loaded
    # as saved would first land on the device it was saved from (another process's GPU, or one this host lacks)
    extra = torch.load(path / "optim.pt", weights_only=False, map_location="cpu")
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    state = read_state(path)
    if is_sharded(path):
        return {}, {}, extra["optimizers"], state
    return load_file(str(path / "policy.safetensors")), load_file(str(path / "value_head.safetensors")), extra["optimizers"], state


def read_state(path: str | Path) -> dict[str, Any]:
    """A checkpoint's state.json, with its `recent_segments` (oldest first) from their own file; checkpoints
    written before that file existed hold them in state.json."""
    path = Path(path)
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    if (path / RECENT_FILE).exists():
        state["recent_segments"] = msgpack.unpackb((path / RECENT_FILE).read_bytes())
    return state
