"""The learner process: segments from the Redis stream -> PPO update -> checkpoint -> ack -> publish.

The data path of one update, in order, and why the order matters:

1. read segments through the consumer group (own pending entries first after a
   restart, then entries a dead learner left pending, then new ones) until
   `rollout_batch` transitions are in hand; segment ids already trained are skipped;
2. build the rollout (GAE, staleness filter) and run the PPO update;
3. checkpoint, atomically, with the stream entries the update consumed;
4. acknowledge (XACK) and delete those entries: only now, so a crash at any
   earlier point leaves them pending and they are trained again from the
   previous checkpoint's weights, never twice and never lost;
5. store the new weights in Redis, then announce them on PUB.

Several processes (`accelerate launch --num_processes N -m ppoz.cli learner ...`,
one per GPU): rank 0 alone reads the stream, checkpoints, acknowledges and
publishes; it broadcasts each rollout's segments to the other ranks, every rank
runs the same update on its share of each minibatch (learner_node/update.py),
and gradients are averaged across ranks before each optimizer step.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any, cast

import redis
import torch
import torch.distributed as dist
import zmq

from common import weights
from common.learner_figures import CANDIDATES, COUNTER_PREFIX, update_figure, write_latest
from common.protocol import DEFAULT_MAX_ABS_REWARD
from common.sd_notify import Notifier
from common.security import AllowList, apply_server
from common.segments import Segment, acknowledge, ensure_group, entry_samples
from common.shared_settings import PolicyStamp
from common.snapshot_serve import SnapshotServer
from common.zmqio import bound
from learner_node import checkpoint, sharded_load, sharding
from learner_node.config import FSDP_FROM_PARAMETERS, LearnerConfig
from learner_node.core_algos import AdaptiveKLController
from learner_node.generation import GenerationBatch, build_generation_batch, check_layout, generation_update, split_by_mode
from learner_node.optim import adam
from learner_node.policy import LearnerPolicy
from learner_node.rollout import EpisodeReturns, Rollout, build_rollout, candidate_update
from learner_node.update import NonFiniteUpdate, TrainableSnapshot
from models import scoring
from models.policy_model import ModelSpec, load_policy, load_policy_state_dict, policy_state_dict, policy_state_items

log = logging.getLogger(__name__)

TOKEN_HEAD = "token."  # the token value head's tensors in a checkpoint's value_head.safetensors

RECENT_SEGMENTS = 100_000  # segment ids remembered to drop duplicates
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # redis-py's own retries gave up: Redis is down or restarting
REDIS_BACKOFF_FIRST_S = 0.1
REDIS_BACKOFF_CAP_S = 5.0
UNSCORABLE_LOG_INTERVAL_S = 60.0  # at most one log line this often about next observations the model cannot score


def backlog_limit(rollout_batch: int, max_policy_lag: int, transitions_per_segment: float) -> int:
    """The stream backlog (closed segments) this learner can train within its policy-lag bound.

    Each update consumes about `rollout_batch` transitions and moves the policy one version, so a
    transition that waits behind B transitions is trained about B / rollout_batch versions after
    it was scored. Holding the backlog to half the lag bound's worth keeps the lag of what the
    actors produce while the learner trains (one more rollout) within the bound, whatever the
    learner's pace: a slow learner makes the actors wait instead of making the data stale. Never
    less than two rollouts, or actors and learner could wait on each other.
    """
    per_segment = max(1.0, transitions_per_segment)
    versions = max(1, max_policy_lag // 2)
    return max(math.ceil(2 * rollout_batch / per_segment), math.ceil(versions * rollout_batch / per_segment))


class Learner:
    def __init__(self, cfg: LearnerConfig, client: redis.Redis, context: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.redis = client
        # one store for the run: a directory store prepares the next publication's files after each one
        self.snapshots = weights.snapshot_store(client, cfg.store.key_prefix, cfg.store.weights_dir)
        self.keys = cfg.store.keys
        self.stream = self.keys.stream
        device = cfg.device
        self.owns_process_group = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized()):
            from accelerate import Accelerator  # sets up the process group `accelerate launch` describes

            accelerator = Accelerator(cpu=cfg.device == "cpu")
            device = str(accelerator.device)
            self.owns_process_group = True
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
        spec = ModelSpec.of(cfg.policy, device)
        self.sharded = self.world > 1 and self._parallelism(spec) == "fsdp"
        # Sharded before the optimizers (which must hold the sharded parameters): a model loaded in 16 bits (bf16 on
        # a GPU by default) computes in them with float32 master weights. In eval mode, and it stays so: no dropout.
        model, tokenizer, frozen, checked = self._load(spec, mixed=spec.resolved_dtype() != torch.float32)
        # The learner checks its scoring path as the actor does: every path it may use computes the model's own log-probabilities.
        path = scoring.select_path(checked, cfg.policy.scoring_path)
        layout = check_layout(checked, cfg.generation.micro_batch_tokens)  # and so does the generation path
        self.lp = LearnerPolicy(
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
        self._published_names: dict[str, str] = sharding.policy_names(self.lp.model) if self.sharded else {}
        policy_lr = cfg.resolved_policy_lr()
        log.info("policy learning rate %g%s", policy_lr, "" if cfg.policy_lr else " (by the model: [learner] policy_lr = 0)")
        self.policy_opt = adam(self.lp.trainable_parameters(), policy_lr)
        self.value_opt = adam(self.lp.value_head.parameters(), cfg.value_lr)
        self.token_value_opt = adam(self.lp.token_value_head.parameters(), cfg.value_lr)
        self.kl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target or None)
        self.version = 0
        # This run's id: announced with every snapshot and stamped on every choice made with its weights,
        # so versions are compared within a run. New on a fresh start, restored by --resume.
        self.run_id = uuid.uuid4().hex[:12]
        if self.world > 1:
            shared_run = [self.run_id]
            dist.broadcast_object_list(shared_run, src=0)
            self.run_id = shared_run[0]
        self.updates = 0
        self.discarded_in_row = 0  # updates left out in a row because they were not finite (see _discard)
        self.seen = checkpoint.RecentIds(RECENT_SEGMENTS)
        self.counters: collections.Counter[str] = collections.Counter()
        self.episodes = EpisodeReturns()  # returns of episodes that span segments and rollouts (not checkpointed)
        self._largest_segment: int | None = None  # transitions in the largest segment read so far (see _entries_for)
        self.stop_event = threading.Event()
        self.ctx = context or zmq.Context.instance()
        self.pub: zmq.Socket | None = None
        self.allow_list: AllowList | None = None  # CURVE: which actors may subscribe
        self.weights_endpoint = ""
        self.snapshot_server: SnapshotServer | None = None
        if self.is_main:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            if cfg.curve_secret_key:  # before bind, as every CURVE server socket
                self.allow_list = apply_server(self.pub, cfg.curve_secret_key, cfg.curve_allowed_actors, "learner weights")
            self.pub.bind(cfg.weights_bind)
            self.weights_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if cfg.weights_serve:  # actors on other hosts fetch the chunks from here (common/snapshot_serve.py)
                keys = (cfg.curve_secret_key, cfg.curve_allowed_actors)
                self.snapshot_server = SnapshotServer(self.snapshots, cfg.weights_serve, self.ctx, *keys)
        self.notifier = Notifier() if self.is_main else Notifier({})  # only rank 0 speaks to systemd
        self.writer = None
        if cfg.tensorboard_dir and self.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(cfg.tensorboard_dir)
        self._features: dict[int, torch.Tensor] = {}
        self._unscorable_reason = ""  # why the critic could not score the last observation it could not (`_values`)
        self._unscorable_unlogged = 0  # next observations left unscored since the last log line about them
        self._unscorable_logged_at = -math.inf
        # Read positions of the rollout being collected (`collect`): own pending entries, then claimed ones.
        self._own_cursor: str | None = "0"
        self._claim_cursor: str | None = "0-0"
        # Work an update left undone when Redis went away after its checkpoint: done before the next rollout.
        # (entry id, its sample ids; None: not known, read from the stream when acknowledged: a resumed learner's)
        self._unacked: list[tuple[str, list[str] | None]] = []
        self._unpublished = False
        self._unreported: dict[str, float] = {}  # the last update's figures and counters (common/learner_figures.py)
        self._backlog = 0  # the backlog limit to publish for the broker (0: nothing new)

    # --- start-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Restore the checkpoint (if resuming), then make the consumer group and announce the weights.

        The Redis part is retried until Redis answers (or the learner is stopped).
        """
        if self.cfg.resume:
            self.restore()
        self._unpublished = True  # a restored (or the initial) version is announced at once
        if self.sharded:
            self._publish_sharded()  # every rank gathers; with Redis down, done again before the first update
        self._unreported = self._figures({}, 0)  # and the counters it restored, which the ledger reads
        while not self.stop_event.is_set():
            try:
                if self.is_main:
                    self._ensure_group()
                self._settle()
                return
            except REDIS_DOWN as e:
                self._wait_for_redis(e)

    def _ensure_group(self) -> None:
        ensure_group(self.redis, self.keys, self.cfg.store.consumer_group)

    def restore(self) -> None:
        path = checkpoint.latest(self.cfg.checkpoint_dir)
        if path is None:
            log.info("--resume: no checkpoint in %s, starting fresh", self.cfg.checkpoint_dir)
            return
        tensors, value_head, optimizers, state = checkpoint.load(path)
        if checkpoint.is_sharded(path):  # written by a sharded learner: read by any number of ranks, this one included
            sharding.load_sharded(path / checkpoint.SHARDED, self._train_states())
        elif self.sharded:
            raise ValueError(
                f"{path} holds whole weights (written with parallelism ddp or by one rank); this learner shards them "
                "(parallelism fsdp): resume it once with --parallelism ddp, whose next checkpoint fsdp cannot read either, "
                "or start fresh; a sharded checkpoint resumes on any number of ranks either way"
            )
        else:
            device = next(self.lp.model.parameters()).device
            load_policy_state_dict(self.lp.model, {k: v.to(device) for k, v in tensors.items()})
            token_head = {k[len(TOKEN_HEAD) :]: v for k, v in value_head.items() if k.startswith(TOKEN_HEAD)}
            self.lp.value_head.load_state_dict({k: v for k, v in value_head.items() if not k.startswith(TOKEN_HEAD)})
            if token_head:  # checkpoints from before generation have none: the token head starts fresh
                self.lp.token_value_head.load_state_dict(token_head)
                self.token_value_opt.load_state_dict(optimizers["token_value"])
            self.policy_opt.load_state_dict(optimizers["policy"])
            self.value_opt.load_state_dict(optimizers["value"])
        self.version, self.updates, self.kl.value = state["version"], state["updates"], state["kl_coef"]
        self.run_id = state.get("run_id") or self.run_id  # a checkpoint from before run ids: a new one
        self.counters.update(state["counters"])
        for seg_id in state["recent_segments"]:
            self.seen.add(seg_id)
        # The update in this checkpoint consumed these entries; the crash may have come before they were acknowledged.
        self._unacked = [(entry_id, None) for entry_id in state["last_entries"]] if self.is_main else []
        log.info("resumed from %s: policy version %d after %d updates", path, self.version, self.updates)

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.start()
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
                self._settle()
                self.step()
            except REDIS_DOWN as e:
                self._wait_for_redis(e)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                # Redis came back empty (no persistence) within redis-py's own retries: the group went with it.
                log.error("the consumer group %s is gone from Redis (%s); creating it again", self.cfg.store.consumer_group, e)
                if self.is_main:
                    self._ensure_group()
        self._settle_before_exit()
        self.notifier.stopping(f"stopped at policy version {self.version} after {self.updates} updates")
        self.close()

    def stop(self) -> None:
        self.stop_event.set()

    def _settle_before_exit(self) -> None:
        """The last update's Redis work before the loop ends: waited for after `max_updates`;
        tried once when stopped (then a learner resumed from the checkpoint finishes it)."""
        while True:
            try:
                self._settle()
                return
            except REDIS_DOWN as e:
                if self.stop_event.is_set():
                    log.error(
                        "Redis unreachable while stopping (%s): the last update's acknowledgement, weights or figures "
                        "are left to a learner resumed from the checkpoint (--resume)",
                        e,
                    )
                    return
                self._wait_for_redis(e)

    def step(self) -> dict[str, float] | None:
        """Collect one rollout's segments and train on them; None if stopped before a rollout was complete.

        An update that would make a weight non-finite is undone whole and its transitions dropped (`_discard`): the
        weights, the optimizers and the KL coefficient stay as they were, and nothing is published."""
        entries, segments = self.collect() if self.is_main else ([], [])
        if self.world > 1:  # rank 0 read the stream; everyone trains on the same segments
            shared = [segments, self.stop_event.is_set(), self.sharded and self._unpublished]
            dist.broadcast_object_list(shared, src=0)
            segments = cast(list[Segment], shared[0])
            if shared[1]:
                self.stop_event.set()
            if shared[2]:  # a sharded publication Redis interrupted: every rank gathers the weights again
                self._publish_sharded()
        if not segments:
            if entries:  # only duplicates or malformed entries: nothing to train, but nothing to keep pending either
                self._unacked = _with_samples(entries)
                self._settle()
            return None
        if self.stop_event.is_set():
            # Stopping: an update now would only delay the exit. The segments stay unacknowledged
            # in this consumer's pending list, and a resumed learner trains on them first.
            return None
        started = time.perf_counter()
        scoring_segments, generate_segments = split_by_mode(segments)
        rollout = build_rollout(
            scoring_segments,
            self._values,
            self.cfg.gamma,
            self.cfg.gae_lambda,
            self.version,
            self.cfg.max_policy_lag,
            self.episodes,
            self.stamp(),
        )
        generated = build_generation_batch(
            generate_segments,
            self.version,
            self.cfg.max_policy_lag,
            self.episodes,
            self.stamp(),
            self.lp.vocab_size,
            self.lp.position_limit,
        )
        self._log_unscorable(rollout, generated)
        if self.is_main:  # a big model's update takes minutes: say when one starts, and on what
            log.info(
                "update %d: training on %d transitions from %d segments (%d older than the lag bound, dropped)",
                self.updates + 1,
                len(rollout) + len(generated),
                len(segments),
                rollout.dropped_stale + generated.dropped_stale,
            )
        train_policy = self.updates >= self.cfg.warmup_updates
        before = TrainableSnapshot.of([self.policy_opt, self.value_opt, self.token_value_opt])
        kl_before = self.kl.value
        try:
            metrics = self._update(rollout, generated, train_policy)
        except NonFiniteUpdate as e:
            before.restore()
            self.kl.value = kl_before
            return self._discard(entries, segments, rollout, generated, e)
        self.discarded_in_row = 0
        trained = len(rollout) + len(generated)
        if train_policy and trained:
            self.version += 1
        self.updates += 1
        self._count(segments, rollout, generated, trained)
        elapsed = time.perf_counter() - started
        lag = rollout.lags + generated.lags or [0]
        returns = rollout.episodic_returns + generated.episodic_returns
        metrics.update(
            {
                "charts/episodic_return": sum(returns) / len(returns) if returns else math.nan,
                "charts/episodes": len(returns),
                "charts/policy_lag": sum(lag) / len(lag),
                "charts/SPS": trained / elapsed if elapsed > 0 else 0.0,
                "charts/policy_version": self.version,
                "charts/dropped_stale": rollout.dropped_stale + generated.dropped_stale,
                "charts/dropped_truncated": rollout.dropped_truncated + generated.dropped_truncated,
                "charts/dropped_unscorable_next_obs": rollout.dropped_unscorable_next_obs + generated.dropped_unscorable_next_obs,
                "charts/dropped_mismatched": rollout.dropped_mismatched + generated.dropped_mismatched,
            }
        )
        self.save_checkpoint([entry_id for entry_id, _ in entries])  # rank 0, or every rank its shards
        self._unpublished = bool(train_policy and trained)
        if self.is_main:
            # The update is done once all of this is in Redis; `_settle` retries what a Redis outage interrupted
            # before the next rollout is read, so acknowledgement, weights and counters never fall behind silently.
            self._unacked = _with_samples(entries)
            self._unreported = self._figures(metrics, trained)
            self._backlog = backlog_limit(
                self.cfg.rollout_batch, self.cfg.max_policy_lag, (rollout.stored + generated.stored) / len(segments)
            )
            self._log(metrics, trained)
        if self.sharded and self._unpublished:
            self._publish_sharded()  # before _settle, which may raise on rank 0 alone: the gathers must match
        if self.is_main:
            self._settle()
        return metrics

    def _update(self, rollout: Rollout, generated: GenerationBatch, train_policy: bool) -> dict[str, float]:
        """The PPO update on this rollout's two kinds of transition; raises NonFiniteUpdate before anything
        non-finite is applied (the caller undoes what earlier steps of it applied)."""
        metrics: dict[str, float] = {}
        if len(rollout):
            features = torch.stack([self._features[id(o)] for o in rollout.obs])  # the frozen base: no second forward
            metrics = candidate_update(
                self.lp, self.policy_opt, self.value_opt, rollout, self.cfg, train_policy, self.kl.value, features, self.updates
            )
            kl_ref = metrics.get(f"{CANDIDATES}/kl_ref", math.nan)
            if train_policy and not math.isnan(kl_ref):
                self.kl.update(kl_ref, len(rollout))
        if len(generated):  # a loss of its own: candidate and token-level objectives are never mixed in one loss
            metrics.update(
                generation_update(
                    self.lp, self.policy_opt, self.token_value_opt, generated, self.cfg, self.cfg.generation, train_policy, self.updates
                )
            )
        return metrics

    def _count(self, segments: list[Segment], rollout: Rollout, generated: GenerationBatch, trained: int, applied: bool = True) -> None:
        """The checkpointed counters of a rollout read: what was stored, trained and dropped, and why (`applied`:
        the update was kept; a discarded one's segments are remembered, so never read twice, but not trained)."""
        for kind in (rollout, generated):
            self.counters["transitions_stored"] += kind.stored
            self.counters["dropped_stale"] += kind.dropped_stale
            self.counters["dropped_truncated"] += kind.dropped_truncated
            self.counters["dropped_unscorable_next_obs"] += kind.dropped_unscorable_next_obs  # of dropped_truncated
            self.counters["dropped_mismatched"] += kind.dropped_mismatched
            for reason, count in kind.mismatched.items():
                self.counters[f"mismatched_{reason}"] += count
        self.counters["transitions_trained"] += trained
        self.counters["segments_trained"] += len(segments) if applied else 0
        for seg in segments:
            self.seen.add(seg.seg_id)

    def _discard(
        self,
        entries: list[tuple[str, dict]],
        segments: list[Segment],
        rollout: Rollout,
        generated: GenerationBatch,
        error: NonFiniteUpdate,
    ) -> dict[str, float]:
        """Leave out an update that was not finite. The caller has put the weights and optimizer states back as
        they were before it; here its transitions are counted as dropped (`dropped_nonfinite`) and its entries
        acknowledged with a checkpoint of those unchanged weights, so it is not read again, and nothing is
        published. `max_discarded_updates` in a row stop the learner with the input that most likely caused them."""
        dropped = len(rollout) + len(generated)
        self.discarded_in_row += 1
        self.counters["discarded_updates"] += 1
        self.counters["dropped_nonfinite"] += dropped
        self._count(segments, rollout, generated, 0, applied=False)
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
        metrics = {"charts/dropped_nonfinite": float(dropped), "charts/discarded_updates": float(self.counters["discarded_updates"])}
        self.save_checkpoint([entry_id for entry_id, _ in entries])  # rank 0, or every rank its shards
        if self.is_main:
            self._unacked = _with_samples(entries)
            self._unreported = self._figures(metrics, 0)
            if self.writer is not None:
                for key, value in metrics.items():
                    self.writer.add_scalar(key, value, self.updates)
                self.writer.flush()
            self._settle()
        if self.discarded_in_row >= self.cfg.max_discarded_updates:
            raise PoisonedInput(
                f"{self.discarded_in_row} updates in a row were not finite (the last: {error.what}); the weights are "
                f"those of policy version {self.version}, never replaced by a non-finite update. {culprit}"
            )
        return metrics

    def collect(self) -> tuple[list[tuple[str, dict]], list[Segment]]:
        """Stream entries until `rollout_batch` transitions are in hand (or the learner is stopped).

        Every rollout reads, in this order: this consumer's own pending entries (a rollout read
        before a restart or a Redis outage, or entries delivered by a read whose reply was lost
        and which redis-py retried), entries a dead consumer left pending for `claim_idle_ms`,
        then new entries. Each source is read with a cursor, and an entry id is taken at most
        once per rollout: a pending entry is never trained twice, nor counted twice as stored.
        """
        entries: list[tuple[str, dict]] = []
        rollout: list[Segment] = []
        taken: set[str] = set()
        transitions = 0
        self._own_cursor, self._claim_cursor = "0", "0-0"
        give_up = time.monotonic() + self.cfg.rollout_timeout_s if self.cfg.rollout_timeout_s else math.inf
        while transitions < self.cfg.rollout_batch and not self.stop_event.is_set():
            self.notifier.watchdog()  # waiting for data is not hanging
            if rollout and time.monotonic() > give_up:
                log.info("rollout timeout: training on %d transitions", transitions)
                break
            for entry_id, fields in self._read(self._entries_for(self.cfg.rollout_batch - transitions)):
                if entry_id in taken:
                    continue
                taken.add(entry_id)
                entries.append((entry_id, fields))
                try:
                    seg = Segment.from_entry(fields)
                except ValueError as e:  # a malformed entry must not stop training; it is acknowledged with the batch
                    log.error("stream entry %s is not a segment (%s); skipping it", entry_id, e)
                    self.counters["malformed_segments"] += 1
                    continue
                if seg.seg_id in self.seen:
                    self.counters["duplicate_segments"] += 1
                    continue
                rollout.append(seg)
                transitions += len(seg.transitions)
                self._largest_segment = max(self._largest_segment or 0, len(seg.transitions))
        return entries, rollout

    def _entries_for(self, transitions: int) -> int:
        """How many stream entries to ask for when `transitions` more are wanted.

        `rollout_batch` counts transitions but XREADGROUP's COUNT counts entries (segments of up to
        the broker's segment_len). Asking for as many entries as transitions made an update of 40
        hold 596 transitions; asking for transitions // (largest segment seen) keeps an update
        within one segment of rollout_batch (one entry at a time until a segment has been seen).
        """
        if self._largest_segment is None:
            return 1
        return max(1, transitions // self._largest_segment)

    def _read(self, want: int) -> list[tuple[str, dict]]:
        """The next entries of this rollout: own pending, then claimed, then new (see `collect`)."""
        group, me, count = self.cfg.store.consumer_group, self.cfg.consumer, max(want, 1)
        if self._own_cursor is not None:
            got = self.redis.xreadgroup(group, me, {self.stream: self._own_cursor}, count=count)
            own = got[0][1] if got else []
            if own:
                self._own_cursor = _text(own[-1][0])  # pending entries after this one next time
                return self._present(own)
            self._own_cursor = None
        if self._claim_cursor is not None:
            cursor, claimed = self.redis.xautoclaim(
                self.stream, group, me, min_idle_time=self.cfg.claim_idle_ms, start_id=self._claim_cursor, count=count
            )[:2]
            self._claim_cursor = None if _text(cursor) == "0-0" else _text(cursor)
            claimed = [(i, f) for i, f in claimed if i is not None]  # Redis 6.2 lists entries deleted meanwhile as nil
            if claimed:
                log.info("took over %d segments left pending by another consumer", len(claimed))
                return self._present(claimed)
            if self._claim_cursor is not None:
                return []
        got = self.redis.xreadgroup(group, me, {self.stream: ">"}, count=count, block=self.cfg.read_block_ms)
        return self._present(got[0][1]) if got else []

    def _present(self, entries: list[tuple[bytes, dict | None]]) -> list[tuple[str, dict]]:
        """Entries that still have their fields; pending ones deleted from the stream are acknowledged (nothing to train)."""
        gone = [_text(i) for i, f in entries if not f]
        if gone:
            log.warning("%d pending stream entries are no longer in the stream (trimmed or deleted); acknowledging them", len(gone))
            self.counters["vanished_segments"] += len(gone)
            self.redis.xack(self.stream, self.cfg.store.consumer_group, *gone)
        return [(_text(i), f) for i, f in entries if f]

    def _settle(self) -> None:
        """Finish the last update's Redis work, if not done yet: acknowledge and delete the entries its
        checkpoint consumed, store and announce its weights, publish its figures and counters.

        Each is idempotent (XACK/XDEL of an entry already gone, a snapshot or a hash written
        twice), so after a Redis failure it is simply done again; a failure raises to `run`,
        which waits for Redis and calls this again before reading anything new.
        """
        if not self.is_main:
            return
        if self._unacked:
            self._ack(self._unacked)
            self._unacked = []
        if self._unpublished and not self.sharded:  # sharded: every rank gathers (`_publish_sharded`)
            self.publish()
            self._unpublished = False
        if self._unreported:
            write_latest(self.redis, self.cfg.store.key_prefix, self._unreported)
            self._unreported = {}
        if self._backlog:
            self.redis.set(self.keys.learner_backlog, self._backlog)
            self._backlog = 0

    def _wait_for_redis(self, error: Exception) -> None:
        """Redis went away (restart, network): wait for it with capped exponential back-off, then resume.

        The rollout being read is dropped from memory; its entries stay in this consumer's
        pending list in Redis and are read again first, so nothing is lost or trained twice.
        """
        down_since = time.monotonic()
        delay = REDIS_BACKOFF_FIRST_S
        log.error("Redis unreachable (%s): pausing, retrying with back-off up to %.0f s", error, REDIS_BACKOFF_CAP_S)
        self.notifier.status(f"Redis unreachable: {error}", min_interval_s=0)
        while not self.stop_event.wait(delay):
            self.notifier.watchdog()  # waiting for Redis is not hanging
            try:
                self.redis.ping()
                if self.is_main:
                    self._ensure_group()  # a Redis restarted without persistence has lost it
                break
            except REDIS_DOWN as e:
                delay = min(delay * 2, REDIS_BACKOFF_CAP_S)
                log.warning("Redis still unreachable after %.1f s (%s); next try in %.1f s", time.monotonic() - down_since, e, delay)
        else:
            return
        log.warning("Redis is back after %.1f s; re-reading this learner's pending segments", time.monotonic() - down_since)

    def _ack(self, unacked: list[tuple[str, list[str] | None]]) -> None:
        """Acknowledge and delete the entries (not needed again; the stream stays small), and count each of their
        samples once in the ledger's `P:learner:samples`, in the same atomic script (common/segments.py). Sample
        ids not known (None: entries a resumed learner's checkpoint names) are read from the stream first."""
        unknown = [entry_id for entry_id, samples in unacked if samples is None]
        if unknown:
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in unknown:
                pipe.xrange(self.stream, entry_id, entry_id)
            read = {i: entry_samples(got[0][1] if got else None) for i, got in zip(unknown, pipe.execute())}
            unacked = [(entry_id, read[entry_id] if samples is None else samples) for entry_id, samples in unacked]
        if unacked:
            acknowledge(self.redis, self.keys, self.cfg.store.consumer_group, [(i, s or []) for i, s in unacked])

    def _values(self, observations: list[dict[str, Any]]) -> list[float | None]:
        """Critic values for GAE, None for an observation the model cannot score (`LearnerPolicy.tokenize_checked`:
        a client's next_obs that tokenizes to nothing or runs past the model's positions), which is never fed to
        it; the features are kept (by observation object) for the update's critic epochs."""
        items: list[scoring.Tokenized] = []
        scored: list[int] = []
        for i, obs in enumerate(observations):
            try:
                items.append(self.lp.tokenize_checked(obs))
            except scoring.ScoringError as e:
                self._unscorable_reason = str(e)
                continue
            scored.append(i)
        out: list[float | None] = [None] * len(observations)
        self._features = {}
        if items:
            features, values = self.lp.values_of(items)
            for i, f, v in zip(scored, features, values.cpu().tolist(), strict=True):
                self._features[id(observations[i])] = f
                out[i] = v
        return out

    def _log_unscorable(self, rollout: Rollout, generated: GenerationBatch) -> None:
        """One warning, at most every UNSCORABLE_LOG_INTERVAL_S, about the next observations left unscored since the
        last: a client can send one with every feedback, and a line per segment would flood the log. Rank 0 alone
        logs it (every rank builds the same rollout)."""
        if not self.is_main:
            return
        self._unscorable_unlogged += rollout.dropped_unscorable_next_obs + generated.dropped_unscorable_next_obs
        now = time.monotonic()
        if not self._unscorable_unlogged or now - self._unscorable_logged_at < UNSCORABLE_LOG_INTERVAL_S:
            return
        reason = generated.unscorable_reason if generated.dropped_unscorable_next_obs else self._unscorable_reason
        log.warning(
            "%d segments' next observations could not be scored (the last: %s); each was trained as truncated with no "
            "successor, its last transition dropped (counters dropped_unscorable_next_obs and dropped_truncated)",
            self._unscorable_unlogged,
            reason,
        )
        self._unscorable_unlogged, self._unscorable_logged_at = 0, now

    # --- persistence and publication -----------------------------------------------------------
    def save_checkpoint(self, entry_ids: list[str]) -> None:
        """Called on every rank: rank 0 writes the checkpoint; a sharded learner's ranks each write their shards
        into the folder rank 0 made (a DCP checkpoint, `sharded/`), and rank 0 then adds the rest and renames it."""
        index = self.updates + self.counters["discarded_updates"]
        if self.sharded:
            staging = checkpoint.staging(self.cfg.checkpoint_dir, index, create=self.is_main)
            dist.barrier()  # the folder exists before anyone writes into it
            sharding.save_sharded(staging / checkpoint.SHARDED, self._train_states())
            dist.barrier()  # every shard is written before rank 0 renames the folder
        if not self.is_main:
            return
        state = {
            "run_id": self.run_id,
            "version": self.version,
            "updates": self.updates,
            "kl_coef": self.kl.value,
            "counters": dict(self.counters),
            "last_entries": entry_ids,
            "config": asdict(self.cfg),
        }
        checkpoint.save(
            self.cfg.checkpoint_dir,
            # Every save a new, larger index, a discarded update's too (it applies nothing, so `updates` stays): a
            # save under the latest one's name would first delete it, and a crash between that and the rename
            # would make the checkpoint before it the latest, while the entries of the update it held are acknowledged.
            index,
            None if self.sharded else policy_state_dict(self.lp.model),
            None if self.sharded else self._value_heads_state(),
            {}
            if self.sharded
            else {
                "policy": self.policy_opt.state_dict(),
                "value": self.value_opt.state_dict(),
                "token_value": self.token_value_opt.state_dict(),
            },
            state,
            self.cfg.keep_checkpoints,
            None if self.sharded else self.lp.model,  # an adapter export (`adapter/`) needs whole weights
            self.seen,
        )

    def _value_heads_state(self) -> dict[str, torch.Tensor]:
        return {**self.lp.value_head.state_dict(), **{TOKEN_HEAD + k: v for k, v in self.lp.token_value_head.state_dict().items()}}

    def _train_states(self) -> dict[str, sharding.TrainState]:
        """What a sharded checkpoint holds: each model with its optimizer (learner_node/sharding.py)."""
        return {
            "policy": sharding.TrainState(self.lp.model, self.policy_opt),
            "value": sharding.TrainState(self.lp.value_head, self.value_opt),
            "token_value": sharding.TrainState(self.lp.token_value_head, self.token_value_opt),
        }

    def _load(self, spec: ModelSpec, mixed: bool) -> tuple[Any, Any, Any, Any]:
        """(policy, tokenizer, the reference copy of a full fine-tune or None, the model the path checks run on).
        Sharded: read straight into each rank's shards where the model is a local safetensors folder (no rank holds
        it whole; the checks run on a two-layer model of its architecture), else loaded whole and then sharded."""
        if self.sharded and sharded_load.loads_sharded(spec):
            model, tokenizer = sharded_load.load_sharded_policy(spec, mixed)
            frozen = sharded_load.load_sharded_policy(spec, mixed, trained=False)[0] if spec.lora_rank == 0 else None
            return model, tokenizer, frozen, sharded_load.probe_model(spec)
        model, tokenizer = load_policy(spec)
        if not self.sharded:
            return model, tokenizer, None, model
        log.info("%s is no local safetensors folder: each rank loads it whole, then shards it", spec.model)
        frozen = copy.deepcopy(model) if spec.lora_rank == 0 else None
        if frozen is not None:
            frozen.requires_grad_(False)
            sharding.shard(frozen, mixed)
        sharding.shard(model, mixed)
        return model, tokenizer, frozen, model

    def _parallelism(self, spec: ModelSpec) -> str:
        """[learner] parallelism, `auto` resolved by the model's size (FSDP_FROM_PARAMETERS); logged by rank 0."""
        chosen = self.cfg.parallelism
        if chosen == "auto":
            # Trained parameters: a LoRA adapter's ranks hold little beside the frozen base, which ddp keeps whole.
            # A run resumed from whole weights stays ddp (a sharded learner cannot read them).
            trained = sharded_load.parameter_count(spec) if self.cfg.policy.lora_rank == 0 else 0
            ckpt = checkpoint.latest(self.cfg.checkpoint_dir) if self.cfg.resume else None
            resumes_whole = ckpt is not None and not checkpoint.is_sharded(ckpt)
            chosen = "fsdp" if trained >= FSDP_FROM_PARAMETERS and not resumes_whole else "ddp"
        if self.is_main:
            why = " (auto, by the model's size)" if self.cfg.parallelism == "auto" else ""
            log.info("%d ranks, parallelism %s%s", self.world, chosen, why)
        return chosen

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
        """Store the current weights in chunks, then announce them (PUB never holds the only copy).

        The tensors are taken one at a time, so rank 0 never holds a second copy of the model."""
        if not self.sharded:
            if not self.is_main:
                return
            tensors = policy_state_items(self.lp.model, tied_once=True)
        else:  # every rank takes part in each tensor's all-gather; rank 0 alone gets the tensors and stores them
            tensors = sharding.full_state_chunks(self.lp.model, self._published_names)
            if not self.is_main:
                collections.deque(tensors, maxlen=0)  # every gather, nothing kept
                return
        store = self.cfg.store
        kind = "lora" if self.lp.has_adapter else "full"
        try:
            ann = weights.store_snapshot(
                self.redis,
                store.key_prefix,
                self.version,
                tensors,
                kind,
                self.run_id,
                self.snapshots,
                keep=store.weights_kept,
            )
        finally:
            if self.sharded:  # a store that failed half-way: the other ranks still wait in the gathers left
                collections.deque(tensors, maxlen=0)
        weights.announce(bound(self.pub, "the weights publisher"), ann)

    def _publish_sharded(self) -> None:
        """`publish` on every rank of a sharded learner, in step. A Redis failure on rank 0 does not leave the
        others waiting: its gathers are finished, the version stays unpublished, and `step` has every rank
        publish it again before the next update (rank 0 says so with the rollout it shares)."""
        try:
            self.publish()
            self._unpublished = False
        except (*REDIS_DOWN, redis.ResponseError, OSError) as e:  # also a full Redis (OOM) or weights_dir (ENOSPC, EROFS)
            log.error("policy version %d not published (%s): every rank gathers it again before the next update", self.version, e)

    def _figures(self, metrics: dict[str, float], n: int) -> dict[str, float]:
        """The latest update's figures for `<prefix>:learner:latest`: live displays (`ppoz demo`, `ppoz status`)
        and the ledger, which needs the cumulative, checkpointed counters."""
        latest = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isnan(v)}
        latest.update({"updates": self.updates, "version": self.version, "transitions": n, "time": time.time()})
        latest.update({f"{COUNTER_PREFIX}{k}": v for k, v in self.counters.items()})
        return latest

    def _log(self, metrics: dict[str, float], n: int) -> None:
        self.notifier.status(
            f"policy version {self.version}, {self.updates} updates, last: {n} transitions, return "
            f"{metrics.get('charts/episodic_return', math.nan):.3f}, policy loss {update_figure(metrics, 'policy_loss'):.4f}",
            min_interval_s=0,
        )
        if self.writer is not None:
            for key, value in metrics.items():
                if not (isinstance(value, float) and math.isnan(value)):
                    self.writer.add_scalar(key, value, self.updates)
            self.writer.flush()

        log.info(
            "update %d: version %d, %d transitions, return %.3f, policy_loss %.4f, value_loss %.4f, entropy %.3f, "
            "approx_kl %.4f, kl_ref %.4f, clipfrac %.3f, lag %.2f, %.1f transitions/s",
            self.updates,
            self.version,
            n,
            metrics.get("charts/episodic_return", math.nan),
            update_figure(metrics, "policy_loss"),
            update_figure(metrics, "value_loss"),
            update_figure(metrics, "entropy"),
            update_figure(metrics, "approx_kl"),
            update_figure(metrics, "kl_ref"),
            update_figure(metrics, "clipfrac"),
            metrics.get("charts/policy_lag", math.nan),
            metrics.get("charts/SPS", 0.0),
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.pub is not None:
            self.pub.close(linger=0)
        if self.snapshot_server is not None:
            self.snapshot_server.close()
        if self.allow_list is not None:
            self.allow_list.close()
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


def _with_samples(entries: list[tuple[str, dict]]) -> list[tuple[str, list[str] | None]]:
    """Entries as `_ack` takes them: each id with the sample ids of its fields, read once, here."""
    return [(entry_id, entry_samples(fields)) for entry_id, fields in entries]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
