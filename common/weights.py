"""Weight publication: snapshots in bounded chunks, announcements over ZeroMQ PUB/SUB.

The learner stores every new policy snapshot before it announces it, so PUB never
carries the only copy: an actor that starts late, or misses an announcement
(PUB/SUB drops messages for slow joiners and at the high-water mark), reads the
newest snapshot named by `P:weights:latest` (a hash: version, checksum, size,
kind, run; keys: common/segments.py).

A snapshot of any size is written as chunks of at most `chunk_bytes` (64 MiB by
default; Redis refuses values over 512 MB, `proto-max-bulk-len`). A chunk is a
safetensors file of whole tensors, or of row ranges of a tensor too big for one
chunk (key `name@start:end`); the tensors are taken one at a time from an
iterator, so the publisher holds one tensor and one chunk at a time, never a
second copy of the model. Then comes the manifest (msgpack: every tensor's dtype
and shape, every chunk's size, sha256 and pieces); the announced checksum is the
manifest's sha256, so it covers every byte through the chunks' checksums. Only
after the manifest is stored does `P:weights:latest` name the new version: a
reader never sees a half-written snapshot. The `KEEP_VERSIONS` newest snapshots
are kept (`P:weights:kept`, newest first); older ones are removed.

Chunks and manifests live in one of two stores (`SnapshotStore`):
- `RedisSnapshots`: `P:weights:{run}:v{n}` (the manifest) and
  `P:weights:{run}:v{n}:c{i}` (chunk i). A farm's Redis needs about
  (KEEP_VERSIONS + 1) x the snapshot's size for weights (the new one is written
  before the oldest is removed).
- `DirectorySnapshots`: a directory every process mounts (NFS, a parallel file
  system): `{dir}/{run}-v{n}/manifest.msgpack` and `chunk-00000.safetensors`, ...
  written under a temporary name and renamed into place, so a snapshot appears
  whole or not at all. Redis then holds only `P:weights:latest` and the list.

An actor fetches the chunks in parallel, checks each against the manifest's
sha256, and assembles the tensors; its model changes only once every chunk has
been checked (`fetch` returns the whole state or raises).

An announcement is a two-frame PUB message: topic `weights`, then a msgpack map
{proto, v, op: "weights", version, checksum, size, kind, run}. `kind` is `lora`
(adapter weights) or `full` (every weight, trained without LoRA); `run` the
learner run's id (kept across --resume, new otherwise): versions count within a
run, and an actor follows a new run whatever its version.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgpack
import redis
import torch
import zmq
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from common import protocol as p
from common.segments import RedisKeys

log = logging.getLogger(__name__)

TOPIC = b"weights"
OP_WEIGHTS = "weights"
KEEP_VERSIONS = 3
CHUNK_BYTES = 64 << 20
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 64 << 20  # about a million tensors' entries: anything larger is not a manifest
FETCH_THREADS = 4  # chunks fetched and checked at once; also bounds the chunks held before they are copied out

DTYPES = {  # what a snapshot may hold: safetensors' names without "torch."
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    + (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)
}


RUN_ID = re.compile(r"[0-9A-Za-z_-]{0,64}")  # a learner run's id: hex from uuid4 (a word: it names keys and folders)


def _check_run(run: str, error: type[Exception]) -> None:
    if not RUN_ID.fullmatch(run):
        raise error(f"run id {run[:80]!r} is not a word of letters, digits, '-' and '_'")


class WeightsError(RuntimeError):
    """A snapshot that is missing, incomplete, or does not match its announced checksums."""


@dataclass(frozen=True)
class Announcement:
    version: int
    checksum: str  # sha256 hex of the snapshot's manifest
    size: int  # the chunks' bytes in all
    kind: str
    run: str = ""  # the learner run (older learners: "")


class SnapshotStore(Protocol):
    """Where a snapshot's manifest and chunks are kept (Redis keys or a shared directory)."""

    def begin(self, run: str, version: int) -> None: ...

    def put_chunk(self, run: str, version: int, index: int, data: bytes) -> None: ...

    def finish(self, run: str, version: int, manifest: bytes) -> None:
        """Store the manifest: after this the whole snapshot can be read."""

    def manifest(self, run: str, version: int) -> bytes | None: ...

    def chunk(self, run: str, version: int, index: int) -> bytes | None: ...

    def remove(self, run: str, version: int, chunks: int) -> None: ...

    def abort(self, run: str, version: int, chunks: int) -> None:
        """Remove what a publication that failed half-way wrote (its first `chunks` chunks), as far as possible."""


