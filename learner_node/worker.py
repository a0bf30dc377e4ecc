"""The learner process: segments from the Redis stream -> PPO update -> checkpoint -> ack -> publish.

The data path of one update, in order, and why the order matters:

1. read segments through the consumer group (own pending entries first after a
   restart, then entries a dead learner left pending, then new ones) until
   `rollout_batch` transitions are in hand; segment ids already trained are skipped;
2. build the rollout (GAE, staleness filter) and run the PPO update;
3. checkpoint, atomically, with the stream entries the updates since the last
   one consumed: by cadence (`checkpoint_every`, `checkpoint_every_s`), copied
   after the update and written while the next ones train;
4. acknowledge (XACK) and delete those entries once their checkpoint is on disk:
   only then, so a crash at any earlier point leaves them pending and they are
   trained again from the previous checkpoint's weights, never twice and never lost;
5. store the new weights in Redis, then announce them on PUB.

Several processes (`accelerate launch --num_processes N -m ppoz.cli learner ...`,
one per GPU): rank 0 alone reads the stream, checkpoints, acknowledges and
publishes; it broadcasts each rollout's segments to the other ranks, every rank
runs the same update on its share of each minibatch (learner_node/update.py),
and gradients are averaged across ranks before each optimizer step.

The parts, each in a file of its own, wired here by `Learner`, which runs the loop above:
learner_node/stream_reader.py reads and acknowledges the stream (steps 1 and 4); learner_node/trainer.py
builds each rollout's batches and trains them (step 2, learner_node/update.py); learner_node/checkpointer.py
saves and restores checkpoints (step 3); learner_node/publisher.py stores and announces the weights (step 5);
learner_node/redis_work.py holds the Redis work of steps 4 and 5 until Redis has taken it; and
learner_node/report.py logs each update and makes the figures other processes read (common/learner_figures.py).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from typing import cast

import redis
import torch
import torch.distributed as dist
import zmq

from common import weights
from common.learner_figures import CANDIDATES, Chart, CyclePhase, LearnerCounter, read_latest
from common.protocol import DEFAULT_MAX_ABS_REWARD
from common.sd_notify import Notifier
from common.segments import Segment
from common.shared_settings import PolicyStamp
from common.snapshot_serve import SnapshotServer
from learner_node import checkpoint
from learner_node.checkpointer import Checkpointer, Progress
from learner_node.config import LearnerConfig
from learner_node.cycle import CycleClock
from learner_node.intake import Intake
from learner_node.loading import choose_parallelism, join_process_group, load_learner_policy
from learner_node.publisher import Publisher
from learner_node.redis_work import REDIS_DOWN, RedisWork
from learner_node.report import Reporter, latest_figures
from learner_node.stream_reader import StreamReader, with_samples
from learner_node.trainer import Trainer
from learner_node.update import NonFiniteUpdate
from models.policy_model import ModelSpec

log = logging.getLogger(__name__)


def backlog_limit(rollout_batch: int, max_policy_lag: int) -> int:
    """The stream backlog (transitions in closed segments no learner has read yet) this learner can train within
    its policy-lag bound.

    Each update consumes about `rollout_batch` transitions and moves the policy one version, so a
    transition that waits behind B unread transitions is trained about B / rollout_batch + 1 versions
    after it was scored (the update in progress, then those before it). Holding the backlog to half
    the lag bound's worth, less the rollout being trained, keeps the lag of what the actors produce
    within the bound, whatever the learner's pace: a slow learner makes the actors wait instead of
    making the data stale. Never less than one rollout: the next one, read as this update ends. What
    the learner has read no longer counts (the broker counts unread entries), so neither the rollout
    in training nor the entries waiting for their checkpoint hold the actors back.
    """
    return max(1, max_policy_lag // 2 - 1) * rollout_batch


class Learner:
    """The learner process: its parts (see the module's docstring), and the loop that runs them."""

    def __init__(self, cfg: LearnerConfig, client: redis.Redis, context: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.redis = client
        self.keys = cfg.store.keys
        self.stream = self.keys.stream
        device, self.owns_process_group = join_process_group(cfg.device)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
        spec = ModelSpec.of(cfg.policy, device)
        self.sharded = self.world > 1 and choose_parallelism(cfg, spec, self.world, self.is_main) == "fsdp"
        self.lp = load_learner_policy(cfg, spec, self.sharded)
        self.trainer = Trainer(cfg, self.lp, self.is_main)
        self.progress = Progress(run_id=uuid.uuid4().hex[:12])
        if self.world > 1:
            shared_run = [self.progress.run_id]
            dist.broadcast_object_list(shared_run, src=0)
            self.progress.run_id = shared_run[0]
        self.discarded_in_row = 0  # updates left out in a row because they were not finite (see _discard)
        self.stop_event = threading.Event()
        self.notifier = Notifier() if self.is_main else Notifier({})  # only rank 0 speaks to systemd
        undurable: set[str] = set()  # entries trained, in no checkpoint on disk yet: pending in Redis, left alone by the reader
        self.cycle = CycleClock()  # where the loop's time goes (learner_node/cycle.py), in the figures of every update
        self.reader = StreamReader(
            cfg, client, self.progress.counters, self.progress.seen, self.stop_event, self.notifier, undurable, self.cycle
        )
        self.checkpointer = Checkpointer(cfg, self.trainer, self.progress, self.sharded, self.is_main, undurable)
        self.reader.between_reads = self._acknowledge_durable
        self.publisher = Publisher(cfg, client, self.lp, context or zmq.Context.instance(), self.sharded, self.is_main)
        self.reporter = Reporter(self.notifier, cfg.tensorboard_dir if self.is_main else "")
        # Work an update left undone when Redis went away after its checkpoint: done before the next rollout.
        self.owed = RedisWork(cfg, client, self.reader, lambda: self.publish(), self.notifier, self.stop_event, self.sharded, self.is_main)

    # --- what the parts hold, by the names the learner's users know ----------------------------
    @property
    def version(self) -> int:
        return self.progress.version

    @version.setter
    def version(self, value: int) -> None:
        self.progress.version = value

    @property
    def updates(self) -> int:
        return self.progress.updates

    @updates.setter
    def updates(self, value: int) -> None:
        self.progress.updates = value

    @property
    def run_id(self) -> str:
        return self.progress.run_id

    @property
    def counters(self) -> collections.Counter[str]:
        return self.progress.counters

    @property
    def seen(self) -> checkpoint.RecentIds:
        return self.progress.seen

    @property
    def policy_opt(self) -> torch.optim.Optimizer:
        return self.trainer.policy_opt

    @property
    def weights_endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def snapshot_server(self) -> SnapshotServer | None:
        return self.publisher.snapshot_server

    # --- start-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Restore the checkpoint (if resuming), then make the consumer group and announce the weights.

        The Redis part is retried until Redis answers (or the learner is stopped).
        """
        if self.cfg.resume:
            self.restore()
        self.owed.unpublished = True  # a restored (or the initial) version is announced at once
        if self.sharded:
            self._publish_sharded()  # every rank gathers; with Redis down, done again before the first update
        self.owed.unreported = self._figures({}, 0)  # and the counters it restored, which the ledger reads
        while not self.stop_event.is_set():
            try:
                if self.is_main:
                    self.reader.ensure_group()
                    self.owed.backlog = self.owed.backlog or self._backlog()
                self.settle()
                return
            except REDIS_DOWN as e:
                self.owed.wait_for_redis(e)

    def restore(self) -> None:
        entries = self.checkpointer.restore()
        # The updates in this checkpoint consumed these entries; the crash may have come before they were acknowledged.
        self.owed.unacked = [(entry_id, None) for entry_id in entries] if self.is_main else []
        self._after_lost_updates()

    def _after_lost_updates(self) -> None:
        """Updates after the restored checkpoint (checkpoints come by cadence) are lost: their entries are pending
        and are trained again. Say so; and where the run had published a later version than the checkpoint's, go on
        numbering after it, so that the actors (which serve that lost version) take the restored weights as the newer
        ones, and versions never go back within a run."""
        try:
            published = weights.latest(self.redis, self.cfg.store.key_prefix)
            reached = int(read_latest(self.redis, self.cfg.store.key_prefix).get("updates", 0))
        except REDIS_DOWN as e:
            log.warning("--resume: Redis unreachable (%s); cannot tell whether updates after the checkpoint were lost", e)
            return
        if reached > self.updates:
            log.warning(
                "--resume: the run had reached update %d; the checkpoint holds %d: the %d updates since are lost, and their"
                " segments (still pending) are trained again",
                reached,
                self.updates,
                reached - self.updates,
            )
        if published is not None and published.run == self.run_id and published.version > self.version:
            self.version = published.version + 1
            log.info("--resume: version %d was published; the restored weights go on as version %d", published.version, self.version)

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        self.cycle.reset()
        # Ready: the stream and consumer group exist, the checkpoint (if resuming) is restored
        # and the current weights are published.
        log.info(
            "learner ready: run %s, policy version %d after %d updates, reading %s as %s/%s",
            self.run_id,
            self.version,
            self.updates,
            self.keys.stream,
            self.cfg.store.consumer_group,
            self.cfg.consumer,
        )
        self.notifier.ready(f"policy version {self.version} after {self.updates} updates")
        while not self.stop_event.is_set():
            if self.cfg.max_updates and self.updates >= self.cfg.max_updates:
                break
            self.notifier.watchdog()
            try:
                if self.is_main:
                    self._acknowledge_durable()
                self.settle()
                self.step()
            except REDIS_DOWN as e:
                self.owed.wait_for_redis(e)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                # Redis came back empty (no persistence) within redis-py's own retries: the group went with it.
                log.error("the consumer group %s is gone from Redis (%s); creating it again", self.cfg.store.consumer_group, e)
                if self.is_main:
                    self.reader.ensure_group()
        self.checkpoint_all()
        self.owed.settle_before_exit()
        self.notifier.stopping(f"stopped at policy version {self.version} after {self.updates} updates")
        self.close()

    def stop(self) -> None:
        self.stop_event.set()

    def step(self) -> dict[str, float] | None:
        """Collect one rollout's segments and train on them; None if stopped before a rollout was complete.

        An update that would make a weight non-finite is undone whole and its transitions dropped (`_discard`): the
        weights, the optimizers and the KL coefficient stay as they were, and nothing is published."""
        with self.cycle.phase(CyclePhase.READ):
            entries, segments = self.reader.collect() if self.is_main else ([], [])
        if self.world > 1:  # rank 0 read the stream; everyone trains on the same segments
            shared = [segments, self.stop_event.is_set(), self.sharded and self.owed.unpublished]
            dist.broadcast_object_list(shared, src=0)
            segments = cast(list[Segment], shared[0])
            if shared[1]:
                self.stop_event.set()
            if shared[2]:  # a sharded publication Redis interrupted: every rank gathers the weights again
                self._publish_sharded()
        if not segments:
            if entries:  # only duplicates or malformed entries: nothing to train, but nothing to keep pending either
                self.owed.unacked = with_samples(entries)
                self.settle()
            return None
        if self.stop_event.is_set():
            # Stopping: an update now would only delay the exit. The segments stay unacknowledged
            # in this consumer's pending list, and a resumed learner trains on them first.
            return None
        started = time.perf_counter()
        with self.cycle.phase(CyclePhase.PREPARE):
            batches = self.trainer.build(segments, self.version, self.stamp())
        intake = batches.intake
        if self.is_main:  # a big model's update takes minutes: say when one starts, and on what
            log.info(
                "update %d: training on %d transitions from %d segments (%d older than the lag bound, dropped)",
                self.updates + 1,
                intake.batched,
                len(segments),
                intake.dropped_stale,
            )
        train_policy = self.updates >= self.cfg.warmup_updates
        with self.cycle.phase(CyclePhase.UPDATE):
            before = self.trainer.snapshot()
        kl_before = self.trainer.kl.value
        try:
            with self.cycle.phase(CyclePhase.PREPARE):
                parts = self.trainer.parts(batches)
            metrics = self.trainer.update(parts, train_policy, self.updates, self.cycle)
        except NonFiniteUpdate as e:
            before.restore()
            self.trainer.kl.value = kl_before
            return self._discard(entries, segments, intake, e)
        self.discarded_in_row = 0
        trained = intake.batched
        if train_policy and trained:
            self.version += 1
        self.updates += 1
        self._count(segments, intake, trained)
        metrics.update(intake.charts(trained, time.perf_counter() - started, self.version))
        self.save_checkpoint(entries)  # when due, by cadence: rank 0, or every rank its shards
        self.owed.unpublished = bool(train_policy and trained)
        metrics.update(self.cycle.figures())
        if self.is_main:
            # The update is done once all of this is in Redis; `settle` retries what a Redis outage interrupted
            # before the next rollout is read, so acknowledgement, weights and counters never fall behind silently.
            self.owed.unacked += with_samples(self.checkpointer.durable())
            self.owed.unreported = self._figures(metrics, trained)
            self.owed.backlog = self._backlog()
            trained_kind = parts[0].batch.prefix if parts else CANDIDATES
            self.reporter.update(metrics, trained, self.updates, self.version, trained_kind)
        if self.sharded and self.owed.unpublished:
            self._publish_sharded()  # before settling, which may raise on rank 0 alone: the gathers must match
        if self.is_main:
            self.settle()
        return metrics

    def _count(self, segments: list[Segment], intake: Intake, trained: int, applied: bool = True) -> None:
        """The checkpointed counters of a rollout read: what was stored, trained and dropped, and why (`applied`:
        the update was kept; a discarded one's segments are remembered, so never read twice, but not trained)."""
        intake.count(self.counters, trained)
        self.counters[LearnerCounter.SEGMENTS_TRAINED] += len(segments) if applied else 0
        for seg in segments:
            self.seen.add(seg.seg_id)

    def _discard(
        self, entries: list[tuple[str, dict]], segments: list[Segment], intake: Intake, error: NonFiniteUpdate
    ) -> dict[str, float]:
        """Leave out an update that was not finite. The caller has put the weights and optimizer states back as
        they were before it; here its transitions are counted as dropped (`dropped_nonfinite`) and its entries
        acknowledged with a checkpoint of those unchanged weights, so it is not read again, and nothing is
        published. `max_discarded_updates` in a row stop the learner with the input that most likely caused them."""
        dropped = intake.batched
        self.discarded_in_row += 1
        self.counters[LearnerCounter.DISCARDED_UPDATES] += 1
        self.counters[LearnerCounter.DROPPED_NONFINITE] += dropped
        self._count(segments, intake, 0, applied=False)
        culprit = likely_culprit(segments)
        log.error(
            "update %d discarded (%d in a row): %s; its %d transitions dropped, the weights kept at policy version %d; %s",
            self.updates + 1,
            self.discarded_in_row,
            error.what,
            dropped,
            self.version,
            culprit,
        )
        discarded = self.counters[LearnerCounter.DISCARDED_UPDATES]
        metrics = {Chart.DROPPED_NONFINITE.key: float(dropped), Chart.DISCARDED_UPDATES.key: float(discarded)}
        # at once, not by cadence: a restart must not meet these entries again (they would be discarded again)
        self.save_checkpoint(entries)
        self.checkpoint_all()
        if self.is_main:
            self.owed.unreported = self._figures(metrics, 0)
            self.reporter.tensorboard(metrics, self.updates)
            self.settle()
        if self.discarded_in_row >= self.cfg.max_discarded_updates:
            raise PoisonedInput(
                f"{self.discarded_in_row} updates in a row were not finite (the last: {error.what}); the weights are "
                f"those of policy version {self.version}, never replaced by a non-finite update. {culprit}"
            )
        return metrics

    # --- persistence and publication -----------------------------------------------------------
    def _acknowledge_durable(self) -> None:
        """Rank 0: the entries of the checkpoints written since the last call are owed an acknowledgement, given now
        (between the updates, and between the reads of a rollout: an idle learner must not sit on them), with the
        checkpoint that came due while the one before was being written begun first."""
        with self.cycle.phase(CyclePhase.CHECKPOINT):
            self.checkpointer.catch_up()
            durable = self.checkpointer.durable()
        if durable:
            self.owed.unacked += with_samples(durable)
            self.settle()

    def settle(self) -> None:
        """The Redis work an update owes (acknowledgements, figures, the weights, the backlog limit) done now
        (learner_node/redis_work.py; rank 0's work, a no-op on the other ranks), as publication in the cycle profile."""
        with self.cycle.phase(CyclePhase.PUBLISH):
            self.owed.settle()

    def _backlog(self) -> int:
        """The backlog limit to publish (`backlog_limit`), again after every update: a Redis that lost its keys gets
        it back."""
        return backlog_limit(self.cfg.rollout_batch, self.cfg.max_policy_lag)

    def checkpoint_all(self) -> None:
        """Every update so far into a checkpoint on disk (the write in progress waited for, what was trained since
        written now), its entries then owed an acknowledgement: before the learner stops (called on every rank)."""
        with self.cycle.phase(CyclePhase.CHECKPOINT):
            durable = self.checkpointer.flush()
        if self.is_main:
            self.owed.unacked += with_samples(durable)

    def save_checkpoint(self, entries: list[tuple[str, dict]]) -> None:
        """Called on every rank after an update: a checkpoint when one is due (learner_node/checkpointer.py), which a
        sharded learner's ranks agree on as rank 0 says."""
        with self.cycle.phase(CyclePhase.CHECKPOINT):
            self.checkpointer.after_update(entries, self._agree)

    def _agree(self, due: bool) -> bool:
        shared = [due]
        dist.broadcast_object_list(shared, src=0)
        return bool(shared[0])

    def stamp(self) -> PolicyStamp:
        """What a transition must have been scored with to be trained on (see PolicyStamp)."""
        spec = self.cfg.policy
        return PolicyStamp(
            run=self.run_id,
            normalisation=spec.normalisation,
            temperature=spec.temperature,
            lora_rank=spec.lora_rank,
            greedy=False,
            path=self.lp.path,
        )

    def publish(self) -> None:
        """Store the current weights in chunks, then announce them (learner_node/publisher.py)."""
        self.publisher.publish(self.version, self.run_id)

    def _publish_sharded(self) -> None:
        """`publish` on every rank of a sharded learner, in step. A Redis failure on rank 0 does not leave the
        others waiting: its gathers are finished, the version stays unpublished, and `step` has every rank
        publish it again before the next update (rank 0 says so with the rollout it shares)."""
        try:
            with self.cycle.phase(CyclePhase.PUBLISH):
                self.publish()
            self.owed.unpublished = False
        except (*REDIS_DOWN, redis.ResponseError, OSError) as e:  # also a full Redis (OOM) or weights_dir (ENOSPC, EROFS)
            log.error("policy version %d not published (%s): every rank gathers it again before the next update", self.version, e)

    def _figures(self, metrics: dict[str, float], n: int) -> dict[str, float]:
        return latest_figures(metrics, n, self.updates, self.version, self.counters)

    def close(self) -> None:
        self.reporter.close()
        self.publisher.close()
        if self.owns_process_group and dist.is_initialized():
            # Gloo's worker threads still running when the interpreter exits abort the process
            # ("terminate called without an active exception", seen on a loaded machine); torch asks
            # every process to end its group before it exits.
            dist.destroy_process_group()


class PoisonedInput(RuntimeError):
    """Updates keep coming out non-finite: the learner stops rather than train on what it is fed."""


def likely_culprit(segments: list[Segment]) -> str:
    """The input that most likely made an update non-finite: the reward of the largest magnitude in the batch."""
    worst: tuple[float, str] | None = None
    for seg in segments:
        for t in seg.transitions:
            size = abs(t.reward) if math.isfinite(t.reward) else math.inf
            if worst is None or size > worst[0]:
                worst = (size, f"reward {t.reward:g} of task {seg.task_id!r} (segment {seg.seg_id})")
    if worst is None:
        return "the batch held no transitions"
    if worst[0] > DEFAULT_MAX_ABS_REWARD:
        return (
            f"likely input: {worst[1]}, beyond the default bound rewards are checked against where they enter "
            f"(max_abs_reward, {DEFAULT_MAX_ABS_REWARD:g})"
        )
    return (
        f"no reward of the batch is out of the ordinary (the largest: {worst[1]}); look at the learning rate, the "
        "model's dtype and the behaviour log-probabilities the actors sent"
    )
