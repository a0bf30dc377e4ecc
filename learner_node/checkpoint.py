"""Checkpoints: everything needed to go on exactly where an update left off, written atomically.

A checkpoint is a directory `ckpt-<index>` (the learner's updates and discarded updates so far: every save
a new, larger index): the policy's trainable weights
(`policy.safetensors`, the adapter in peft's key names, or all weights without
one), the value head, both optimizers, RNG states and `state.json` (policy
version, update count, KL coefficient, the stream entries and segment ids the
update consumed). It is written under a temporary name and renamed, so a
crash never leaves a half-written checkpoint that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)


def save(
    directory: str | Path,
    update: int,
    tensors: dict[str, torch.Tensor],
    value_head: dict[str, torch.Tensor],
    optimizers: dict[str, Any],
    state: dict[str, Any],
    keep: int,
    model: Any = None,
) -> Path:
    """Write checkpoint `update`; with a peft `model`, also its adapter as `adapter/` (loadable with PeftModel.from_pretrained)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{update:08d}"
    tmp = root / f".ckpt-{update:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "policy.safetensors"))
    save_file({k: v.contiguous() for k, v in value_head.items()}, str(tmp / "value_head.safetensors"))
    torch.save({"optimizers": optimizers, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    if model is not None and hasattr(model, "peft_config"):
        model.save_pretrained(str(tmp / "adapter"))
    for f in (p for p in tmp.rglob("*") if p.is_file()):  # on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in sorted(root.glob("ckpt-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(directory: str | Path) -> Path | None:
    found = sorted(Path(directory).glob("ckpt-*"))
    return found[-1] if found else None


def load(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(policy tensors, value head, optimizer states, state) of a checkpoint; RNG states are restored."""
    path = Path(path)
    extra = torch.load(path / "optim.pt", weights_only=False)
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    state = json.loads((path / "state.json").read_text())
    return load_file(str(path / "policy.safetensors")), load_file(str(path / "value_head.safetensors")), extra["optimizers"], state
