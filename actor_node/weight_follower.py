"""How an actor learns of new weights (PUB announcements, with Redis as the backstop) and fetches them while it serves."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import redis
import torch
import zmq

from common import weights
from common.security import ClientKeys
from common.shared_settings import StoreSettings
from common.snapshot_serve import ServedSnapshots
from common.snapshot_stores import HostCache, default_host_cache, on_tmpfs
from common.weights import TOPIC, Announcement, SnapshotSource, WeightsError, latest, parse_announcement, snapshot_store

log = logging.getLogger(__name__)


class WeightFollower:
    """Tells an actor when a newer snapshot exists: from PUB announcements, and from Redis as a backstop."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        endpoint: str = "",
        context: zmq.Context | None = None,
        poll_s: float = 5.0,
        curve: ClientKeys | None = None,
        weights_dir: str = "",
        source: str = "",
        cache_dir: str = "",
    ) -> None:
        self.client = client
        self.prefix = prefix
        # where the snapshots' chunks are read: the learner's snapshot server, or the farm's store
        self.store: SnapshotSource = ServedSnapshots(source, curve=curve) if source else snapshot_store(client, prefix, weights_dir)
        self.cache = HostCache(cache_dir) if cache_dir else None  # this host's copy, shared by its actors
        self.poll_s = poll_s
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-fetch-bg")
        self.fetching: tuple[Announcement, Future[dict[str, torch.Tensor]]] | None = None
        self._next_poll = 0.0
        self.waiting: Announcement | None = None  # found by `newest`, not loaded yet (see `take`)
        self.refused: tuple[str, int, str] | None = None  # (run, version, checksum) of a snapshot that could not be loaded
        self.sub: zmq.Socket | None = None
        if endpoint:
            self.sub = (context or zmq.Context.instance()).socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
            if curve is not None:  # the learner's PUB is a CURVE server
                curve.apply(self.sub)
            self.sub.connect(endpoint)

    def newest(self, now: float, current: int, current_run: str = "") -> Announcement | None:
        """A snapshot to load, if one was announced or is in Redis (checked every poll_s): newer than
        version `current` of run `current_run`, or of another run whatever its version (a learner
        restarted without --resume counts from 0 again; its weights are the ones to serve).

        It is kept as `waiting` until `take()`: an actor that is generating loads new weights only
        once its running responses are finished, and must not lose the announcement meanwhile."""
        found = self._poll(now, current, current_run)
        if found is not None:
            self.waiting = found
        return self.waiting

    def take(self, ann: Announcement, loaded: bool = True, refuse: bool = True) -> None:
        """`ann` was loaded, or could not be (`loaded` false): forget it, unless a newer one waits; one that could
        not be loaded is not offered again if `refuse` (its bytes are wrong: a generating actor would stop admitting
        requests for it at every poll), else it is found again at the next poll."""
        if not loaded and refuse:
            self.refused = (ann.run, ann.version, ann.checksum)
        if self.waiting == ann:
            self.waiting = None

    def _poll(self, now: float, current: int, current_run: str) -> Announcement | None:

        def newer(ann: Announcement) -> bool:
            if (ann.run, ann.version, ann.checksum) == self.refused:  # the same bytes again; a repaired one is tried
                return False
            return ann.version > current if ann.run == current_run else bool(ann.run)

        best: Announcement | None = None
        while self.sub is not None:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                ann = parse_announcement(frames)
            except WeightsError as e:
                log.warning("%s", e)
                continue
            if newer(ann) and (best is None or ann.run != best.run or ann.version > best.version):
                best = ann  # the latest run announced, its newest version
        if best is None and now >= self._next_poll:
            self._next_poll = now + self.poll_s
            try:
                stored = latest(self.client, self.prefix)
            except redis.RedisError as e:
                log.warning("cannot read the latest snapshot from Redis: %s", e)
                stored = None
            if stored is not None and newer(stored):
                best = stored
        return best

    def fetched(
        self, ann: Announcement, into: dict[str, torch.Tensor] | None, wait: bool
    ) -> tuple[Announcement, dict[str, torch.Tensor]] | None:
        """The snapshot being fetched in the background, once it is all there (and checked): started for `ann`
        (into `into`) if none is under way. None while it is still coming, unless `wait`; raises what the fetch
        raised. The serving loop goes on meanwhile: the chunks are read and checked in threads that release the GIL."""
        if self.fetching is None:
            job = self._fetcher.submit(weights.fetch, self.client, self.prefix, ann, self.store, into=into, cache=self.cache)
            self.fetching = (ann, job)
        started, job = self.fetching
        if not wait and not job.done():
            return None
        self.fetching = None
        return started, job.result()

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)  # a fetch under way ends with the process
        if self.cache is not None:
            self.cache.close()
        if self.sub is not None:
            self.sub.close(linger=0)


def host_cache_dir(setting: str, store: StoreSettings, source: str = "") -> str:
    """Where this host's actors keep their shared copy of each snapshot (`[actor] weights_cache`), or "" for none:
    by default one where the snapshots come over the network (Redis, a learner's snapshot server), none where
    they are read from a directory (on this host's tmpfs that is already the shared copy)."""
    if setting == "off":
        return ""
    if setting == "auto":  # a directory on a tmpfs is the host's copy already; on NFS every actor would read it all
        local = bool(store.weights_dir) and not source and on_tmpfs(Path(store.weights_dir))
        return "" if local else default_host_cache(store.key_prefix)
    return setting
