"""The Redis side of the learner's updates, owed until it is done: a Redis outage after an update's checkpoint
delays it, loses none of it (learner_node/worker.py, steps 4 and 5).

What an update leaves to do (acknowledge its entries, publish its weights, write its figures and the backlog
limit) is held here and done by `settle`; every part of it is idempotent, so after a failure it is simply done
again once Redis answers (`wait_for_redis`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from common.learner_figures import write_latest
from common.sd_notify import Notifier
from learner_node.config import LearnerConfig
from learner_node.stream_reader import StreamReader, Unacked

log = logging.getLogger("learner_node.worker.redis_work")  # under the worker's logger, as before the split

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # redis-py's own retries gave up: Redis is down or restarting
REDIS_BACKOFF_FIRST_S = 0.1
REDIS_BACKOFF_CAP_S = 5.0


@dataclass
class RedisWork:
    cfg: LearnerConfig
    client: redis.Redis
    reader: StreamReader
    publish: Callable[[], None]
    notifier: Notifier
    stop_event: threading.Event
    sharded: bool
    is_main: bool
    unacked: list[Unacked] = field(default_factory=list)  # entries the last checkpoint consumed
    unpublished: bool = False  # its version's weights
    unreported: dict[str, float] = field(default_factory=dict)  # the last update's figures and counters (common/learner_figures.py)
    backlog: int = 0  # the backlog limit to publish for the broker (0: nothing new)

    def settle(self) -> None:
        """Finish the last update's Redis work, if not done yet: acknowledge and delete the entries its
        checkpoint consumed, store and announce its weights, publish its figures and counters.

        Each is idempotent (XACK/XDEL of an entry already gone, a snapshot or a hash written
        twice), so after a Redis failure it is simply done again; a failure raises to the learner's loop,
        which waits for Redis and calls this again before reading anything new.
        """
        if not self.is_main:
            return
        if self.unacked:
            self.reader.acknowledge(self.unacked)
            self.unacked = []
        if self.unpublished and not self.sharded:  # sharded: every rank gathers (the learner's `_publish_sharded`)
            self.publish()
            self.unpublished = False
        if self.unreported:
            write_latest(self.client, self.cfg.store.key_prefix, self.unreported)
            self.unreported = {}
        if self.backlog:
            self.client.set(self.cfg.store.keys.learner_backlog, self.backlog)
            self.backlog = 0

    def settle_before_exit(self) -> None:
        """The last update's Redis work before the loop ends: waited for after `max_updates`;
        tried once when stopped (then a learner resumed from the checkpoint finishes it)."""
        while True:
            try:
                self.settle()
                return
            except REDIS_DOWN as e:
                if self.stop_event.is_set():
                    log.error(
                        "Redis unreachable while stopping (%s): the last update's acknowledgement, weights or figures "
                        "are left to a learner resumed from the checkpoint (--resume)",
                        e,
                    )
                    return
                self.wait_for_redis(e)

    def wait_for_redis(self, error: Exception) -> None:
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
                self.client.ping()
                if self.is_main:
                    self.reader.ensure_group()  # a Redis restarted without persistence has lost it
                break
            except REDIS_DOWN as e:
                delay = min(delay * 2, REDIS_BACKOFF_CAP_S)
                log.warning("Redis still unreachable after %.1f s (%s); next try in %.1f s", time.monotonic() - down_since, e, delay)
        else:
            return
        log.warning("Redis is back after %.1f s; re-reading this learner's pending segments", time.monotonic() - down_since)