class RedisSnapshots:
    """Manifest and chunks as Redis strings, each a separate key of at most chunk_bytes."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.keys = RedisKeys(prefix)

    def begin(self, run: str, version: int) -> None:
        pass  # chunks of a version being rewritten (a restarted run) are overwritten; the manifest comes last

    def put_chunk(self, run: str, version: int, index: int, data: bytes) -> None:
        self.client.set(self.keys.weights_chunk(run, version, index), data)

    def finish(self, run: str, version: int, manifest: bytes) -> None:
        self.client.set(self.keys.weights_manifest(run, version), manifest)

    def manifest(self, run: str, version: int) -> bytes | None:
        return self.client.get(self.keys.weights_manifest(run, version))

    def chunk(self, run: str, version: int, index: int) -> bytes | None:
        return self.client.get(self.keys.weights_chunk(run, version, index))

    def remove(self, run: str, version: int, chunks: int) -> None:
        names = [self.keys.weights_manifest(run, version)] + [self.keys.weights_chunk(run, version, i) for i in range(chunks)]
        for start in range(0, len(names), 1000):
            self.client.delete(*names[start : start + 1000])

    def abort(self, run: str, version: int, chunks: int) -> None:
        self.remove(run, version, chunks)  # no manifest yet: the chunks written


class DirectorySnapshots:
    """Manifest and chunks as files in a directory every process mounts (`{dir}/{run}-v{n}/`)."""

    MANIFEST = "manifest.msgpack"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._writing: Path | None = None

    def _final(self, run: str, version: int) -> Path:
        _check_run(run, WeightsError)  # read from Redis: a bad one is bad input
        return self.root / f"{run or 'norun'}-v{version}"

    def begin(self, run: str, version: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".*-v*.*"):  # a publication a crash or an error cut short (one learner writes here)
            shutil.rmtree(stale, ignore_errors=True)
        self._final(run, version)  # checks the run id
        self._writing = Path(tempfile.mkdtemp(prefix=f".{run or 'norun'}-v{version}.", dir=self.root))
        # mkdtemp makes it the owner's alone: the actors read it, as the learner's group (docs/farm.md)
        self._writing.chmod(0o750)

    def put_chunk(self, run: str, version: int, index: int, data: bytes) -> None:
        if self._writing is None:
            raise RuntimeError("put_chunk before begin")
        (self._writing / f"chunk-{index:05d}.safetensors").write_bytes(data)

    def finish(self, run: str, version: int, manifest: bytes) -> None:
        if self._writing is None:
            raise RuntimeError("finish before begin")
        (self._writing / self.MANIFEST).write_bytes(manifest)
        final = self._final(run, version)
        if final.exists():  # the same version of this run written again (a resumed run): the new one replaces it
            shutil.rmtree(final, ignore_errors=True)
        os.replace(self._writing, final)  # a rename: readers see the directory whole or not at all
        self._writing = None

    def _read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def manifest(self, run: str, version: int) -> bytes | None:
        return self._read(self._final(run, version) / self.MANIFEST)

    def chunk(self, run: str, version: int, index: int) -> bytes | None:
        return self._read(self._final(run, version) / f"chunk-{index:05d}.safetensors")

    def remove(self, run: str, version: int, chunks: int) -> None:
        shutil.rmtree(self._final(run, version), ignore_errors=True)

    def abort(self, run: str, version: int, chunks: int) -> None:
        if self._writing is not None:
            shutil.rmtree(self._writing, ignore_errors=True)
            self._writing = None


def snapshot_store(client: redis.Redis, prefix: str, weights_dir: str = "") -> SnapshotStore:
    """The store a farm's settings name: a shared directory when `weights_dir` is set, else Redis."""
    return DirectorySnapshots(weights_dir) if weights_dir else RedisSnapshots(client, prefix)


