"""Weight publication: snapshots in Redis, announcements over ZeroMQ PUB/SUB.

The learner stores every new policy snapshot in Redis before it announces it,
so PUB never carries the only copy: an actor that starts late, or misses an
announcement (PUB/SUB drops messages for slow joiners and at the high-water
mark), reads the newest snapshot from Redis: `P:weights:latest` (a hash: version,
checksum as sha256 hex, size, kind, run) names it, `P:weights:v{version}` holds its
safetensors bytes (keys: common/segments.py).

An announcement is a two-frame PUB message: topic `weights`, then a msgpack map
{proto, v, op: "weights", version, checksum, size, kind, run}. `kind` is `lora`
(adapter weights) or `full` (every weight, for tiny models trained without LoRA);
`run` the learner run's id (kept across --resume, new otherwise): versions count
within a run, and an actor follows a new run whatever its version.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import redis
import torch
import zmq
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from common import protocol as p
from common.segments import RedisKeys

log = logging.getLogger(__name__)

TOPIC = b"weights"
OP_WEIGHTS = "weights"
KEEP_VERSIONS = 3


class WeightsError(RuntimeError):
    """A snapshot that is missing or does not match its announced checksum."""


@dataclass(frozen=True)
class Announcement:
    version: int
    checksum: str
    size: int
    kind: str
    run: str = ""  # the learner run (older learners: "")


def _keys(prefix: str, version: int | None = None) -> str:
    keys = RedisKeys(prefix)
    return keys.weights_latest if version is None else keys.weights_snapshot(version)


def store_snapshot(
    client: redis.Redis, prefix: str, version: int, state: dict[str, torch.Tensor], kind: str, run: str = ""
) -> Announcement:
    """Write a snapshot to Redis and make it the latest; older ones beyond the last few are deleted."""
    data = save_safetensors({k: v.contiguous() for k, v in state.items()}, metadata={"version": str(version), "kind": kind})
    ann = Announcement(version, hashlib.sha256(data).hexdigest(), len(data), kind, run)
    pipe = client.pipeline(transaction=True)
    pipe.set(_keys(prefix, version), data)
    pipe.hset(_keys(prefix), mapping={"version": version, "checksum": ann.checksum, "size": ann.size, "kind": kind, "run": run})
    if version - KEEP_VERSIONS >= 0:
        pipe.delete(_keys(prefix, version - KEEP_VERSIONS))
    pipe.execute()
    return ann


def announce(pub: zmq.Socket, ann: Announcement) -> None:
    body = p.header(OP_WEIGHTS)
    body.update(version=ann.version, checksum=ann.checksum, size=ann.size, kind=ann.kind, run=ann.run)
    pub.send_multipart([TOPIC, p.encode(body)])


def latest(client: redis.Redis, prefix: str) -> Announcement | None:
    """The newest stored snapshot's description, or None if the learner stored none yet."""
    fields = client.hgetall(_keys(prefix))
    if not fields:
        return None
    return Announcement(
        int(fields[b"version"]),
        fields[b"checksum"].decode(),
        int(fields[b"size"]),
        fields[b"kind"].decode(),
        fields.get(b"run", b"").decode(),
    )


def fetch(client: redis.Redis, prefix: str, ann: Announcement) -> dict[str, torch.Tensor]:
    """The snapshot of an announcement, checked against its checksum."""
    data = client.get(_keys(prefix, ann.version))
    if data is None:
        raise WeightsError(f"snapshot v{ann.version} is not in Redis (superseded or never stored)")
    checksum = hashlib.sha256(data).hexdigest()
    if checksum != ann.checksum or len(data) != ann.size:
        raise WeightsError(f"snapshot v{ann.version} has checksum {checksum[:12]}, announced {ann.checksum[:12]}")
    return load_safetensors(data)


def parse_announcement(frames: list[bytes]) -> Announcement:
    if len(frames) != 2 or frames[0] != TOPIC:
        raise WeightsError(f"not a weights announcement: {len(frames)} frames")
    try:
        msg = p.decode(frames[1])
        return Announcement(int(msg["version"]), str(msg["checksum"]), int(msg["size"]), str(msg["kind"]), str(msg.get("run", "")))
    except (p.ProtocolError, KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"malformed weights announcement: {e}") from e
