"""The learner's policy, loaded: whole, or sharded over the ranks (FSDP2, learner_node/sharding.py), with the
parallelism `[learner] parallelism` chooses, and checked on the scoring and generation paths it may use."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from learner_node import checkpoint, sharded_load, sharding
from learner_node.config import FSDP_FROM_PARAMETERS, LearnerConfig
from learner_node.packed_forward import check_layout
from learner_node.policy import LearnerPolicy
from models import scoring
from models.policy_model import ModelSpec, load_policy

log = logging.getLogger("learner_node.worker.loading")  # under the worker's logger, as before the split


def join_process_group(device: str) -> tuple[str, bool]:
    """(this rank's device, whether this process set up the process group): with several ranks and no group yet,
    the group `accelerate launch` (or torchrun) describes, and the device it gives this rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized()):
        from accelerate import Accelerator  # sets up the process group `accelerate launch` describes

        accelerator = Accelerator(cpu=device == "cpu")
        return str(accelerator.device), True
    return device, False


def choose_parallelism(cfg: LearnerConfig, spec: ModelSpec, world: int, is_main: bool) -> str:
    """[learner] parallelism, `auto` resolved by the model's size (FSDP_FROM_PARAMETERS); logged by rank 0."""
    chosen = cfg.parallelism
    if chosen == "auto":
        # Trained parameters: a LoRA adapter's ranks hold little beside the frozen base, which ddp keeps whole.
        # A run resumed from whole weights stays ddp (a sharded learner cannot read them).
        trained = sharded_load.parameter_count(spec) if cfg.policy.lora_rank == 0 else 0
        ckpt = checkpoint.latest(cfg.checkpoint_dir) if cfg.resume else None
        resumes_whole = ckpt is not None and not checkpoint.is_sharded(ckpt)
        chosen = "fsdp" if trained >= FSDP_FROM_PARAMETERS and not resumes_whole else "ddp"
    if is_main:
        why = " (auto, by the model's size)" if cfg.parallelism == "auto" else ""
        log.info("%d ranks, parallelism %s%s", world, chosen, why)
    return chosen


def load_learner_policy(cfg: LearnerConfig, spec: ModelSpec, sharded: bool) -> LearnerPolicy:
    """The policy with its critics. Sharded before the optimizers (which must hold the sharded parameters): a model
    loaded in 16 bits (bf16 on a GPU by default) computes in them with float32 master weights. In eval mode, and
    it stays so: no dropout."""
    model, tokenizer, frozen, checked = _load(spec, sharded, mixed=spec.resolved_dtype() != torch.float32)
    # The learner checks its scoring path as the actor does: every path it may use computes the model's own log-probabilities.
    path = scoring.select_path(checked, cfg.policy.scoring_path)
    layout = check_layout(checked, cfg.generation.micro_batch_tokens)  # and so does the generation path
    return LearnerPolicy(
        model,
        tokenizer,
        cfg.policy.normalisation,
        cfg.policy.temperature,
        cfg.value_hidden,
        path,
        cfg.generation.value_hidden,
        cfg.checkpoints_layers(str(spec.resolved_device())),
        layout,
        frozen=frozen,
    )


def _load(spec: ModelSpec, sharded: bool, mixed: bool) -> tuple[Any, Any, Any, Any]:
    """(policy, tokenizer, the reference copy of a full fine-tune or None, the model the path checks run on).
    Sharded: read straight into each rank's shards where the model is a local safetensors folder (no rank holds
    it whole; the checks run on a two-layer model of its architecture), else loaded whole and then sharded."""
    if sharded and sharded_load.loads_sharded(spec):
        model, tokenizer = sharded_load.load_sharded_policy(spec, mixed)
        frozen = sharded_load.load_sharded_policy(spec, mixed, trained=False)[0] if spec.lora_rank == 0 else None
        return model, tokenizer, frozen, sharded_load.probe_model(spec)
    model, tokenizer = load_policy(spec)
    if not sharded:
        return model, tokenizer, None, model
    log.info("%s is no local safetensors folder: each rank loads it whole, then shards it", spec.model)
    frozen = copy.deepcopy(model) if spec.lora_rank == 0 else None
    if frozen is not None:
        frozen.requires_grad_(False)
        sharding.shard(frozen, mixed)
    sharding.shard(model, mixed)
    return model, tokenizer, frozen, model