def _pieces(name: str, tensor: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[str, int, int, torch.Tensor]]:
    """A tensor whole, or its row ranges of at most chunk_bytes (one row at least) if it is bigger."""
    tensor = tensor.detach()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.dim() == 0 or nbytes <= chunk_bytes:
        yield name, 0, tensor.shape[0] if tensor.dim() else 0, tensor
        return
    row_bytes = max(1, nbytes // tensor.shape[0])
    step = max(1, chunk_bytes // row_bytes)
    for start in range(0, tensor.shape[0], step):
        end = min(start + step, tensor.shape[0])
        yield f"{name}@{start}:{end}", start, end, tensor[start:end]


class _ChunkWriter:
    """Packs tensors, as they come, into chunks of at most chunk_bytes of tensor data, and stores each chunk from a
    thread while the next one is encoded (sha256 and the writes release the GIL). One chunk is stored at a time,
    so at most two encoded chunks are held."""

    def __init__(self, store: SnapshotStore, run: str, version: int, chunk_bytes: int) -> None:
        self.store, self.run, self.version, self.chunk_bytes = store, run, version, chunk_bytes
        self.tensors: list[list[Any]] = []  # [name, dtype, shape] per tensor, for the manifest
        self.chunks: list[dict[str, Any]] = []  # {size, sha256, pieces} per chunk, for the manifest
        self._names: set[str] = set()
        self._batch: dict[str, torch.Tensor] = {}
        self._pieces: list[list[Any]] = []
        self._bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-store")
        self._storing: Future[None] | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if "@" in name or name in self._names:
            raise ValueError(f"cannot publish tensor {name!r}: names must be unique and free of '@'")
        self._names.add(name)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"cannot publish tensor {name!r} of dtype {tensor.dtype}")
        self.tensors.append([name, dtype, list(tensor.shape)])
        for key, start, end, piece in _pieces(name, tensor, self.chunk_bytes):
            piece_bytes = piece.numel() * piece.element_size()
            if self._batch and self._bytes + piece_bytes > self.chunk_bytes:
                self._seal()
            self._batch[key] = piece.to("cpu").contiguous()
            self._pieces.append([key, name, start, end])
            self._bytes += piece_bytes

    def finish(self) -> None:
        if self._batch:
            self._seal()
        if self._storing is not None:
            self._storing.result()
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Stop, and remove what was written, as far as possible (Redis or the disk may be why it failed)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.store.abort(self.run, self.version, len(self.chunks))

    def _seal(self) -> None:
        data = save_safetensors(self._batch)
        self.chunks.append({"size": len(data), "sha256": "", "pieces": self._pieces})
        if self._storing is not None:
            self._storing.result()  # raises what storing the chunk before raised
        self._storing = self._pool.submit(self._put, len(self.chunks) - 1, data)
        self._batch, self._pieces, self._bytes = {}, [], 0

    def _put(self, index: int, data: bytes) -> None:
        self.chunks[index]["sha256"] = hashlib.sha256(data).hexdigest()
        self.store.put_chunk(self.run, self.version, index, data)


def store_snapshot(
    client: redis.Redis,
    prefix: str,
    version: int,
    state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    kind: str,
    run: str = "",
    store: SnapshotStore | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    keep: int = KEEP_VERSIONS,
) -> Announcement:
    """Write a snapshot in chunks (`_ChunkWriter`), then make it the latest; snapshots beyond the `keep` newest
    are removed. A publication that fails half-way removes what it wrote, as far as it can.

    `state` may be an iterator of (name, tensor), consumed one tensor at a time (a sharded learner gathers
    each tensor only when it is written)."""
    _check_run(run, ValueError)  # the caller's own
    store = store or RedisSnapshots(client, prefix)
    keys = RedisKeys(prefix)
    for stale in _kept(client, keys):  # this version of this run written before (a resumed run): replaced whole
        if stale[:2] == (run, version):
            store.remove(*stale)
    store.begin(run, version)
    writer = _ChunkWriter(store, run, version, chunk_bytes)
    try:
        for name, tensor in state.items() if isinstance(state, dict) else state:
            writer.add(name, tensor)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    tensors, chunks = writer.tensors, writer.chunks
    manifest = msgpack.packb(
        {"format": MANIFEST_FORMAT, "version": version, "run": run, "kind": kind, "tensors": tensors, "chunks": chunks}
    )
    store.finish(run, version, manifest)
    ann = Announcement(version, hashlib.sha256(manifest).hexdigest(), sum(c["size"] for c in chunks), kind, run)
    kept = [(run, version, len(chunks))] + [k for k in _kept(client, keys) if k[:2] != (run, version)]
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.weights_latest, mapping={"version": version, "checksum": ann.checksum, "size": ann.size, "kind": kind, "run": run})
    pipe.delete(keys.weights_kept)
    pipe.rpush(keys.weights_kept, *(f"{r}:{v}:{c}" for r, v, c in kept[:keep]))
    pipe.execute()
    for superseded in kept[keep:]:  # removed only once the new one is the latest: readers of the old get a retry
        store.remove(*superseded)
    return ann


