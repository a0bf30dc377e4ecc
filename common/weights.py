"""Weight publication: snapshots in bounded chunks, announcements over ZeroMQ PUB/SUB.

The learner stores every new policy snapshot before it announces it, so PUB never
carries the only copy: an actor that starts late, or misses an announcement
(PUB/SUB drops messages for slow joiners and at the high-water mark), reads the
newest snapshot named by `P:weights:latest` (a hash: version, checksum, size,
kind, run; keys: common/segments.py).

A snapshot of any size is written as chunks of at most `chunk_bytes` (64 MiB by
default; Redis refuses values over 512 MB, `proto-max-bulk-len`). A chunk is the
raw bytes of whole tensors, or of row ranges of a tensor too big for one chunk
(key `name@start:end`), back to back; the tensors are taken one at a time from
an iterator, so the publisher holds at most two chunks, never a second copy of
the model (a CPU tensor is written from its own memory: no copy at all). Then
comes the manifest (msgpack: every tensor's dtype and shape, every chunk's size,
checksum and pieces with their offsets); the announced checksum is the
manifest's, so it covers every byte through the chunks' checksums. Only after
the manifest is stored does `P:weights:latest` name the new version: a reader
never sees a half-written snapshot. The `keep` newest snapshots are kept
(`P:weights:kept`, newest first); older ones are removed. The stores, and the
one copy per host that actors share, are in common/snapshot_stores.py.

The checksum is xxh3-128 (xxhash): it is there to catch a torn or corrupted
write or transfer, which a 128-bit non-cryptographic hash does at ~30 GB/s on
one core (sha256: 2 GB/s, the publication's bottleneck before). A hostile
writer is kept out by CURVE and the store's permissions, not by the checksum
(docs/design.md, "Weights at memory speed").

An actor reads the chunks in parallel, straight into the tensors they fill
(`fetch(into=...)`: the actor's staging copy, so its model changes only once
every chunk has been checked), checking each chunk's checksum over the bytes as
placed. `fetch` returns the whole state or raises.

An announcement is a two-frame PUB message: topic `weights`, then a msgpack map
{proto, v, op: "weights", version, checksum, size, kind, run}. `kind` is `lora`
(adapter weights) or `full` (every weight, trained without LoRA); `run` the
learner run's id (kept across --resume, new otherwise): versions count within a
run, and an actor follows a new run whatever its version.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import redis
import torch
import xxhash
import zmq

from common import protocol as p
from common.segments import RedisKeys
from common.snapshot_stores import (
    BytesChunk,
    ChunkReader,
    DirectorySnapshots,
    HostCache,
    RedisSnapshots,
    SnapshotSource,
    SnapshotStore,
    WeightsError,
    WeightsUnavailable,
    check_run,
    snapshot_store,
)

__all__ = [
    "Announcement",
    "DirectorySnapshots",
    "HostCache",
    "RedisSnapshots",
    "SnapshotSource",
    "SnapshotStore",
    "WeightsError",
    "WeightsUnavailable",
    "snapshot_store",
]

log = logging.getLogger(__name__)

TOPIC = b"weights"
OP_WEIGHTS = "weights"
KEEP_VERSIONS = 3
CHUNK_BYTES = 64 << 20
MANIFEST_FORMAT = 2  # 1: safetensors chunks checked by sha256
MAX_MANIFEST_BYTES = 64 << 20  # about a million tensors' entries: anything larger is not a manifest
FETCH_THREADS = 4  # chunks read and checked at once; also bounds the Redis chunks held before they are placed
STORE_THREADS = 2  # chunks written at once; also bounds the sealed chunks a publisher holds

DTYPES = {  # what a snapshot may hold: torch's names without "torch."
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    + (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)
}


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, as a writable buffer over its own memory (any dtype, bf16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


@dataclass(frozen=True)
class Announcement:
    version: int
    checksum: str  # xxh3-128 hex of the snapshot's manifest
    size: int  # the chunks' bytes in all
    kind: str
    run: str = ""  # the learner run (older learners: "")


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
    """Packs tensors, as they come, into chunks of at most chunk_bytes, and stores each sealed chunk from a
    thread (its checksum and the write release the GIL) while the next is gathered. At most STORE_THREADS
    sealed chunks are held; a CPU tensor's piece is its own memory, not a copy."""

    def __init__(self, store: SnapshotStore, run: str, version: int, chunk_bytes: int) -> None:
        self.store, self.run, self.version, self.chunk_bytes = store, run, version, chunk_bytes
        self.tensors: list[list[Any]] = []  # [name, dtype, shape] per tensor, for the manifest
        self.chunks: list[dict[str, Any]] = []  # {size, xxh3, pieces} per chunk, for the manifest
        self._names: set[str] = set()
        self._batch: list[torch.Tensor] = []
        self._pieces: list[list[Any]] = []
        self._bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=STORE_THREADS, thread_name_prefix="weights-store")
        self._storing: list[Future[None]] = []

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
            self._batch.append(piece.to("cpu").contiguous())
            self._pieces.append([key, name, start, end, self._bytes])
            self._bytes += piece_bytes

    def finish(self) -> None:
        if self._batch or not self.chunks:
            self._seal()
        for future in self._storing:
            future.result()
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Stop, and remove what was written, as far as possible (Redis or the disk may be why it failed)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.store.abort(self.run, self.version, len(self.chunks))

    def _seal(self) -> None:
        self.chunks.append({"size": self._bytes, "xxh3": "", "pieces": self._pieces})
        while len(self._storing) >= STORE_THREADS:
            self._storing.pop(0).result()  # raises what storing an earlier chunk raised
        self._storing.append(self._pool.submit(self._put, len(self.chunks) - 1, self._batch))
        self._batch, self._pieces, self._bytes = [], [], 0

    def _put(self, index: int, tensors: list[torch.Tensor]) -> None:
        parts = [byte_view(t) for t in tensors]
        digest = xxhash.xxh3_128()
        for part in parts:
            digest.update(part)
        self.chunks[index]["xxh3"] = digest.hexdigest()
        self.store.put_chunk(self.run, self.version, index, parts)


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
    are removed. A publication that fails half-way removes what it wrote, as far as it can. A directory store
    then prepares files for the next publication in the background.

    `state` may be an iterator of (name, tensor), consumed one tensor at a time (a sharded learner gathers
    each tensor only when it is written)."""
    check_run(run, ValueError)  # the caller's own
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
    ann = Announcement(version, checksum(manifest), sum(c["size"] for c in chunks), kind, run)
    kept = [(run, version, len(chunks))] + [k for k in _kept(client, keys) if k[:2] != (run, version)]
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.weights_latest, mapping={"version": version, "checksum": ann.checksum, "size": ann.size, "kind": kind, "run": run})
    pipe.delete(keys.weights_kept)
    pipe.rpush(keys.weights_kept, *(f"{r}:{v}:{c}" for r, v, c in kept[:keep]))
    pipe.execute()
    for superseded in kept[keep:]:  # removed only once the new one is the latest: readers of the old get a retry
        store.remove(*superseded)
    if isinstance(store, DirectorySnapshots):
        store.prepare([c["size"] for c in chunks])
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


def parse_announcement(frames: list[bytes]) -> Announcement:
    if len(frames) != 2 or frames[0] != TOPIC:
        raise WeightsError(f"not a weights announcement: {len(frames)} frames")
    try:
        msg = p.decode(frames[1])
        return Announcement(int(msg["version"]), str(msg["checksum"]), int(msg["size"]), str(msg["kind"]), str(msg.get("run", "")))
    except (p.ProtocolError, KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"malformed weights announcement: {e}") from e


def read_manifest(store: SnapshotSource, ann: Announcement) -> tuple[bytes, dict[str, Any]]:
    """The announced snapshot's manifest, its bytes and its contents, checked against the announcement."""
    data = store.manifest(ann.run, ann.version)
    if data is None:
        raise WeightsError(f"snapshot v{ann.version} is not stored (superseded or never stored)")
    if len(data) > MAX_MANIFEST_BYTES:
        raise WeightsError(f"snapshot v{ann.version}'s manifest is {len(data)} bytes, over {MAX_MANIFEST_BYTES}")
    found = checksum(data)
    if found != ann.checksum:
        raise WeightsError(f"snapshot v{ann.version} has manifest checksum {found[:12]}, announced {ann.checksum[:12]}")
    try:
        manifest = msgpack.unpackb(data)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise WeightsError(f"snapshot v{ann.version} has manifest format {manifest.get('format')!r}, not {MANIFEST_FORMAT}")
        if sum(int(c["size"]) for c in manifest["chunks"]) != ann.size:
            raise WeightsError(f"snapshot v{ann.version}'s chunks do not add up to the announced {ann.size} bytes")
        return data, manifest
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
        raise WeightsError(f"snapshot v{ann.version} has a malformed manifest: {e}") from e


