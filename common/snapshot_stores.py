"""Where weight snapshots are kept: Redis keys, a directory, and one copy per host (common/weights.py writes and reads).

A snapshot is a manifest and chunks. A chunk is the raw bytes of its tensor pieces, back to back, in
the order the manifest lists them: nothing to encode or parse, so a chunk in a file is read straight
into the tensors it fills (`os.preadv`), and one in Redis is one GET.

- `RedisSnapshots`: `P:weights:{run}:v{n}` (the manifest) and `P:weights:{run}:v{n}:c{i}` (chunk i).
- `DirectorySnapshots`: `{dir}/{run}-v{n}/manifest.msgpack` and `chunk-00000.bin`, ..., written under a
  hidden temporary name and renamed into place, so a snapshot appears whole or not at all. On one
  host, a directory on a tmpfs (/dev/shm) is shared memory: the learner writes each tensor's bytes
  once and the actors read them from the page cache. Writing into fresh tmpfs pages costs their
  allocation (about 3 GB/s here, where a copy runs at 20): after each publication the store prepares
  files of the same sizes for the next one in the background (`prepare`), while the learner trains.
- `HostCache`: one fetch per host. The first actor on a host to want a version copies it from the
  farm's store into a directory of this host (under a lock file); the others wait on the lock and
  read that copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import redis

from common.segments import RedisKeys

Buffer = bytes | bytearray | memoryview

RUN_ID = re.compile(r"[0-9A-Za-z_-]{0,64}")  # a learner run's id: hex from uuid4 (a word: it names keys and folders)


class WeightsError(RuntimeError):
    """A snapshot that is missing, incomplete, or does not match its announced checksums."""


class WeightsUnavailable(WeightsError):
    """A snapshot that could not be read now (a server that does not answer, a lock held too long): tried again."""


def check_run(run: str, error: type[Exception]) -> None:
    if not RUN_ID.fullmatch(run):
        raise error(f"run id {run[:80]!r} is not a word of letters, digits, '-' and '_'")


class ChunkReader(Protocol):
    """One stored chunk, open for reading: its size, and its bytes at an offset into a buffer of the reader's."""

    size: int

    def read_into(self, offset: int, dest: memoryview) -> None: ...

    def close(self) -> None: ...


class SnapshotSource(Protocol):
    """What a snapshot is read from: a store, or a learner's snapshot server (common/snapshot_serve.py)."""

    def manifest(self, run: str, version: int) -> bytes | None: ...

    def open_chunk(self, run: str, version: int, index: int) -> ChunkReader | None: ...


class SnapshotStore(SnapshotSource, Protocol):
    """Where a snapshot's manifest and chunks are kept (Redis keys or a directory)."""

    def begin(self, run: str, version: int) -> None: ...

    def put_chunk(self, run: str, version: int, index: int, parts: Sequence[Buffer]) -> None:
        """Store chunk `index`: the bytes of `parts`, back to back (called from two threads at once)."""

    def finish(self, run: str, version: int, manifest: bytes) -> None:
        """Store the manifest: after this the whole snapshot can be read."""

    def remove(self, run: str, version: int, chunks: int) -> None: ...

    def abort(self, run: str, version: int, chunks: int) -> None:
        """Remove what a publication that failed half-way wrote (its first `chunks` chunks), as far as possible."""


class BytesChunk:
    """A chunk held in memory (a Redis value)."""

    def __init__(self, data: Buffer) -> None:
        self.data = memoryview(data)
        self.size = len(data)

    def read_into(self, offset: int, dest: memoryview) -> None:
        if offset + len(dest) > self.size:
            raise WeightsError(f"a piece at bytes {offset}-{offset + len(dest)} lies past the chunk's {self.size}")
        dest[:] = self.data[offset : offset + len(dest)]

    def close(self) -> None:
        self.data.release()


