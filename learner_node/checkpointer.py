"""The learner's checkpoints: what it has done so far (`Progress`) with the trainer's weights and optimizers, saved
by cadence and restored by `--resume` (the files: learner_node/checkpoint.py; sharded: sharding.py).

By cadence (`checkpoint_every` updates or `checkpoint_every_s` seconds, whichever first): after an update that
makes one due, its content is copied to the host (`Copy`: the weights, the optimizers, the counters and the ids of
what was trained, at that moment), and a thread writes it while the next updates run; a checkpoint is not begun
while the one before is still being written. The stream entries trained since the checkpoint before wait in
`undurable` and are handed to the learner for acknowledgement only once the checkpoint holding them is on disk
(`durable`). A crash at any moment thus leaves every entry trained after the last complete checkpoint pending in
Redis: `--resume` restores that checkpoint and trains them again, each once, and loses at most the updates since.
A sharded learner's checkpoint is a collective of all ranks, written at once."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

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


Entry = tuple[str, dict]  # a stream entry: its id and fields


@dataclass
class Copy:
    """One checkpoint's content, copied at one moment (after an update), so that it can be written while the next
    updates change the weights: host tensors, the state's numbers and names, the trained segment ids packed."""

    index: int
    entries: list[Entry]  # trained since the checkpoint before: acknowledged once this one is on disk
    tensors: dict[str, torch.Tensor]
    value_head: dict[str, torch.Tensor]
    extra: dict[str, Any]  # optim.pt: the optimizers' states and the RNG states
    state: dict[str, Any]
    recent: bytes


