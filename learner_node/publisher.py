"""The learner's publisher: each new policy version's weights stored in chunks (Redis or a weights directory),
then announced on PUB; actors on other hosts fetch the chunks from its snapshot server (common/snapshot_serve.py)."""

from __future__ import annotations

import collections

import redis
import zmq

from common import weights
from common.security import AllowList, apply_server
from common.snapshot_serve import SnapshotServer
from common.zmqio import bound
from learner_node import sharding
from learner_node.config import LearnerConfig
from learner_node.policy import LearnerPolicy
from models.policy_model import policy_state_items


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

    def publish(self, version: int, run_id: str) -> None:
        """Store the current weights in chunks as `version` of run `run_id`, then announce them (PUB never holds the
        only copy). The tensors are taken one at a time, so rank 0 never holds a second copy of the model."""
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
        if self.pub is not None:
            self.pub.close(linger=0)
        if self.snapshot_server is not None:
            self.snapshot_server.close()
        if self.allow_list is not None:
            self.allow_list.close()
