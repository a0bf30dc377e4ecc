"""Loading a policy straight into FSDP2 shards: no rank ever holds the whole model.

`models.policy_model.load_policy` reads every weight on every rank and `sharding.shard` then keeps each rank's
1/N: a rank's memory held the whole model first (in float32 on a CPU), and its allocator kept most of it after
(docs/benchmarks.md, "The sharded learner"). Here, as FSDP2's own recipe does
(https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, "meta-device initialization"):

1. the model (and its LoRA adapter) is built on the meta device from its config: parameters without storage
   (accelerate's `init_empty_weights`; buffers are made for real, so the ones not in the checkpoint, such as
   rotary inverse frequencies, are computed as the model's own constructor computes them);
2. `sharding.shard` shards it, still on the meta device;
3. each parameter gets storage on the rank's device, of its local shard only;
4. the checkpoint's tensors are read one at a time (safetensors, memory-mapped) and each rank copies its own
   rows into its shard; whole parameters (embeddings, norms, head, the adapter) are copied whole;
5. the adapter is initialised as peft initialises it (same seed on every rank, so the whole adapter is the same
   on all of them); peft's trained copies of modules (`lora_trainable`) are read under their originals' names.

The result is the model `load_policy` then `shard` would give, to the bit (tests/learner_node/test_sharded_load.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from learner_node import sharding
from models import scoring
from models.policy_model import ModelSpec, with_adapter

ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def loads_sharded(spec: ModelSpec) -> bool:
    """Whether `load_sharded_policy` can read `spec.model`: a local folder of safetensors files holding every
    tensor of the model under the name `checkpoint_name` gives it (a checkpoint with other names, which
    transformers renames as it loads, such as GPT-2's without its `transformer.` prefix, is loaded whole)."""
    folder = Path(spec.model)
    if not ((folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists()):
        return False
    files = checkpoint_files(folder)
    return not _missing(_tensors_by_name(empty_model(spec)), files)


def empty_model(spec: ModelSpec, layers: int | None = None) -> Any:
    """`spec`'s model and adapter built on the meta device from its config (no weights read); `layers`: only the
    first that many decoder layers."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec.model)
    if layers is not None:
        scoring.keep_layers(config, layers)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=spec.resolved_dtype(), attn_implementation=spec.attn_implementation)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        # a tied head is the embedding table: from_pretrained ties them, from_config on the meta device does not (and
        # within init_empty_weights an assigned parameter is registered as a new one)
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    with init_empty_weights(include_buffers=False):
        return with_adapter(model, spec)


def parameter_count(spec: ModelSpec) -> int:
    """The parameters of `spec`'s base model (no adapter), counted on the meta device."""
    return sum(p.numel() for p in empty_model(replace(spec, lora_rank=0)).parameters())


def probe_model(spec: ModelSpec, layers: int = 2) -> Any:
    """A model of `spec`'s architecture, adapter and dtype with only its first `layers` decoder layers and random
    weights, on the CPU: what the scoring-path and layout checks (`scoring.select_path`, `check_layout`) run on
    for a sharded learner, whose own model no rank holds whole. They check how the architecture masks, windows
    and post-processes logits, which its weights and depth do not change."""
    dtype = str(spec.resolved_dtype()).removeprefix("torch.")  # the dtype the real model runs in, on its device
    model = empty_model(replace(spec, device="cpu", dtype=dtype), layers)
    _materialise(model, torch.device("cpu"))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model.eval()


def load_sharded_policy(spec: ModelSpec, mixed_precision: bool, mesh: Any = None, trained: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) as `load_policy(spec)` followed by `sharding.shard(model, mixed_precision, mesh)`,
    with every rank holding only its shards at any time; `trained` False: a frozen copy (the reference of a
    full fine-tune), no gradients, no float32 masters. `spec.model` must be a local directory of safetensors
    files (`loads_sharded`: what `ppoz tiny-model` and `save_pretrained` write)."""
    from transformers import AutoTokenizer

    files = checkpoint_files(Path(spec.model))
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    model = empty_model(spec)
    if not trained:
        model.requires_grad_(False)
    sharding.shard(model, mixed_precision, mesh)
    _materialise(model, spec.resolved_device())
    _load_tensors(model, files)
    _init_adapter(model)
    model.eval()
    return model, tokenizer


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for every meta parameter (uninitialised: of a sharded one its local shard only) and the
    buffers the constructor computed moved there. `Module.to_empty` would leave those buffers uninitialised too.
    A parameter shared by several modules (a head tied to the embedding table) stays one: `_apply` gives each
    module a parameter of its own when it cannot swap a meta tensor's storage in place."""
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places[id(param)].append((module, name))
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    for shared in places.values():
        first = getattr(shared[0][0], shared[0][1])
        for module, name in shared[1:]:
            setattr(module, name, first)


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the model's safetensors checkpoint, to the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{folder}: no model.safetensors (or its index): a sharded learner loads safetensors checkpoints only")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def checkpoint_name(key: str) -> str:
    """The checkpoint's name for a state-dict key of the (peft-wrapped) model."""
    key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return key.replace(".original_module.", ".").replace(".modules_to_save.default.", ".")


def _load_tensors(model: nn.Module, files: dict[str, Path]) -> None:
    """Every tensor of `model` that is in the checkpoint, from it: a sharded one's local rows only. A tensor under
    several keys (a tied head) is loaded once; an adapter's tensors are not in the checkpoint."""
    from safetensors import safe_open

    grouped = _tensors_by_name(model)
    missing = _missing(grouped, files)
    if missing:
        raise ValueError(f"the checkpoint lacks {checkpoint_name(missing[0])!r} (the model's {missing[0]!r})")
    by_file: dict[Path, list[tuple[torch.Tensor, str]]] = defaultdict(list)
    for tensor, keys in grouped:
        name = next(checkpoint_name(key) for key in keys if checkpoint_name(key) in files)
        by_file[files[name]].append((tensor, name))
    with torch.no_grad():
        for path, wanted in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for target, name in wanted:
                    _copy_into(target, f.get_tensor(name))


def _tensors_by_name(model: nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """Each tensor of the model's state dict that a checkpoint holds (not the adapter's), with all its keys (a
    tied head's tensor is the embedding table's: two keys)."""
    keys_of: dict[int, list[str]] = defaultdict(list)
    tensors: dict[int, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        keys_of[id(value)].append(key)
        tensors[id(value)] = value
    adapter = [ident for ident, keys in keys_of.items() if any(part in key.split(".") for key in keys for part in ADAPTER_PARTS)]
    return [(tensors[ident], keys) for ident, keys in keys_of.items() if ident not in adapter]


def _missing(grouped: list[tuple[torch.Tensor, list[str]]], files: dict[str, Path]) -> list[str]:
    """The first key of each tensor none of whose names the checkpoint holds."""
    return [keys[0] for _, keys in grouped if not any(checkpoint_name(key) in files for key in keys)]


def _copy_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        # each rank cuts its own rows from the whole tensor it read (no collective: src_data_rank None)
        local = distribute_tensor(whole.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(whole)


def _init_adapter(model: nn.Module) -> None:
    """The LoRA layers' weights as peft initialises them, drawing from torch's generator in peft's order: the same
    seed gives the same adapter on every rank, and the one `load_policy` makes. peft makes each layer's A and B as
    nn.Linear (whose constructor draws its own initial weights, on the meta device here: nothing drawn), then
    draws A again (`reset_lora_parameters`), moves the adapter to the base layer's dtype and only then keeps it in
    float32 (autocast_adapter_dtype): drawn here in that order, and rounded through the base dtype. (peft's
    trained copies of modules were loaded from the checkpoint under their originals' names, `checkpoint_name`.)"""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                layer: Any = module  # peft's layers hold their parts in ModuleDicts that mypy cannot see through
                base_dtype = layer.get_base_layer().weight.dtype
                for adapter in layer.lora_A:
                    parts = (layer.lora_A[adapter], layer.lora_B[adapter])
                    device = parts[0].weight.device
                    for part in parts:  # drawn on the CPU, from the generator load_policy draws from
                        part.weight.data = torch.empty(part.weight.shape, dtype=part.weight.dtype)
                        part.reset_parameters()
                    layer.reset_lora_parameters(adapter, True)
                    for part in parts:  # rounded as peft's pass through the base dtype rounds it
                        part.weight.data = part.weight.data.to(base_dtype).to(part.weight.dtype).to(device)
