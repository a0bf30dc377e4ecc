"""Snapshots across hosts: the learner serves its store's manifests and chunks over ZeroMQ, each host fetches once.

Redis serves a big value from one core at a few hundred MB/s, and a shared directory needs a file
system every host mounts. The learner's `SnapshotServer` (a ROUTER in a thread of its own, `[learner]
weights_serve`) answers two requests, msgpack maps with the usual header:

    {op: "snapshot_manifest", run, version}         -> [header, manifest bytes]  (header {found: bool})
    {op: "snapshot_chunk", run, version, index}     -> [header, chunk bytes]

An error is a reply with `{error: {code, message}}` and no data frame. An actor names the server
(`[actor] weights_source`) and reads through `ServedSnapshots`: a request per chunk on a socket of its
own, `FETCH_THREADS` at a time, each with a deadline. With the host cache (common/snapshot_stores.py)
only the first actor of a host asks; the others read what it copied in: the host relays the snapshot to
its actors. Every chunk is checked against the manifest's checksum on arrival, as from any store.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from common import protocol as p
from common.security import ClientKeys, apply_server
from common.snapshot_stores import Buffer, BytesChunk, ChunkReader, SnapshotSource, WeightsError, WeightsUnavailable, check_run

log = logging.getLogger(__name__)

OP_MANIFEST = "snapshot_manifest"
OP_CHUNK = "snapshot_chunk"
MAX_REQUEST_BYTES = 4096
REPLIES_QUEUED = 4  # replies (chunks of up to 64 MiB) queued per peer: the learner's memory stays bounded
POLL_MS = 200  # how often the server's thread looks at its stop flag


def _request(body: dict[str, Any]) -> tuple[str, str, int, int]:
    """(op, run, version, index) of a request, or ProtocolError naming what is wrong."""
    op, _ = p.check_header(body)
    if op not in (OP_MANIFEST, OP_CHUNK):
        raise p.ProtocolError(p.E_UNKNOWN_OP, f"a snapshot server answers {OP_MANIFEST} and {OP_CHUNK}, not {op!r}")
    run = p.require(body, "run", str, "the learner run's id (a str)")
    try:
        check_run(run, ValueError)
    except ValueError as e:
        raise p.ProtocolError(p.E_BAD_REQUEST, str(e)) from None
    version = p.require(body, "version", int, "the snapshot's version (an int)")
    index = p.require(body, "index", int, "the chunk's index (an int)") if op == OP_CHUNK else 0
    if isinstance(version, bool) or isinstance(index, bool) or version < 0 or index < 0:
        raise p.ProtocolError(p.E_BAD_REQUEST, f"`version` and `index` must be ints of 0 or more, got {version!r}, {index!r}")
    return op, run, version, index


class SnapshotServer:
    """Serves a store's snapshots to actors on other hosts (see the module's docstring)."""

    def __init__(
        self, store: SnapshotSource, endpoint: str, context: zmq.Context | None = None, curve_secret: str = "", allowed: str = ""
    ) -> None:
        self.store = store
        self.sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, REPLIES_QUEUED)  # past it a reply to that peer is dropped; it asks again
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # a request is a small map: a bigger one drops the peer
        self.allow_list = apply_server(self.sock, curve_secret, allowed, "learner snapshots") if curve_secret else None
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.served = 0  # chunks sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="snapshot-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(POLL_MS):
                continue
            frames = self.sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue  # not a DEALER's [id, empty, body]: nothing to answer to
            try:
                reply = self._answer(frames[2])
            except Exception as e:  # noqa: BLE001 - a store that failed (Redis away, a file gone): the peer is told
                log.warning("snapshot request failed: %s", e)
                reply = [p.encode(p.error_body(None, None, p.E_INTERNAL, f"{type(e).__name__}: {e}"))]
            try:
                # a ROUTER drops what it cannot queue (the peer's REPLIES_QUEUED are full): never a wait
                self.sock.send_multipart([frames[0], b"", *reply], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # the peer went away
                log.debug("snapshot reply not sent: %s", e)
        self.sock.close(linger=0)
        if self.allow_list is not None:
            self.allow_list.close()

    def _answer(self, body: bytes) -> list[Buffer]:
        try:
            op, run, version, index = _request(p.decode(body))
        except p.ProtocolError as e:
            return [p.encode(p.error_body(None, None, e.code, e.message))]
        if op == OP_MANIFEST:
            manifest = self.store.manifest(run, version)
            return [p.encode({**p.header(op), "found": manifest is not None}), manifest or b""]
        chunk = self.store.open_chunk(run, version, index)
        if chunk is None:
            return [p.encode({**p.header(op), "found": False}), b""]
        try:  # a copy of its own: a mapping of a file that a tmpfs store recycles could shrink under a queued reply
            data = bytearray(chunk.size)
            chunk.read_into(0, memoryview(data))
        finally:
            chunk.close()
        self.served += 1
        return [p.encode({**p.header(op), "found": True}), data]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class ServedSnapshots:
    """A learner's `SnapshotServer` as a source to read snapshots from (a `SnapshotSource`)."""

    def __init__(
        self, endpoint: str, context: zmq.Context | None = None, curve: ClientKeys | None = None, timeout_s: float = 120.0
    ) -> None:
        self.endpoint, self.curve, self.timeout_s = endpoint, curve, timeout_s
        self.context = context or zmq.Context.instance()

    def _ask(self, op: str, run: str, version: int, index: int = 0) -> zmq.Frame | None:
        """The data frame of the answer, None if the server has no such snapshot or chunk; WeightsError otherwise."""
        sock = self.context.socket(zmq.DEALER)  # a socket per request: requests come from the fetch's threads at once
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))  # no connection to queue on: the same deadline
            if self.curve is not None:
                self.curve.apply(sock)
            sock.connect(self.endpoint)
            request = {**p.header(op, f"{version}:{index}"), "run": run, "version": version, "index": index}
            try:
                sock.send_multipart([b"", p.encode(request)])
            except zmq.Again:
                raise WeightsUnavailable(f"the snapshot server at {self.endpoint} took no request in {self.timeout_s:.0f} s") from None
            if not sock.poll(int(self.timeout_s * 1000)):
                raise WeightsUnavailable(f"the snapshot server at {self.endpoint} did not answer in {self.timeout_s:.0f} s")
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(linger=0)
        try:
            head = p.decode(frames[1].bytes) if len(frames) >= 2 else {}
        except p.ProtocolError as e:
            raise WeightsError(f"the snapshot server at {self.endpoint} answered a malformed header: {e}") from e
        error = head.get("error")
        if error is not None or len(frames) != 3:
            raise WeightsError(f"the snapshot server at {self.endpoint} answered {error or f'{len(frames)} frames'}")
        return frames[2] if head.get("found") is True else None

    def manifest(self, run: str, version: int) -> bytes | None:
        frame = self._ask(OP_MANIFEST, run, version)
        return None if frame is None else frame.bytes

    def open_chunk(self, run: str, version: int, index: int) -> ChunkReader | None:
        frame = self._ask(OP_CHUNK, run, version, index)
        return None if frame is None else BytesChunk(frame.buffer)