class FileChunk:
    """A chunk in a file, read piece by piece straight into the caller's buffers (no copy of the chunk)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def read_into(self, offset: int, dest: memoryview) -> None:
        done = 0
        while done < len(dest):  # preadv may return fewer bytes than asked (a signal, a network file system)
            got = os.preadv(self.fd, [dest[done:]], offset + done)
            if got == 0:
                raise WeightsError(f"a chunk file ended at byte {offset + done}, before its pieces did")
            done += got

    def close(self) -> None:
        os.close(self.fd)


def write_parts(fd: int, parts: Sequence[Buffer]) -> None:
    """`parts` back to back from the file's start (pwritev, which may write less than asked)."""
    offset = 0
    for part in parts:
        view = memoryview(part).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        offset += len(view)
    os.ftruncate(fd, offset)  # a prepared file was the previous snapshot's size: longer, or the same


class RedisSnapshots:
    """Manifest and chunks as Redis strings, each a separate key of at most chunk_bytes."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.keys = RedisKeys(prefix)

    def begin(self, run: str, version: int) -> None:
        pass  # chunks of a version being rewritten (a restarted run) are overwritten; the manifest comes last

    def put_chunk(self, run: str, version: int, index: int, parts: Sequence[Buffer]) -> None:
        self.client.set(self.keys.weights_chunk(run, version, index), b"".join(parts))

    def finish(self, run: str, version: int, manifest: bytes) -> None:
        self.client.set(self.keys.weights_manifest(run, version), manifest)

    def manifest(self, run: str, version: int) -> bytes | None:
        return self.client.get(self.keys.weights_manifest(run, version))

    def open_chunk(self, run: str, version: int, index: int) -> ChunkReader | None:
        data = self.client.get(self.keys.weights_chunk(run, version, index))
        return None if data is None else BytesChunk(data)

    def remove(self, run: str, version: int, chunks: int) -> None:
        names = [self.keys.weights_manifest(run, version)] + [self.keys.weights_chunk(run, version, i) for i in range(chunks)]
        for start in range(0, len(names), 1000):
            self.client.delete(*names[start : start + 1000])

    def abort(self, run: str, version: int, chunks: int) -> None:
        self.remove(run, version, chunks)  # no manifest yet: the chunks written


class DirectorySnapshots:
    """Manifest and chunks as files in a directory (`{dir}/{run}-v{n}/`): mounted by every process of a farm,
    or a tmpfs of one host, where the actors read what the learner wrote from shared memory."""

    MANIFEST = "manifest.msgpack"
    PREPARED = ".prepared"  # files allocated for the next publication (one writer per directory)

    def __init__(self, root: str | os.PathLike[str], mode: int = 0o750) -> None:
        self.root = Path(root)
        self.mode = mode  # the actors read it as the learner's group (docs/farm.md)
        self._writing: Path | None = None
        self._preparing: threading.Thread | None = None
        self._on_tmpfs = on_tmpfs(self.root)

    @staticmethod
    def chunk_name(index: int) -> str:
        return f"chunk-{index:05d}.bin"

    def final(self, run: str, version: int) -> Path:
        check_run(run, WeightsError)  # read from Redis: a bad one is bad input
        return self.root / f"{run or 'norun'}-v{version}"

    def begin(self, run: str, version: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._wait_prepared()
        for stale in self.root.glob(".*-v*.*"):  # a publication a crash or an error cut short (one writer here)
            shutil.rmtree(stale, ignore_errors=True)
        self.final(run, version)  # checks the run id
        self._writing = Path(tempfile.mkdtemp(prefix=f".{run or 'norun'}-v{version}.", dir=self.root))
        self._writing.chmod(self.mode)  # mkdtemp makes it the owner's alone

    def put_chunk(self, run: str, version: int, index: int, parts: Sequence[Buffer]) -> None:
        if self._writing is None:
            raise RuntimeError("put_chunk before begin")
        path = self._writing / self.chunk_name(index)
        prepared = self.root / self.PREPARED / self.chunk_name(index)
        with contextlib.suppress(FileNotFoundError):
            os.replace(prepared, path)  # pages allocated already: the write is a copy, not an allocation
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640)
        try:
            write_parts(fd, parts)
        finally:
            os.close(fd)

    def finish(self, run: str, version: int, manifest: bytes) -> None:
        if self._writing is None:
            raise RuntimeError("finish before begin")
        (self._writing / self.MANIFEST).write_bytes(manifest)
        final = self.final(run, version)
        if final.exists():  # the same version of this run written again (a resumed run): the new one replaces it
            shutil.rmtree(final, ignore_errors=True)
        os.replace(self._writing, final)  # a rename: readers see the directory whole or not at all
        self._writing = None

    def prepare(self, sizes: Sequence[int]) -> None:
        """Have files of these sizes ready for the next publication: the superseded snapshot's, recycled by `remove`,
        topped up in a thread of its own (it waits for none). Only on a tmpfs, where allocating a page is what
        makes a write slow (elsewhere it would only cost space)."""
        self._wait_prepared()
        if not self._on_tmpfs:
            return

        def allocate() -> None:
            folder = self.root / self.PREPARED
            with contextlib.suppress(OSError):  # a full tmpfs: the next publication allocates as it writes
                folder.mkdir(mode=0o700, exist_ok=True)
                for extra in folder.glob("chunk-*.bin"):
                    if int(extra.stem.removeprefix("chunk-")) >= len(sizes):
                        extra.unlink()
                for index, size in enumerate(sizes):
                    fd = os.open(folder / self.chunk_name(index), os.O_WRONLY | os.O_CREAT, 0o640)
                    try:
                        if os.fstat(fd).st_size < size:
                            os.posix_fallocate(fd, 0, size)
                    finally:
                        os.close(fd)

        self._preparing = threading.Thread(target=allocate, name="weights-prepare", daemon=True)
        self._preparing.start()

    def _wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def manifest(self, run: str, version: int) -> bytes | None:
        try:
            return (self.final(run, version) / self.MANIFEST).read_bytes()
        except FileNotFoundError:
            return None

    def open_chunk(self, run: str, version: int, index: int) -> ChunkReader | None:
        try:
            return FileChunk(os.open(self.final(run, version) / self.chunk_name(index), os.O_RDONLY))
        except FileNotFoundError:
            return None

    def remove(self, run: str, version: int, chunks: int) -> None:
        """Remove a snapshot; on a tmpfs its files become the next publication's (freeing and allocating again the
        pages of a model costs more than writing it). A reader still reading it then reads other bytes, which
        the checksum over the bytes it placed refuses: it tries the newest snapshot instead."""
        self.retire(self.final(run, version))

    def retire(self, folder: Path) -> None:
        """Remove a snapshot's folder, or on a tmpfs make its files the next publication's (see `remove`)."""
        with contextlib.suppress(OSError):
            (self.root / self.PREPARED).rmdir()  # only if the last publication took every file in it
        if self._on_tmpfs and not (self.root / self.PREPARED).exists():
            with contextlib.suppress(OSError):
                (folder / self.MANIFEST).unlink()  # nothing names it as a snapshot any more
                os.replace(folder, self.root / self.PREPARED)
                return
        shutil.rmtree(folder, ignore_errors=True)

    def abort(self, run: str, version: int, chunks: int) -> None:
        if self._writing is not None:
            shutil.rmtree(self._writing, ignore_errors=True)
            self._writing = None

    def versions(self) -> list[Path]:
        """The snapshots here, oldest first (by the time they were renamed into place)."""
        found = [p for p in self.root.glob("*-v*") if p.is_dir() and not p.name.startswith(".")]
        return sorted(found, key=lambda p: p.stat().st_mtime_ns)


def on_tmpfs(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (shared memory), by the longest mount point above it."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    real, best = os.path.realpath(path), ("", "")
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best[0]):
                best = (point, fields[2])
    return best[1] == "tmpfs"


def snapshot_store(client: redis.Redis, prefix: str, weights_dir: str = "") -> SnapshotStore:
    """The store a farm's settings name: a shared directory when `weights_dir` is set, else Redis."""
    return DirectorySnapshots(weights_dir) if weights_dir else RedisSnapshots(client, prefix)


