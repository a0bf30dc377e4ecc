"""`ppoz bench weights`' leg across hosts: a full snapshot from a learner's host to an actor's, over a bridge.

Two network namespaces (tools/reliability/farm_network.py's `Network`) joined by a bridge, as the farm's hosts are:

    learner   publishes --repeats + 1 versions into a directory store on its /dev/shm and serves
              them (common/snapshot_serve.py's SnapshotServer), beside a plain TCP sender
    actor     fetches each (ServedSnapshots, --threads chunks at once) into its tensors and its host
              cache: what the first actor of a host does; the first version is not counted (the
              cache's first files), as a learner's first publication is not

In the same run, legs alternating, medians of --repeats: the bridge's own TCP rate (the plain sender
to a plain receiver, 1 and 4 connections, the better one counts) and the snapshot's. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SERVE_PORT, TCP_PORT = 5558, 5559
BLOCK = 64 << 20


def run_hosts(folder: str, chunk_mb: int, threads: int, repeats: int, deadline_s: float = 600.0) -> dict[str, Any]:
    """The leg, from the root namespace: {"skipped": why} where namespaces cannot be made."""
    from tools.reliability.farm_network import Network, namespaces_unavailable

    why = namespaces_unavailable()
    if why is not None:
        return {"skipped": why}
    net = Network(hosts=("learner", "actor")).create()
    learner: subprocess.Popen[str] | None = None
    try:
        # the hosts' shared memory made here, so that it goes even though the learner's host is killed
        with tempfile.TemporaryDirectory(prefix="ppoz-bench-hosts-") as scratch, tempfile.TemporaryDirectory(dir=_shm()) as shm:
            address = net.addresses["learner"]
            ann = Path(scratch) / "announcement.json"
            serve = [*_me(), "serve", folder, address, str(chunk_mb), str(ann), str(repeats + 1), shm]
            learner = subprocess.Popen(net.command("learner", serve), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            end = time.monotonic() + deadline_s
            while not ann.exists():
                if learner.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"the learner's host did not publish: {_tail(learner)}")
                time.sleep(0.1)
            fetch = [*_me(), "fetch", address, str(ann), str(threads), str(repeats), shm]
            done = subprocess.run(net.command("actor", fetch), capture_output=True, text=True, timeout=max(1.0, end - time.monotonic()))
            if done.returncode:
                raise RuntimeError(f"the actor's host failed: {done.stderr[-2000:]}")
            result: dict[str, Any] = json.loads(done.stdout)
            result["hosts"] = {"learner": address, "actor": net.addresses["actor"]}
            return result
    finally:
        if learner is not None:
            learner.kill()
            learner.wait()
        net.destroy()


def _me() -> list[str]:
    return [sys.executable, "-m", "tools.bench.weights_hosts"]


def _tail(process: subprocess.Popen[str]) -> str:
    if process.poll() is None or process.stderr is None:
        return "still running"
    return process.stderr.read()[-2000:]


def serve(folder: str, address: str, chunk_mb: int, out: str, versions: int, shm: str) -> None:
    """The learner's host: publish `versions` versions, serve their chunks and plain TCP, until killed."""
    from common import weights
    from common.redis_server import EmbeddedRedis, connect
    from common.snapshot_serve import SnapshotServer
    from models.policy_model import ModelSpec, load_policy, policy_state_items

    model, _ = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    with EmbeddedRedis() as server:
        client = connect(server.url)
        store = weights.DirectorySnapshots(Path(shm) / "learner")
        anns = []
        for version in range(1, versions + 1):
            tensors = policy_state_items(model, tied_once=True)
            anns.append(weights.store_snapshot(client, "hosts", version, tensors, "full", "bench", store, chunk_mb << 20, keep=versions))
        snapshots = SnapshotServer(store, f"tcp://{address}:{SERVE_PORT}")
        listener = socket.create_server((address, TCP_PORT), backlog=16)
        threading.Thread(target=_send_forever, args=(listener,), daemon=True).start()
        sums = {name: float(t.double().sum()) for name, t in policy_state_items(model, tied_once=True)}
        tmp = Path(out + ".tmp")
        tmp.write_text(json.dumps({"announcements": [ann.__dict__ for ann in anns], "sums": sums}))
        tmp.replace(out)
        try:
            while True:
                time.sleep(3600)
        finally:
            snapshots.close()