class Checkpointer:
    """Saves and restores `progress` with `trainer`'s models and optimizers, whole or sharded, by cadence (see the
    module's docstring). `undurable`: the ids of stream entries trained but in no checkpoint on disk yet, shared with
    the stream reader, which leaves them alone (they are pending in Redis until acknowledged)."""

    def __init__(
        self, cfg: LearnerConfig, trainer: Trainer, progress: Progress, sharded: bool, is_main: bool, undurable: set[str] | None = None
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.progress = progress
        self.sharded = sharded
        self.is_main = is_main
        self.undurable: set[str] = undurable if undurable is not None else set()
        self.trained: list[Entry] = []  # entries trained since the last checkpoint was begun
        self.since = 0  # updates since then
        self.began_at = time.monotonic()
        self._writer: threading.Thread | None = None
        self._written: Copy | None = None  # the writer's copy, once on disk
        self._failed: BaseException | None = None
        self._durable: list[Entry] = []  # entries of checkpoints on disk, not yet handed over (`durable`)
        self.keep = cfg.keep_checkpoints

    # --- by cadence ------------------------------------------------------------------------------
    def after_update(self, entries: list[Entry], agree: Callable[[bool], bool] = lambda due: due) -> None:
        """An update (applied or discarded) consumed `entries` (rank 0's; [] elsewhere): they wait for a checkpoint,
        which is begun here when due. `agree`: every rank of a sharded learner takes rank 0's answer (its save is a
        collective)."""
        self.trained += entries
        self.undurable.update(entry_id for entry_id, _ in entries)
        self.since += 1
        due = self._due()
        if self.sharded:
            due = agree(due)
        if due:
            self.checkpoint(background=not self.sharded)

    def catch_up(self) -> None:
        """While the learner waits for data (rank 0, between its reads): begin the checkpoint that came due while the
        one before was still being written, or by time, so that an idle learner does not sit on entries it trained
        (a crash would lose their updates, and another consumer takes over entries left pending claim_idle_ms).
        Nothing changes the weights meanwhile. Not for a sharded learner: its save is a collective of all ranks,
        begun after an update only (written at once, so never left due by a write in progress; one due by
        `checkpoint_every_s` while it idles waits for the next update)."""
        if self.sharded or not self.is_main or not self.since:
            return
        if self._due():
            self.checkpoint(background=True)

    def _due(self) -> bool:
        if self._writer is not None and self._writer.is_alive():
            return False  # one write at a time: the next is begun after an update once this one is on disk
        every, every_s = self.cfg.checkpoint_every, self.cfg.checkpoint_every_s
        return bool(every and self.since >= every) or bool(every_s and time.monotonic() - self.began_at >= every_s)

    def checkpoint(self, background: bool) -> None:
        """Begin a checkpoint of the state as it is now, holding the entries trained since the last one: written by a
        thread (`background`) or before this returns."""
        self._collect()
        entries, self.trained, self.since, self.began_at = self.trained, [], 0, time.monotonic()
        if self.sharded:
            self._save_sharded(entries)
            self._durable += entries
            return
        if not self.is_main:
            return
        copy = self._copy(entries)
        if not background:
            self._write(copy)
            self._collect()
            return
        self._writer = threading.Thread(target=self._write, args=(copy,), name="checkpoint-writer", daemon=True)
        self._writer.start()

    def durable(self) -> list[Entry]:
        """The entries of the checkpoints now on disk, each once: the learner acknowledges them. Raises what a
        background write failed with."""
        self._collect()
        out, self._durable = self._durable, []
        self.undurable.difference_update(entry_id for entry_id, _ in out)
        return out

    def flush(self) -> list[Entry]:
        """Before the learner stops: wait for the write in progress, then checkpoint what was trained since, at once;
        every entry trained is then in a checkpoint on disk (`durable`'s answer)."""
        if self._writer is not None:
            self._writer.join()
        if self.trained or self.since:
            self.checkpoint(background=False)
        return self.durable()

    def _collect(self) -> None:
        """Take over a finished background write: its entries are durable; its error is raised here."""
        if self._writer is not None and not self._writer.is_alive():
            self._writer = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        if self._written is not None:
            self._durable += self._written.entries
            self._written = None

    def _copy(self, entries: list[Entry]) -> Copy:
        """What rank 0 writes, copied now; the adapter's export (small, read from the live model) is written here."""
        progress, model = self.progress, self.trainer.lp.model
        index = progress.saves
        checkpoint.begin(self.cfg.checkpoint_dir, index, model)
        state = self._state(entries)
        optimizers = {name: opt.state_dict() for name, opt in self.trainer.optimizers.items()}
        extra = {"optimizers": _host(optimizers), "rng": checkpoint.rng_states()}
        return Copy(index, entries, _host(policy_state_dict(model)), _host(self.value_heads_state()), extra, state, progress.seen.packed())

    def _state(self, entries: list[Entry]) -> dict[str, Any]:
        """state.json: the progress as it is now, and the entries the checkpoint holds."""
        progress = self.progress
        return {
            "run_id": progress.run_id,
            "version": progress.version,
            "updates": progress.updates,
            "kl_coef": self.trainer.kl.value,
            "counters": dict(progress.counters),
            "last_entries": [entry_id for entry_id, _ in entries],
            "config": asdict(self.cfg),
        }

    def _write(self, copy: Copy) -> None:
        try:
            where, keep = self.cfg.checkpoint_dir, self.keep
            checkpoint.finish(where, copy.index, copy.tensors, copy.value_head, copy.extra, copy.state, copy.recent, keep)
            self._written = copy
        except BaseException as e:  # noqa: BLE001 - raised in the learner's own thread by `durable`
            self._failed = e

    def _save_sharded(self, entries: list[Entry]) -> None:
        """Called on every rank: each writes its shards into the folder rank 0 made (a DCP checkpoint, `sharded/`),
        and rank 0 then adds the rest and renames it."""
        index = self.progress.saves
        staging = checkpoint.staging(self.cfg.checkpoint_dir, index, create=self.is_main)
        dist.barrier()  # the folder exists before anyone writes into it
        sharding.save_sharded(staging / checkpoint.SHARDED, self.train_states())
        dist.barrier()  # every shard is written before rank 0 renames the folder
        if not self.is_main:
            return
        checkpoint.save(self.cfg.checkpoint_dir, index, None, None, {}, self._state(entries), self.keep, None, self.progress.seen)

    def restore(self) -> list[str]:
        """Restore the newest checkpoint; the stream entries its update consumed (the crash may have come before
        they were acknowledged), [] without one."""
        if self.is_main:
            checkpoint.discard_staging(self.cfg.checkpoint_dir)  # a write the crash cut short
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


def _host(value: Any) -> Any:
    """`value` with every tensor copied to the host (a copy even of a host tensor: training goes on changing the
    original), dicts and lists rebuilt, the rest shared."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value
