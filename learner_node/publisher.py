"""The learner's publisher: each new policy version's weights stored in chunks (Redis or a weights directory),
then announced on PUB; actors on other hosts fetch the chunks from its snapshot server (common/snapshot_serve.py).

A learner on one process publishes in the background: `publish` takes a copy of the weights on the host (the
next update changes them in place) and a thread stores and announces it while the learner trains on. At most one
publication is in flight: the next one waits for it. Its failure (Redis gone, a full disk) is raised to the
learner's loop by `check` or `wait`, which then publishes the newest version again once Redis is back: versions
only go forward, so a version that never reached the store is simply superseded. A sharded learner publishes in
its loop: every rank takes part in each tensor's all-gather.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable

import redis
import torch
import zmq

from common import weights
from common.security import AllowList, apply_server
from common.snapshot_serve import SnapshotServer
from common.zmqio import bound
from learner_node import sharding
from learner_node.config import LearnerConfig
from learner_node.policy import LearnerPolicy
from models.policy_model import policy_state_items

log = logging.getLogger("learner_node.worker.publisher")

PUBLISH_DEADLINE_S = 600.0  # a publication in flight waited for at most this long (Redis's own timeouts end one sooner)


class Publisher:
    """Every rank has one (a sharded model's every rank gathers each tensor); rank 0's alone binds and stores."""

    def __init__(
        self, cfg: LearnerConfig, client: redis.Redis, lp: LearnerPolicy, context: zmq.Context, sharded: bool, is_main: bool
    ) -> None:
        self.cfg = cfg
        self.redis = client
        self.lp = lp
        self.sharded = sharded
        self.is_main = is_main
        # one store for the run: a directory store prepares the next publication's files after each one
        self.snapshots = weights.snapshot_store(client, cfg.store.key_prefix, cfg.store.weights_dir)
        self._published_names: dict[str, str] = sharding.policy_names(lp.model) if sharded else {}
        self.pub: zmq.Socket | None = None
        self.allow_list: AllowList | None = None  # CURVE: which actors may subscribe
        self.endpoint = ""
        self.snapshot_server: SnapshotServer | None = None
        if is_main:
            self.pub = context.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            if cfg.curve_secret_key:  # before bind, as every CURVE server socket
                self.allow_list = apply_server(self.pub, cfg.curve_secret_key, cfg.curve_allowed_actors, "learner weights")
            self.pub.bind(cfg.weights_bind)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if cfg.weights_serve:  # actors on other hosts fetch the chunks from here (common/snapshot_serve.py)
                keys = (cfg.curve_secret_key, cfg.curve_allowed_actors)
                self.snapshot_server = SnapshotServer(self.snapshots, cfg.weights_serve, context, *keys)
        self._flight: threading.Thread | None = None  # the publication in the background (one process only)
        self._failure: BaseException | None = None  # how the last one ended, if it failed

    def publish(self, version: int, run_id: str) -> None:
        """Store the current weights in chunks as `version` of run `run_id`, then announce them (PUB never holds the
        only copy). One process: in the background, from a copy taken now (the publication before it waited for
        first, its failure raised); sharded: here, every rank gathering each tensor in turn, so that rank 0 never
        holds a second copy of the model."""
        if not self.sharded:
            if not self.is_main:
                return
            self.wait()
            on_cpu = next(iter(self.lp.model.parameters())).device.type == "cpu"  # .cpu() copies a GPU's tensors already
            copy = [(name, t.clone() if on_cpu else t) for name, t in policy_state_items(self.lp.model, tied_once=True)]
            self._flight = threading.Thread(target=self._background, args=(version, run_id, copy), name="publish", daemon=True)
            self._flight.start()
            return
        # every rank takes part in each tensor's all-gather; rank 0 alone gets the tensors and stores them
        tensors = sharding.full_state_chunks(self.lp.model, self._published_names)
        if not self.is_main:
            collections.deque(tensors, maxlen=0)  # every gather, nothing kept
            return
        self._store(version, run_id, tensors)

    def _background(self, version: int, run_id: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        try:
            self._store(version, run_id, tensors)
        except BaseException as e:  # noqa: BLE001 - raised to the learner's loop by `check` or `wait`
            self._failure = e

    def check(self) -> None:
        """Raise the failure of the last publication if it has ended in one (without waiting for one in flight)."""
        if self._flight is not None and not self._flight.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the publication in flight, if any (at most PUBLISH_DEADLINE_S); raise its failure."""
        if self._flight is not None:
            started = time.monotonic()
            self._flight.join(PUBLISH_DEADLINE_S)
            if self._flight.is_alive():
                raise TimeoutError(
                    f"storing the weights took over {PUBLISH_DEADLINE_S:g} s (still at it after {time.monotonic() - started:.0f} s "
                    f"of waiting); is the store ({self.cfg.store.weights_dir or 'Redis'}) answering?"
                )
            self._flight = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _store(self, version: int, run_id: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        store = self.cfg.store
        kind = "lora" if self.lp.has_adapter else "full"
        try:
            ann = weights.store_snapshot(
                self.redis,
                store.key_prefix,
                version,
                tensors,
                kind,
                run_id,
                self.snapshots,
                keep=store.weights_kept,
            )
        finally:
            if self.sharded:  # a store that failed half-way: the other ranks still wait in the gathers left
                collections.deque(tensors, maxlen=0)
        weights.announce(bound(self.pub, "the weights publisher"), ann)

    def close(self) -> None:
        try:
            self.wait()  # a publication in flight ends before its socket closes
        except Exception as e:  # noqa: BLE001 - closing: said, not raised
            log.warning("the last weights publication failed: %s", e)
        if self.pub is not None:
            self.pub.close(linger=0)
        if self.snapshot_server is not None:
            self.snapshot_server.close()
        if self.allow_list is not None:
            self.allow_list.close()
