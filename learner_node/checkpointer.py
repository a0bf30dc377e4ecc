"""The learner's checkpoints: what it has done so far (`Progress`) with the trainer's weights and optimizers, saved
after every update and restored by `--resume` (the files: learner_node/checkpoint.py; sharded: sharding.py)."""

from __future__ import annotations

import collections
import logging
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from common.learner_figures import LearnerCounter
from learner_node import checkpoint, sharding
from learner_node.config import LearnerConfig
from learner_node.trainer import Trainer
from models.policy_model import load_policy_state_dict, policy_state_dict

log = logging.getLogger("learner_node.worker.checkpointer")  # under the worker's logger, as before the split

TOKEN_HEAD = "token."  # the token value head's tensors in a checkpoint's value_head.safetensors
RECENT_SEGMENTS = 100_000  # segment ids remembered to drop duplicates


@dataclass
class Progress:
    """What the learner has done, checkpointed with its weights."""

    # This run's id: announced with every snapshot and stamped on every choice made with its weights,
    # so versions are compared within a run. New on a fresh start, restored by --resume.
    run_id: str
    version: int = 0
    updates: int = 0
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    seen: checkpoint.RecentIds = field(default_factory=lambda: checkpoint.RecentIds(RECENT_SEGMENTS))  # segment ids read

    @property
    def saves(self) -> int:
        """Every save a new, larger index, a discarded update's too (it applies nothing, so `updates` stays): a
        save under the latest one's name would first delete it, and a crash between that and the rename would make
        the checkpoint before it the latest, while the entries of the update it held are acknowledged."""
        return self.updates + self.counters[LearnerCounter.DISCARDED_UPDATES]


class Checkpointer:
    """Saves and restores `progress` with `trainer`'s models and optimizers, whole or sharded."""

    def __init__(self, cfg: LearnerConfig, trainer: Trainer, progress: Progress, sharded: bool, is_main: bool) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.progress = progress
        self.sharded = sharded
        self.is_main = is_main

    def save(self, entry_ids: list[str]) -> None:
        """Called on every rank: rank 0 writes the checkpoint; a sharded learner's ranks each write their shards
        into the folder rank 0 made (a DCP checkpoint, `sharded/`), and rank 0 then adds the rest and renames it."""
        index = self.progress.saves
        if self.sharded:
            staging = checkpoint.staging(self.cfg.checkpoint_dir, index, create=self.is_main)
            dist.barrier()  # the folder exists before anyone writes into it
            sharding.save_sharded(staging / checkpoint.SHARDED, self.train_states())
            dist.barrier()  # every shard is written before rank 0 renames the folder
        if not self.is_main:
            return
        progress, model = self.progress, self.trainer.lp.model
        state = {
            "run_id": progress.run_id,
            "version": progress.version,
            "updates": progress.updates,
            "kl_coef": self.trainer.kl.value,
            "counters": dict(progress.counters),
            "last_entries": entry_ids,
            "config": asdict(self.cfg),
        }
        checkpoint.save(
            self.cfg.checkpoint_dir,
            index,
            None if self.sharded else policy_state_dict(model),
            None if self.sharded else self.value_heads_state(),
            {} if self.sharded else {name: opt.state_dict() for name, opt in self.trainer.optimizers.items()},
            state,
            self.cfg.keep_checkpoints,
            None if self.sharded else model,  # an adapter export (`adapter/`) needs whole weights
            progress.seen,
        )

    def restore(self) -> list[str]:
        """Restore the newest checkpoint; the stream entries its update consumed (the crash may have come before
        they were acknowledged), [] without one."""
        path = checkpoint.latest(self.cfg.checkpoint_dir)
        if path is None:
            log.info("--resume: no checkpoint in %s, starting fresh", self.cfg.checkpoint_dir)
            return []
        trainer, lp = self.trainer, self.trainer.lp
        tensors, value_head, optimizers, state = checkpoint.load(path)
        if checkpoint.is_sharded(path):  # written by a sharded learner: read by any number of ranks, this one included
            sharding.load_sharded(path / checkpoint.SHARDED, self.train_states())
        elif self.sharded:
            raise ValueError(
                f"{path} holds whole weights (written with parallelism ddp or by one rank); this learner shards them "
                "(parallelism fsdp): resume it once with --parallelism ddp, whose next checkpoint fsdp cannot read either, "
                "or start fresh; a sharded checkpoint resumes on any number of ranks either way"
            )
        else:
            device = next(lp.model.parameters()).device
            load_policy_state_dict(lp.model, {k: v.to(device) for k, v in tensors.items()})
            token_head = {k[len(TOKEN_HEAD) :]: v for k, v in value_head.items() if k.startswith(TOKEN_HEAD)}
            lp.value_head.load_state_dict({k: v for k, v in value_head.items() if not k.startswith(TOKEN_HEAD)})
            if token_head:  # checkpoints from before generation have none: the token head starts fresh
                lp.token_value_head.load_state_dict(token_head)
                trainer.token_critic.optimizer.load_state_dict(optimizers[trainer.token_critic.name])
            trainer.policy_opt.load_state_dict(optimizers["policy"])
            trainer.critic.optimizer.load_state_dict(optimizers[trainer.critic.name])
        progress = self.progress
        progress.version, progress.updates, trainer.kl.value = state["version"], state["updates"], state["kl_coef"]
        progress.run_id = state.get("run_id") or progress.run_id  # a checkpoint from before run ids: a new one
        progress.counters.update(state["counters"])
        for seg_id in state["recent_segments"]:
            progress.seen.add(seg_id)
        log.info("resumed from %s: policy version %d after %d updates", path, progress.version, progress.updates)
        return list(state["last_entries"])

    def value_heads_state(self) -> dict[str, torch.Tensor]:
        lp = self.trainer.lp
        return {**lp.value_head.state_dict(), **{TOKEN_HEAD + k: v for k, v in lp.token_value_head.state_dict().items()}}

    def train_states(self) -> dict[str, sharding.TrainState]:
        """What a sharded checkpoint holds: each model with its optimizer (learner_node/sharding.py)."""
        trainer = self.trainer
        return {
            "policy": sharding.TrainState(trainer.lp.model, trainer.policy_opt),
            **{c.name: sharding.TrainState(c.head, c.optimizer) for c in (trainer.critic, trainer.token_critic)},
        }
