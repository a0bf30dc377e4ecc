"""Which GPU each process `ppoz up` starts gets: one GPU per process where there are enough.

A process left at `device = "auto"` takes torch's current CUDA device, GPU 0, so a stack of a learner and
four actors on an 8-GPU machine used to put all five on GPU 0 and leave seven idle. `deal` gives the learner
GPU 0 to itself and the actors the other GPUs, one each, round robin when there are more actors than GPUs
left; on a machine of one GPU everything shares it. Processes whose device is set (`[actor] device`,
`[learner] device`, `[up] actor_devices`) keep it, and a GPU named there that the machine lacks is a config
error before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError


@dataclass(frozen=True)
class Deal:
    """The device each process is started with ("" keeps its own setting) and a line that says how."""

    learner: str
    actors: list[str]
    summary: str


def visible_gpus() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 without torch's CUDA build. A Linux
    machine with no NVIDIA device node is answered without importing torch (a second or two, and the memory
    of the supervisor that `ppoz up` is, for nothing)."""
    import glob
    import os
    import sys

    # NVIDIA's device nodes; WSL2's GPU (/dev/dxg) and ROCm's (/dev/kfd), which torch's cuda API serves too
    nodes = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/dxg") + glob.glob("/dev/kfd")
    if sys.platform.startswith("linux") and not nodes and "CUDA_VISIBLE_DEVICES" not in os.environ:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def deal(gpus: int, actors: int, learner: bool, actor_device: str, learner_device: str, actor_devices: list[str]) -> Deal:
    """The deal for `actors` actor processes and (if `learner`) a learner on a machine with `gpus` GPUs, given
    the [actor] and [learner] device settings and [up] actor_devices (empty entries keep [actor] device)."""
    chosen = [d for d in actor_devices if d] + [d for d in (actor_device, learner_device) if d and d != "auto"]
    for device in chosen:
        _check_exists(device, gpus)
    explicit = [actor_devices[i % len(actor_devices)] if actor_devices else "" for i in range(actors)]
    dealt_learner = ""
    if learner and learner_device == "auto" and gpus > 0:
        dealt_learner = "cuda:0"
    auto = [i for i in range(actors) if not explicit[i] and actor_device == "auto"]
    dealt = list(explicit)
    if gpus > 0 and auto:
        # the learner's GPU is its own where there is another for the actors (it holds the optimizer and activations)
        pool = list(range(1, gpus)) if dealt_learner and gpus > 1 else list(range(gpus))
        for k, i in enumerate(auto):
            dealt[i] = f"cuda:{pool[k % len(pool)]}"
    return Deal(dealt_learner, dealt, _summary(gpus, dealt_learner, dealt, learner, actor_device, learner_device))


def _check_exists(device: str, gpus: int) -> None:
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    if gpus == 0:
        raise ConfigError(f"device {device!r}: this machine has no CUDA GPU (torch sees none); use cpu or auto")
    if index and (not index.isdigit() or int(index) >= gpus):
        raise ConfigError(f"device {device!r}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1} (CUDA_VISIBLE_DEVICES applies)")


def _summary(gpus: int, learner_device: str, actors: list[str], learner: bool, actor_setting: str, learner_setting: str) -> str:
    if gpus == 0:
        return "no GPU visible: every process on its configured device (auto: cpu)"
    parts = [f"learner {learner_device or learner_setting}"] if learner else []
    parts += [f"actor-{i} {device or actor_setting}" for i, device in enumerate(actors)]
    on_gpus = [d for d in ([learner_device] if learner else []) + actors if d.startswith("cuda")]
    shared = len(on_gpus) > len(set(on_gpus))
    note = "; some share a GPU (more processes than GPUs): set [up] actor_devices to choose" if shared else ""
    return f"{gpus} GPU(s): " + ", ".join(parts) + note


def pinned(device: str, inherited: str | None) -> tuple[str, dict[str, str]]:
    """(the device a process is started with, its environment's additions): a process on one GPU sees that GPU
    alone (CUDA_VISIBLE_DEVICES), as its cuda:0. A process on cuda:3 that saw every GPU would still open a CUDA
    context on GPU 0, the learner's (0.3-0.5 GB each), whenever a thread of its restores torch's default device
    (leaving a `torch.cuda.stream` block does). `inherited`: the CUDA_VISIBLE_DEVICES `ppoz up` itself runs
    under, whose n-th entry is cuda:n here. Any other device is kept as it is, with nothing added."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        return device, {}
    visible = [v.strip() for v in inherited.split(",")] if inherited else []
    gpu = visible[int(index)] if int(index) < len(visible) else index
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": gpu}