def default_host_cache(prefix: str) -> str:
    """A directory of this host's shared memory for its actors' copy of each snapshot ("" where there is none)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return ""
    mine = shm / f"ppoz-{os.getuid()}-weights"
    with contextlib.suppress(FileExistsError):
        mine.mkdir(mode=0o700)  # checked again before use: another user's folder of this name is refused
    return str(mine / prefix)


class HostCache:
    """One copy of each snapshot per host: the first actor that wants a version copies it from the farm's store
    into `root` (checked chunk by chunk on the way), holding a lock file; the others wait for the lock, then
    read that copy. The `keep` newest versions are kept.

    The copy is memory (a tmpfs), so it must not outlive its actors: each holds a shared lock on a second file
    while it uses the cache, and the last one out (`close`), or the first one in after actors that were killed,
    removes what is there."""

    LOCK = ".fill.lock"
    USERS = ".users.lock"

    def __init__(self, root: str | os.PathLike[str], keep: int = 2, wait_s: float = 600.0) -> None:
        self.local = DirectorySnapshots(root, mode=0o700)
        self.keep, self.wait_s = keep, wait_s
        self.fills = 0  # versions this process copied in (the others it found there)
        self._users: int | None = None  # the fd holding this actor's shared lock on USERS

    def _join(self) -> None:
        self.local.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for folder in (self.local.root.parent, self.local.root):  # in a world-writable /dev/shm: this user's alone
            found = os.lstat(folder)
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o022:
                raise OSError(1, f"{folder} is not a folder of this user's own (owner {found.st_uid}, mode {found.st_mode & 0o777:o})")
        path = self.local.root / self.USERS
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                if _try_lock(fd, fcntl.LOCK_EX):  # no other actor uses it: what is there was left by actors that are gone
                    self._wipe()
                self._lock(fd, fcntl.LOCK_SH, self.USERS)  # held until close (or the process's end)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # the last actor removed the cache meanwhile: join it anew
        self._users = fd

    def close(self) -> None:
        """Leave the cache; the last actor to leave removes the copies."""
        if self._users is None:
            return
        if _try_lock(self._users, fcntl.LOCK_EX):  # the last: the copies go, and the folder with them
            self._wipe()
            for name in (self.LOCK, self.USERS):
                (self.local.root / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.local.root.rmdir()
        os.close(self._users)
        self._users = None

    def _wipe(self) -> None:
        for child in self.local.root.iterdir():
            if child.name in (self.LOCK, self.USERS):
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)

    def ensure(self, run: str, version: int, manifest: bytes, size: int, copy: Callable[[DirectorySnapshots], None]) -> DirectorySnapshots:
        """The local store, holding this version with this manifest: found there, or copied in by `copy(local)`
        (which writes every chunk, checked, through `local.put_chunk`) under the host's lock. OSError where the
        host's copy cannot be made (no room for `size` bytes, a folder that is not this user's own)."""
        if self._users is None:
            self._join()
        if self.local.manifest(run, version) == manifest:
            return self.local
        fd = os.open(self.local.root / self.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._lock(fd, fcntl.LOCK_EX, self.LOCK)
            if self.local.manifest(run, version) != manifest:  # not filled by the actor that held the lock before
                kept = self.local.versions()
                for old in kept[: max(0, len(kept) - self.keep + 1)]:
                    self.local.retire(old)  # room first; a reader that has its chunks open reads on, or is refused by its checksum
                room = os.statvfs(self.local.root)
                free = room.f_bavail * room.f_frsize
                if free < size:
                    raise OSError(28, f"{self.local.root} has {free >> 20} MiB free, the snapshot needs {size >> 20}")
                self.local.begin(run, version)
                try:
                    copy(self.local)
                    self.local.finish(run, version, manifest)
                except BaseException:
                    self.local.abort(run, version, 0)
                    raise
                self.fills += 1
            return self.local
        finally:
            os.close(fd)  # releases the lock

    def _lock(self, fd: int, kind: int, name: str) -> None:
        deadline = time.monotonic() + self.wait_s
        while not _try_lock(fd, kind):
            if time.monotonic() > deadline:
                raise WeightsUnavailable(f"another actor has held {self.local.root / name} for over {self.wait_s:.0f} s")
            time.sleep(0.02)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a lock on a file since removed guards nothing)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _try_lock(fd: int, kind: int) -> bool:
    """flock(fd, kind) without waiting: whether it was taken (or changed to `kind`)."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