@dataclass(frozen=True)
class _Placement:
    """Where one piece of a chunk goes: bytes [offset, offset + len) of the chunk into these rows of a tensor."""

    key: str
    offset: int
    rows: torch.Tensor  # a view of the target tensor (contiguous rows)


def _plan(ann: Announcement, manifest: dict[str, Any], state: Mapping[str, torch.Tensor]) -> list[list[_Placement]]:
    """Every chunk's pieces, checked before a byte is read: each names a listed tensor, fits its rows, follows
    the one before it in the chunk, and every row of every tensor is written exactly once."""
    written = {name: torch.zeros(t.shape[0] if t.dim() else 1, dtype=torch.bool) for name, t in state.items()}
    plan = []
    for index, entry in enumerate(manifest["chunks"]):
        placements, offset = [], 0
        try:
            for key, name, start, end, at in entry["pieces"]:
                target = state.get(name)
                if target is None:
                    raise WeightsError(f"snapshot v{ann.version}'s chunk {index} has piece {key!r} of no listed tensor")
                rows = slice(0, 1) if target.dim() == 0 else slice(int(start), int(end))
                view = target if target.dim() == 0 else target[rows]
                if int(at) != offset or written[name][rows].any() or (target.dim() and view.shape[0] != int(end) - int(start)):
                    raise WeightsError(f"snapshot v{ann.version}: piece {key!r} does not fit its place or overlaps another")
                written[name][rows] = True
                placements.append(_Placement(str(key), offset, view))
                offset += view.numel() * view.element_size()
        except (TypeError, ValueError) as e:
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} has malformed pieces: {e}") from e
        if offset != int(entry["size"]):
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} lists {offset} bytes of pieces, not its {entry['size']}")
        plan.append(placements)
    for name, target in state.items():
        expected = target.shape[0] if target.dim() else 1
        if target.numel() and not bool(written[name].all()):
            raise WeightsError(f"snapshot v{ann.version}: tensor {name!r} has {int(written[name].sum())} of its {expected} rows")
    return plan