def _kept(client: redis.Redis, keys: RedisKeys) -> list[tuple[str, int, int]]:
    """The stored snapshots, newest first: (run, version, chunks). Only the learner's rank 0 writes the list."""
    kept = []
    for entry in client.lrange(keys.weights_kept, 0, -1):
        run, version, chunks = entry.decode().rsplit(":", 2)
        kept.append((run, int(version), int(chunks)))
    return kept


def announce(pub: zmq.Socket, ann: Announcement) -> None:
    body = p.header(OP_WEIGHTS)
    body.update(version=ann.version, checksum=ann.checksum, size=ann.size, kind=ann.kind, run=ann.run)
    pub.send_multipart([TOPIC, p.encode(body)], zmq.NOBLOCK)  # a PUB drops at its high-water mark: never a wait


def latest(client: redis.Redis, prefix: str) -> Announcement | None:
    """The newest stored snapshot's description, or None if the learner stored none yet."""
    fields = client.hgetall(RedisKeys(prefix).weights_latest)
    if not fields:
        return None
    return Announcement(
        int(fields[b"version"]),
        fields[b"checksum"].decode(),
        int(fields[b"size"]),
        fields[b"kind"].decode(),
        fields.get(b"run", b"").decode(),
    )


def _manifest(store: SnapshotStore, ann: Announcement) -> dict[str, Any]:
    data = store.manifest(ann.run, ann.version)
    if data is None:
        raise WeightsError(f"snapshot v{ann.version} is not stored (superseded or never stored)")
    checksum = hashlib.sha256(data).hexdigest()
    if checksum != ann.checksum:
        raise WeightsError(f"snapshot v{ann.version} has manifest checksum {checksum[:12]}, announced {ann.checksum[:12]}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise WeightsError(f"snapshot v{ann.version}'s manifest is {len(data)} bytes, over {MAX_MANIFEST_BYTES}")
    try:
        manifest = msgpack.unpackb(data)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise WeightsError(f"snapshot v{ann.version} has manifest format {manifest.get('format')!r}, not {MANIFEST_FORMAT}")
        if sum(int(c["size"]) for c in manifest["chunks"]) != ann.size:
            raise WeightsError(f"snapshot v{ann.version}'s chunks do not add up to the announced {ann.size} bytes")
        return manifest
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
        raise WeightsError(f"snapshot v{ann.version} has a malformed manifest: {e}") from e


def fetch(
    client: redis.Redis, prefix: str, ann: Announcement, store: SnapshotStore | None = None, threads: int = FETCH_THREADS
) -> dict[str, torch.Tensor]:
    """The snapshot of an announcement, every chunk checked against its checksum; all of it, or WeightsError.

    Chunks are read and checked `threads` at a time (sha256 and the reads release the GIL); each is copied
    into its tensors as it arrives, so no more than `threads` chunks are held besides the tensors."""
    store = store or RedisSnapshots(client, prefix)
    manifest = _manifest(store, ann)
    try:
        state = {str(name): torch.empty(tuple(int(n) for n in shape), dtype=DTYPES[dtype]) for name, dtype, shape in manifest["tensors"]}
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise WeightsError(f"snapshot v{ann.version} lists a tensor this actor cannot build: {e}") from e
    # which rows (one for a scalar) of each tensor a piece has written: every row exactly once
    written = {name: torch.zeros(t.shape[0] if t.dim() else 1, dtype=torch.bool) for name, t in state.items()}

    def read(index: int) -> dict[str, torch.Tensor]:
        entry = manifest["chunks"][index]
        data = store.chunk(ann.run, ann.version, index)
        if data is None:
            raise WeightsError(f"snapshot v{ann.version} lacks chunk {index} (superseded while being read?)")
        if len(data) != int(entry["size"]) or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} does not match its checksum")
        try:
            return load_safetensors(data)
        except SafetensorError as e:
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} is not safetensors: {e}") from e

    def place(index: int, loaded: dict[str, torch.Tensor]) -> None:
        try:
            for key, name, start, end in manifest["chunks"][index]["pieces"]:
                target, piece = state.get(name), loaded.get(key)
                if target is None or piece is None:
                    raise WeightsError(f"snapshot v{ann.version}'s chunk {index} lacks piece {key!r} of a listed tensor")
                rows = slice(0, 1) if target.dim() == 0 else slice(int(start), int(end))
                view = target if target.dim() == 0 else target[rows]
                if view.shape != piece.shape or view.dtype != piece.dtype or written[name][rows].any():
                    raise WeightsError(f"snapshot v{ann.version}: piece {key!r} does not fit its place or overlaps another")
                view.copy_(piece)
                written[name][rows] = True
        except (TypeError, ValueError) as e:
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} has malformed pieces: {e}") from e

    count = len(manifest["chunks"])
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-fetch") as pool:
        running: dict[Future[dict[str, torch.Tensor]], int] = {}
        following = 0
        while following < count or running:
            while following < count and len(running) < max(1, threads):
                running[pool.submit(read, following)] = following
                following += 1
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                try:
                    place(running.pop(future), future.result())
                except BaseException:
                    for other in running:
                        other.cancel()
                    raise
    for name, target in state.items():
        expected = target.shape[0] if target.dim() else 1
        if target.numel() and not bool(written[name].all()):
            raise WeightsError(f"snapshot v{ann.version}: tensor {name!r} has {int(written[name].sum())} of its {expected} rows")
    return state


def parse_announcement(frames: list[bytes]) -> Announcement:
    if len(frames) != 2 or frames[0] != TOPIC:
        raise WeightsError(f"not a weights announcement: {len(frames)} frames")
    try:
        msg = p.decode(frames[1])
        return Announcement(int(msg["version"]), str(msg["checksum"]), int(msg["size"]), str(msg["kind"]), str(msg.get("run", "")))
    except (p.ProtocolError, KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"malformed weights announcement: {e}") from e
