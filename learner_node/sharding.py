"""The learner's models sharded over its ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each rank holds 1/N of every transformer block's parameters, gradients and Adam moments, and all-gathers a
block's parameters for its forward and backward only; gradients are reduce-scattered by FSDP itself, so
learner_node/gradients.py leaves them alone (`average` skips DTensor parameters). Three parts:

- `shard`: FSDP2 on each transformer block, then on the decoder (the root of what FSDP manages here).
- `full_state_chunks`: the unsharded weights, one parameter at a time, for chunked weight publication.
- `TrainState`, `save_sharded`, `load_sharded`: sharded checkpoints through torch.distributed.checkpoint (DCP),
  readable by any number of ranks, and by one process with no process group.

Sources:
- FSDP2: https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html and its tutorial,
  https://docs.pytorch.org/tutorials/intermediate/FSDP_tutorial.html (fully_shard per block, then the root;
  DTensor parameters; MixedPrecisionPolicy; state dicts of DTensors).
- DCP: https://docs.pytorch.org/docs/stable/distributed.checkpoint.html and
  https://docs.pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html (a Stateful app state built
  on get_state_dict / set_state_dict; load-time resharding; "loading without a process group").
- DTensor.full_tensor: https://docs.pytorch.org/docs/stable/distributed.tensor.html

Why torch's own `fully_shard` and not accelerate's FSDP plugin (fsdp_version=2, accelerate 1.15's
`fsdp2_prepare_model`): the plugin calls the same `fully_shard`, on its own choice of units: the blocks
(`_no_split_modules`), the input embedding, a group [final norm, (embedding,) LM head], and the causal LM as
the root, all of which gather their parameters in their forward hooks when the causal LM's forward runs. The
learner never runs it (it calls the decoder, then the head on the positions it scores: see `shard`): with a root
at the causal LM, a call to the decoder fails ("aten.embedding.default got mixed torch.Tensor and DTensor", tried
on torch 2.13), and a grouped unit cannot be the first to run (FSDP "requires a single root module"). The plugin
also takes over the optimizer, the gradient clipping and the checkpoints through `Accelerator.prepare`, all of
which the learner has its own of. One layer less, and the units where the learner's calls need them.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from models import scoring

T = TypeVar("T")
_ROOTS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the decoders `shard` made FSDP roots (see `Lockstep.of`)
# Per sharded model, the dtype each parameter had before `shard` made trained ones float32 master weights (mixed
# precision): what `full_state_chunks` publishes, so actors get the bf16 weights they serve, at half the bytes.
_LOADED_DTYPES: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.dtype]] = weakref.WeakKeyDictionary()


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard` (or any fully_shard) has been applied to `model` or to one of its modules."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder's transformer blocks: the modules of the classes transformers itself keeps whole when it
    splits a model over devices (`_no_split_modules`, e.g. LlamaDecoderLayer, GPT2Block), the unit
    accelerate's FSDP plugin wraps by default too. peft's LoRA layers live inside them."""
    wrapped: Any = model
    inner = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped  # unwrap peft
    kinds = set(getattr(inner, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in kinds]
    if not blocks:
        raise ValueError(f"no transformer blocks found in {type(inner).__name__} (its _no_split_modules: {sorted(kinds)})")
    return blocks


def shard(model: nn.Module, mixed_precision: bool, mesh: Any = None) -> nn.Module:
    """Apply FSDP2 to a policy (a peft LoRA model or a plain causal LM) or to its frozen reference copy, in place,
    on every rank of the default process group (or `mesh`); returns `model`.

    Units: each transformer block, then the decoder (`models.scoring.model_parts`) as the root. The root is the
    decoder and not the causal LM because the learner never calls the causal LM's forward: it calls the decoder,
    then the LM head on the positions it scores (models/scoring.py, learner_node/token_update.py). FSDP2 gathers a
    unit's parameters in that unit's forward hooks, so a unit at the causal LM would leave the embedding and the
    head sharded while they are used. The decoder's own parameters (embeddings, final norm) and everything
    outside it (the LM head, peft's wrappers) stay whole on every rank (`ignored_params`), and their gradients
    are averaged by learner_node/update.py as in data-parallel mode. This also keeps tied embeddings (an LM
    head that is the embedding table) correct; what it costs is memory: these parameters, their gradients and
    their Adam moments are not sharded (for a full fine-tune of an 8B Llama, 1.05B of its 8B parameters).

    A LoRA adapter (with peft's modules_to_save: every trained parameter of a peft model) stays whole on every
    rank too: it is a few MB, and sharded it would be gathered in bfloat16 under mixed precision while the actors
    run it in float32 (peft keeps adapters in float32 over a 16-bit base): learner and actors would no longer
    compute the same function with the same weights. With an adapter FSDP shards the frozen base, the bulk.

    `mixed_precision` (a model loaded in 16 bits, as on a GPU): MixedPrecisionPolicy(param_dtype=the loaded dtype,
    reduce_dtype=float32): blocks gathered and computed in bfloat16 (or float16), gradients reduced in float32
    into float32 master weights (a full fine-tune's trained block parameters are cast to float32 here; frozen ones
    keep their dtype, FSDP2 wants one dtype among the trained parameters of a unit only). The unsharded modules
    compute in their parameters' own dtype, as without sharding and as on the actors: a 16-bit trained
    embedding, final norm or head keeps its dtype, and the optimizer keeps its float32 master
    (learner_node/optim.py). Off (a float32 model): float32 throughout.
    (A 16-bit model sharded without it would step 16-bit DTensors, which MasterWeightAdam cannot.)"""
    if is_sharded(model):
        raise ValueError("the model is sharded already")
    blocks = transformer_blocks(model)
    decoder = scoring.model_parts(model)[0]
    adapter = {p for p in model.parameters() if p.requires_grad} if hasattr(model, "peft_config") else set()
    if mixed_precision:
        _LOADED_DTYPES[model] = {name: t.dtype for name, t in model.state_dict().items()}  # tied names too
        for block in blocks:
            for p in block.parameters():
                if p.requires_grad and p.is_floating_point() and p not in adapter:
                    p.data = p.data.float()  # the master weights the optimizer steps on
        loaded = next(p.dtype for p in model.parameters() if p.is_floating_point())  # bf16, or fp16
        policy = MixedPrecisionPolicy(param_dtype=loaded, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    in_blocks = {p for block in blocks for p in block.parameters()}
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params={p for p in block.parameters() if p in adapter})
    whole = {p for p in decoder.parameters() if p not in in_blocks or p in adapter}
    fully_shard(decoder, mesh=mesh, mp_policy=policy, ignored_params=whole)
    _ROOTS.add(decoder)
    return model


class Lockstep:
    """Makes every rank run the same number of forwards of a sharded decoder in each micro-batch, the way torch's
    `Join` shadows the collectives of a DDP rank that ran out of inputs (torch.distributed.algorithms.join).

    Why: FSDP2 all-gathers each block's parameters in every forward of the block and reduce-scatters its gradients
    after every backward through it (its forward and post-backward hooks, per call). The ranks' micro-batches hold
    different samples, and how many forwards of the decoder a micro-batch takes depends on them (a packed
    generation micro-batch takes one per group of rows that fits the token budget; the kv-cache scoring paths
    one per item or candidate). Ranks that run different numbers of forwards enter different collectives (gloo
    hangs, or, blocks being the same size, silently mixes one block's weights into another's).

    How: while `run` does a rank's real forwards, each forward of the decoder first joins a one-number
    all-reduce (max) saying "a forward follows"; when its own are done, a rank keeps joining rounds saying "none
    from me" and, while another rank still announces one, runs a forward of its own on one token. Every round,
    every rank runs exactly one forward (real or padding), so the all-gathers match; the padding forwards enter the
    loss with weight 0 (`run`'s second value), so the backward runs through as many forwards, last first, on every
    rank, and the reduce-scatters match too: their gradients are zeros. (That every rank runs as many micro-batches,
    each one backward, is learner_node/update.py's `_padding`.) Forwards within a micro-batch that raise on one rank
    still leave the others waiting."""

    def __init__(self, root: nn.Module | None) -> None:
        self.root = root
        self.world = dist.get_world_size() if root is not None and dist.is_available() and dist.is_initialized() else 1
        self.device = next(root.parameters()).device if root is not None else torch.device("cpu")

    @classmethod
    def of(cls, params: Iterable[torch.Tensor]) -> Lockstep:
        """The lockstep for the decoder that holds `params` if `shard` sharded it; one that does nothing otherwise.
        By membership, not by DTensor: a sharded LoRA model's trained parameters are all whole (see `shard`)."""
        ids = {id(p) for p in params}
        roots = [root for root in list(_ROOTS) if any(id(p) in ids for p in root.parameters())] if _ROOTS else []
        if len(roots) > 1:
            raise ValueError(f"the trained parameters belong to {len(roots)} sharded models; a lockstep keeps one in step")
        return cls(roots[0] if roots else None)

    def _round(self, forward_follows: bool) -> bool:
        """One round: whether any rank runs another forward in it."""
        flag = torch.tensor([int(forward_follows)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _announce(self, module: nn.Module, args: Any) -> None:
        self._round(True)

    def run(self, forwards: Callable[[], T]) -> tuple[T, torch.Tensor | float]:
        """(`forwards()`, the padding term to add to the loss before its backward: 0, with the padding forwards'
        graphs behind it). Without a sharded decoder on several ranks: (`forwards()`, 0.0), nothing more."""
        if self.root is None or self.world == 1:
            return forwards(), 0.0
        handle = self.root.register_forward_pre_hook(self._announce, prepend=True)
        try:
            result = forwards()
        finally:
            handle.remove()
        padding: torch.Tensor | float = 0.0
        token = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # id 0: in every vocabulary
        while self._round(False):
            hidden = self.root(input_ids=token, use_cache=False).last_hidden_state
            padding = padding + hidden.float().sum() * 0.0
        return result, padding


def _gathered(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: a DTensor shard all-gathered (a collective), a whole tensor as it is."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def full_state_chunks(model: nn.Module, names: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor on the CPU) for each entry of `model.state_dict()`, gathered from the shards one at a
    time: rank 0 yields each as it is gathered, and holds one whole parameter at a time besides its shards, never
    a second copy of the model; the other ranks take part in each gather and yield nothing.

    `names` maps state-dict keys to the names to yield, and picks them (default: every key under its own name;
    `policy_names`: what the policy publishes). Every rank must run the iterator to its end, in step: each
    sharded entry is one all-gather (DTensor.full_tensor) on every rank. Unsharded entries (see `shard`) need none.
    The yielded tensors may share memory with the model on the CPU: copy one to keep it past the next update."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    loaded = _LOADED_DTYPES.get(model, {})
    state = model.state_dict()  # sharded DTensors and whole tensors, as they are: no collective, no copy
    for key, value in state.items():
        if names is not None and key not in names:
            continue
        whole = _gathered(value.detach())
        if rank == 0:  # in the dtype it was loaded in (mixed precision trains float32 masters of bf16 weights)
            yield (names[key] if names is not None else key), whole.to(loaded.get(key, whole.dtype)).cpu().contiguous()
        del whole  # before the next gather: one whole parameter at a time


def policy_names(model: nn.Module) -> dict[str, str]:
    """The state-dict keys of what the policy publishes, each to its published name: with an adapter, the keys
    peft's `get_peft_model_state_dict` keeps and its names for them (`models.policy_model.policy_state_dict`);
    without one, every key under its own name. Found by identity on one state dict of the (sharded) model, so no
    tensor is gathered or copied."""
    state = model.state_dict()
    if not hasattr(model, "peft_config"):
        return {key: key for key in state}
    from peft import get_peft_model_state_dict

    key_of = {id(value): key for key, value in state.items()}
    published = get_peft_model_state_dict(model, state_dict=state)
    missing = [name for name, value in published.items() if id(value) not in key_of]
    if missing:
        raise ValueError(f"peft renamed tensors it also copied, so their state-dict keys are unknown: {missing[:3]}")
    return {key_of[id(value)]: name for name, value in published.items()}


# --- sharded checkpoints (torch.distributed.checkpoint) -------------------------------------------
# Trained parameters only: a LoRA checkpoint holds the adapter (and peft's modules_to_save), not the frozen base,
# which the learner loads from the model's own files anyway. Loading is then not strict about the frozen keys it
# lacks; a trained key missing from the checkpoint still fails, in dcp.load (every key of the destination,
# `TrainState.state_dict`, must be found in the checkpoint).
_SAVE = StateDictOptions(ignore_frozen_params=True)
_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)


class TrainState(Stateful):
    """A model and its optimizers as one entry of a DCP checkpoint (the DCP recipe's AppState). Its state dict is
    get_state_dict's: parameters and optimizer states under the parameters' fully qualified names, DTensor shards
    on a sharded model and whole tensors on a plain one, so one written by N ranks loads into M ranks or into a
    plain model in one process, DCP reading each rank's part from the files."""

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizers, options=_SAVE)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizers, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"], options=_LOAD
        )


def save_sharded(path: str | Path, parts: Mapping[str, TrainState]) -> None:
    """Write `parts` as one DCP checkpoint in directory `path`, every rank its own shards (a collective: every
    rank calls it with the same parts). Whole tensors (unsharded modules, optimizer step counts) are written
    once, not once per rank."""
    dcp.save(dict(parts), checkpoint_id=str(path))


def load_sharded(path: str | Path, parts: Mapping[str, TrainState]) -> None:
    """Load a checkpoint written by `save_sharded` into `parts` (the same names; models and optimizers built as
    the writer's were, sharded over any number of ranks or not at all): each rank reads what its shards need.
    With no process group (one process, plain modules) DCP loads without any collective."""
    for part in parts.values():
        for opt in part.optimizers:
            # get_state_dict fills an optimizer with no state yet by a step on zero gradients, but skips that if a
            # parameter has a gradient, and the optimizer's states would then not be loaded at all
            opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # loading in one process with no process group is what this is for, not a mistake to warn of
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(dict(parts), checkpoint_id=str(path))