def _targets(ann: Announcement, manifest: dict[str, Any], into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The tensors the snapshot fills: the caller's (a staging copy of its model), or new CPU tensors. A tensor
    of the caller's that an earlier name fills already (tied weights) is not filled twice at once: the later
    name gets a tensor of its own."""
    state: dict[str, torch.Tensor] = {}
    claimed: set[int] = set()
    for name, dtype, shape in manifest["tensors"]:
        try:
            want = (DTYPES[dtype], torch.Size(int(n) for n in shape))
            tensor = torch.empty(want[1], dtype=want[0]) if into is None else into.get(str(name))
            if into is not None and tensor is not None and id(tensor) in claimed:  # tied: filled under an earlier name
                tensor = torch.empty(want[1], dtype=want[0])
            claimed.add(id(tensor))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise WeightsError(f"snapshot v{ann.version} lists a tensor this actor cannot build: {e}") from e
        if tensor is None or (tensor.dtype, tensor.shape) != want or not tensor.is_contiguous():
            got = "nothing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
            raise WeightsError(f"snapshot v{ann.version}'s tensor {name!r} ({dtype} {list(want[1])}) does not fit this model's ({got})")
        state[str(name)] = tensor
    return state


def _fill(chunk: ChunkReader, placements: list[_Placement], digest: Any = None) -> None:
    """Each piece of `chunk` into its rows (through host memory for a tensor on a device), `digest` updated
    with the bytes as placed."""
    for placement in placements:
        rows = placement.rows
        staged = rows if rows.device.type == "cpu" else torch.empty(rows.shape, dtype=rows.dtype)
        dest = byte_view(staged)
        chunk.read_into(placement.offset, dest)
        if digest is not None:
            digest.update(dest)
        if staged is not rows:
            # this thread's current device set (not restored) first: leaving the stream block restores the thread's
            # device, which in a new thread is GPU 0, and would open a CUDA context there (another process's GPU)
            torch.cuda.set_device(rows.device)
            with torch.cuda.stream(_copy_stream(rows.device)):  # not the serving thread's stream: its steps do not wait
                rows.copy_(staged)
                torch.cuda.current_stream().synchronize()  # done before the swap reads it


_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    """A CUDA stream of a fetch's own on `device`, for the copies to a staging copy of the weights there."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def _place(store: SnapshotSource, ann: Announcement, index: int, entry: dict[str, Any], placements: list[_Placement]) -> None:
    """Read chunk `index` straight into its tensors' rows, checking its checksum over the bytes as placed (so
    what a concurrent writer did to the stored copy after the check cannot reach the tensors unseen)."""
    chunk = store.open_chunk(ann.run, ann.version, index)
    if chunk is None:
        raise WeightsError(f"snapshot v{ann.version} lacks chunk {index} (superseded while being read?)")
    try:
        if chunk.size != int(entry["size"]):
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} does not match its checksum ({chunk.size} bytes)")
        digest = xxhash.xxh3_128()
        _fill(chunk, placements, digest)
        if digest.hexdigest() != entry["xxh3"]:
            raise WeightsError(f"snapshot v{ann.version}'s chunk {index} does not match its checksum")
    finally:
        chunk.close()