def _shm() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _send_forever(listener: socket.socket) -> None:
    """Each connection sends an 8-byte count, and gets that many bytes back."""
    block = memoryview(os.urandom(1 << 20) * (BLOCK >> 20))

    def send(conn: socket.socket) -> None:
        with conn:
            want = int.from_bytes(_read_exactly(conn, 8), "big")
            while want > 0:
                want -= conn.send(block[: min(want, len(block))])

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=send, args=(conn,), daemon=True).start()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise ConnectionError("the peer closed")
        data += got
    return data


def _tcp(address: str, nbytes: int, connections: int) -> float:
    """Seconds to receive nbytes from the plain sender over `connections` connections at once."""
    share = nbytes // connections

    def receive() -> None:
        with socket.create_connection((address, TCP_PORT), timeout=120) as conn:
            conn.sendall(share.to_bytes(8, "big"))
            buffer = memoryview(bytearray(BLOCK))
            left = share
            while left > 0:
                select.select([conn], [], [], 120)
                got = conn.recv_into(buffer[: min(left, BLOCK)])
                if got == 0:
                    raise ConnectionError("the sender closed early")
                left -= got

    start = time.perf_counter()
    workers = [threading.Thread(target=receive) for _ in range(connections)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def fetch(address: str, announcement: str, threads: int, repeats: int, shm: str) -> None:
    """The actor's host: the legs, alternating; prints one JSON object."""
    import shutil

    from common import weights
    from common.snapshot_serve import ServedSnapshots
    from common.snapshot_stores import HostCache

    published = json.loads(Path(announcement).read_text())
    anns = [weights.Announcement(**ann) for ann in published["announcements"]]
    source = ServedSnapshots(f"tcp://{address}:{SERVE_PORT}")
    legs: dict[str, list[float]] = {"tcp_1": [], "tcp_4": [], "snapshot": []}
    cache_root = str(Path(shm) / "actor-host-cache")
    moved = True

    def fetched(ann: weights.Announcement) -> float:
        start = time.perf_counter()
        state = weights.fetch(None, "hosts", ann, source, threads, cache=HostCache(cache_root))
        seconds = time.perf_counter() - start
        nonlocal moved
        moved = moved and {k: float(v.double().sum()) for k, v in state.items()} == published["sums"]
        return seconds

    try:
        fetched(anns[0])
        for repeat in range(repeats):
            for leg in list(legs) if repeat % 2 == 0 else list(legs)[::-1]:
                if leg == "snapshot":
                    legs[leg].append(fetched(anns[1 + repeat]))
                else:
                    legs[leg].append(_tcp(address, anns[0].size, int(leg[-1])))
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    ann = anns[0]
    medians = {leg: statistics.median(times) for leg, times in legs.items()}
    tcp = ann.size / 1e9 / min(medians["tcp_1"], medians["tcp_4"])
    snapshot = ann.size / 1e9 / medians["snapshot"]
    result = {
        "snapshot_gb": ann.size / 1e9,
        "moved": moved,
        "tcp_gb_per_s": tcp,
        "tcp_1_gb_per_s": ann.size / 1e9 / medians["tcp_1"],
        "tcp_4_gb_per_s": ann.size / 1e9 / medians["tcp_4"],
        "snapshot_gb_per_s": snapshot,
        "snapshot_over_tcp": snapshot / tcp,
        "met": snapshot / tcp >= 0.5,
        "runs": legs,
    }
    print(json.dumps(result))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.weights_hosts", description=__doc__)
    sub = parser.add_subparsers(dest="part", required=True)
    s = sub.add_parser("serve")
    for name in ("folder", "address", "chunk_mb", "out", "versions", "shm"):
        s.add_argument(name)
    f = sub.add_parser("fetch")
    for name in ("address", "announcement", "threads", "repeats", "shm"):
        f.add_argument(name)
    args = parser.parse_args(argv)
    if args.part == "serve":
        serve(args.folder, args.address, int(args.chunk_mb), args.out, int(args.versions), args.shm)
    else:
        fetch(args.address, args.announcement, int(args.threads), int(args.repeats), args.shm)


if __name__ == "__main__":
    main(sys.argv[1:])