def _copy_chunks(
    source: SnapshotSource, local: SnapshotStore, ann: Announcement, manifest: dict[str, Any], plan: list[list[_Placement]], threads: int
) -> None:
    """Every chunk from the farm's store into this host's copy and into the tensors, each checked before it is
    written anywhere (the bytes received are this process's own: nothing changes them after the check)."""

    def copy(index: int) -> None:
        entry = manifest["chunks"][index]
        chunk = source.open_chunk(ann.run, ann.version, index)
        if chunk is None:
            raise WeightsError(f"snapshot v{ann.version} lacks chunk {index} (superseded while being read?)")
        try:
            if isinstance(chunk, BytesChunk):
                data = chunk.data
            else:
                data = memoryview(bytearray(chunk.size))
                chunk.read_into(0, data)
            if len(data) != int(entry["size"]) or checksum(data) != entry["xxh3"]:
                raise WeightsError(f"snapshot v{ann.version}'s chunk {index} does not match its checksum")
            local.put_chunk(ann.run, ann.version, index, [data])
            _fill(BytesChunk(data), plan[index])
        finally:
            chunk.close()

    _run_all(copy, len(manifest["chunks"]), threads)


def _run_all(work: Any, count: int, threads: int) -> None:
    """work(0) ... work(count - 1), `threads` at a time; the first failure cancels what has not started and is raised."""
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="weights-fetch") as pool:
        futures = [pool.submit(work, index) for index in range(count)]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def fetch(
    client: redis.Redis | None,
    prefix: str,
    ann: Announcement,
    store: SnapshotSource | None = None,
    threads: int = FETCH_THREADS,
    into: Mapping[str, torch.Tensor] | None = None,
    cache: HostCache | None = None,
) -> dict[str, torch.Tensor]:
    """The snapshot of an announcement, every chunk checked against its checksum; all of it, or WeightsError.

    The chunks are read `threads` at a time (the reads and checksums release the GIL), each straight into the
    tensors it fills: `into`'s (shapes and dtypes must match the manifest's), or new CPU tensors. With a host
    `cache`, the chunks are read from this host's copy, which the first actor to want the version makes."""
    if store is None:
        if client is None:
            raise ValueError("fetch needs a store, or the Redis client of one")
        store = RedisSnapshots(client, prefix)
    data, manifest = read_manifest(store, ann)
    state = _targets(ann, manifest, into)
    plan = _plan(ann, manifest, state)
    if cache is not None:
        source, filled = store, []

        def fill(local: DirectorySnapshots) -> None:
            _copy_chunks(source, local, ann, manifest, plan, threads)
            filled.append(True)

        try:
            store = cache.ensure(ann.run, ann.version, data, ann.size, fill)
        except OSError as e:  # no room in the host's shared memory (a container's 64 MB /dev/shm), not this user's folder
            log.warning("no host copy of snapshot v%d (%s): this actor reads it for itself", ann.version, e)
        if filled:  # this process made the host's copy, and placed every chunk on the way
            return state
    chunks = manifest["chunks"]
    _run_all(lambda index: _place(store, ann, index, chunks[index], plan[index]), len(chunks), threads)
    return state
