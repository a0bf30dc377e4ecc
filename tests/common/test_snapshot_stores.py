"""Snapshots torn half-way are never applied, in each store; the actors of one host fetch a version once (two
processes, a real redis-server); and files prepared for the next publication on a tmpfs are reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from actor_node.weight_follower import WeightFollower
from actor_node.worker import catch_up
from common import weights
from common.segments import RedisKeys
from common.snapshot_stores import DirectorySnapshots, HostCache, on_tmpfs
from models.policy_model import ModelSpec, load_policy
from tests.common.test_weights import CHUNK, assert_equal_states, chunk_of, mixed_state

REPO = Path(__file__).resolve().parents[2]


def full_weights(folder: str, seed: int) -> dict[str, torch.Tensor]:
    model, _ = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    gen = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def tear(store: weights.SnapshotStore, redis_client, key_prefix: str, old_chunk: bytes, index: int) -> None:
    """Chunk `index` of version 2 as a write cut half-way leaves it: its first half new, the rest the old bytes."""
    new_chunk = chunk_of(store, "run-a", 2, index)
    assert new_chunk is not None and len(new_chunk) == len(old_chunk) and new_chunk != old_chunk
    half = len(new_chunk) // 2
    torn = new_chunk[:half] + old_chunk[half:]
    if isinstance(store, weights.RedisSnapshots):
        redis_client.set(RedisKeys(key_prefix).weights_chunk("run-a", 2, index), torn)
    else:
        (store.final("run-a", 2) / DirectorySnapshots.chunk_name(index)).write_bytes(torn)


@pytest.mark.parametrize("kind", ["redis", "directory", "host"])
def test_a_snapshot_torn_half_way_is_never_applied(tiny_models, redis_client, key_prefix, tmp_path, kind) -> None:
    """Version 2's chunk 3 is half new, half old bytes (a write cut off, a reader racing a rewrite). The actor keeps
    serving version 1 exactly, says why, and through a host cache nothing of version 2 is kept on the host."""
    folder = tiny_models["llama"]
    v1, v2 = full_weights(folder, 1), full_weights(folder, 2)
    store = weights.snapshot_store(redis_client, key_prefix, str(tmp_path / "farm") if kind == "directory" else "")
    weights.store_snapshot(redis_client, key_prefix, 1, v1, "full", "run-a", store=store, chunk_bytes=CHUNK * 16)
    old_chunk = chunk_of(store, "run-a", 1, 3)
    weights.store_snapshot(redis_client, key_prefix, 2, v2, "full", "run-a", store=store, chunk_bytes=CHUNK * 16)
    tear(store, redis_client, key_prefix, old_chunk, 3)
    model, tokenizer = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    policy = LLMPolicy(model, tokenizer, SamplingConfig())
    policy.set_weights(v1, 1, "run-a")
    cache = str(tmp_path / "host") if kind == "host" else ""
    follower = WeightFollower(
        redis_client, key_prefix, poll_s=0.0, weights_dir=str(tmp_path / "farm") if kind == "directory" else "", cache_dir=cache
    )
    assert not catch_up(policy, follower, wait=True)
    assert policy.policy_version == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, v1[name]), name
    if kind == "host":
        assert [p.name for p in (tmp_path / "host").iterdir() if not p.name.startswith(".")] == [], "a torn copy was kept"
    # The next version, whole, is applied.
    weights.store_snapshot(redis_client, key_prefix, 3, v2, "full", "run-a", store=store, chunk_bytes=CHUNK * 16)
    assert catch_up(policy, follower, wait=True) and policy.policy_version == 3
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, v2[name]), name
    follower.close()


def test_a_snapshot_whose_chunk_file_was_cut_short_is_refused(redis_client, key_prefix, tmp_path) -> None:
    store = DirectorySnapshots(tmp_path / "farm")
    ann = weights.store_snapshot(redis_client, key_prefix, 1, mixed_state(), "full", "run-a", store=store, chunk_bytes=CHUNK)
    path = store.final("run-a", 1) / DirectorySnapshots.chunk_name(2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(weights.WeightsError, match="chunk 2 does not match its checksum"):
        weights.fetch(redis_client, key_prefix, ann, store)


def test_a_tensor_that_does_not_fit_the_staging_copy_is_named(redis_client, key_prefix) -> None:
    state = mixed_state()
    ann = weights.store_snapshot(redis_client, key_prefix, 1, state, "full", "run-a", chunk_bytes=CHUNK)
    into = {name: torch.empty_like(t.contiguous()) for name, t in state.items()}
    into["norm.weight"] = torch.empty(1024)
    with pytest.raises(
        weights.WeightsError, match=r"'norm.weight' \(float32 \[1025\]\) does not fit this model's \(torch.float32 \[1024\]\)"
    ):
        weights.fetch(redis_client, key_prefix, ann, into=into)
    into["norm.weight"] = torch.empty(1025)
    got = weights.fetch(redis_client, key_prefix, ann, into=into)
    assert_equal_states(got, {k: v.contiguous() for k, v in state.items()})
    assert all(got[name] is into[name] for name in state), "fetched into the caller's tensors, not new ones"


ACTOR = """
import json, sys, time
from pathlib import Path
from common import weights
from common.redis_server import connect
from common.snapshot_stores import HostCache

url, prefix, cache_dir, barrier = sys.argv[1:5]
client = connect(url)
reads = []

class Slow(weights.RedisSnapshots):  # a farm store across a network: a chunk takes a while
    def open_chunk(self, run, version, index):
        reads.append(index)
        time.sleep(0.05)
        return super().open_chunk(run, version, index)

Path(barrier + "." + str(__import__("os").getpid())).touch()
while not Path(barrier).exists():
    time.sleep(0.01)
cache = HostCache(cache_dir)
ann = weights.latest(client, prefix)
state = weights.fetch(client, prefix, ann, Slow(client, prefix), threads=2, cache=cache)
# stay until both have fetched: an actor that is gone leaves the cache to be wiped by the next one in, and on a busy
# machine the other may start its fetch only after this one has finished
Path(barrier + ".done." + str(__import__("os").getpid())).touch()
end = time.monotonic() + 120
while len(list(Path(barrier).parent.glob(Path(barrier).name + ".done.*"))) < 2 and time.monotonic() < end:
    time.sleep(0.01)
print(json.dumps({"fills": cache.fills, "reads": len(reads), "sums": {k: float(v.double().sum()) for k, v in state.items()}}))
"""


def test_two_actors_on_one_host_fetch_a_version_once(redis_url, redis_client, key_prefix, tmp_path) -> None:
    """Two actor processes want the same version at once: one copies it from Redis into the host's cache, the other
    waits for the lock and reads that copy. Redis serves each chunk once; both get the whole snapshot."""
    state = mixed_state()
    weights.store_snapshot(redis_client, key_prefix, 1, state, "full", "run-a", chunk_bytes=CHUNK)
    chunks = len(msgpack.unpackb(redis_client.get(RedisKeys(key_prefix).weights_manifest("run-a", 1)))["chunks"])
    barrier = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", ACTOR, redis_url, key_prefix, "cache", str(barrier)]
    actors = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.[0-9]*"))) < 2:  # both started: they ask at the same moment
        assert time.monotonic() < deadline and all(a.poll() is None for a in actors), [a.communicate() for a in actors]
        time.sleep(0.02)
    barrier.touch()
    outs = []
    for actor in actors:
        out, err = actor.communicate(timeout=120)
        assert actor.returncode == 0, err[-3000:]
        outs.append(json.loads(out))
    assert sorted(o["fills"] for o in outs) == [0, 1]
    assert sum(o["reads"] for o in outs) == chunks, "a chunk was read from Redis more than once"
    want = {k: float(v.double().sum()) for k, v in state.items()}
    assert outs[0]["sums"] == outs[1]["sums"] == want
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == ["run-a-v1"]


def test_the_host_cache_keeps_the_newest_versions(redis_client, key_prefix, tmp_path) -> None:
    cache = HostCache(tmp_path / "cache", keep=2)
    for version in range(1, 5):
        ann = weights.store_snapshot(redis_client, key_prefix, version, {"w": torch.full((3,), float(version))}, "full", "run-a")
        got = weights.fetch(redis_client, key_prefix, ann, cache=cache)
        assert torch.equal(got["w"], torch.full((3,), float(version)))
        time.sleep(0.01)  # distinct modification times
    assert cache.fills == 4
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")) == ["run-a-v3", "run-a-v4"]


SHM = Path("/dev/shm")


@pytest.mark.skipif(not (SHM.is_dir() and os.access(SHM, os.W_OK) and on_tmpfs(SHM)), reason="no writable tmpfs at /dev/shm")
def test_files_prepared_on_a_tmpfs_are_written_into_and_cut_to_size(redis_client, key_prefix, tmp_path) -> None:
    """After a publication on a tmpfs, files of its chunks' sizes wait for the next one (their pages allocated
    while the learner trains); the next publication writes into them and cuts each to its own size."""
    root = SHM / f"ppoz-test-{os.getpid()}-{tmp_path.name}"
    try:
        store = DirectorySnapshots(root)
        big = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(500, dtype=torch.bfloat16)}
        weights.store_snapshot(redis_client, key_prefix, 1, big, "full", "run-a", store=store, chunk_bytes=CHUNK)
        store._wait_prepared()
        prepared = sorted((root / DirectorySnapshots.PREPARED).iterdir())
        sizes = [p.stat().st_size for p in prepared]
        inodes = {p.name: p.stat().st_ino for p in prepared}
        assert sum(sizes) == 3000 * 4 + 500 * 2 and len(prepared) >= 3
        small = {"a": torch.arange(100, dtype=torch.float32) * 2, "b": torch.zeros(7, dtype=torch.bfloat16)}  # less in each chunk
        ann = weights.store_snapshot(redis_client, key_prefix, 2, small, "full", "run-a", store=store, chunk_bytes=CHUNK)
        written = store.final("run-a", 2)
        assert inodes[DirectorySnapshots.chunk_name(0)] == (written / DirectorySnapshots.chunk_name(0)).stat().st_ino, "not reused"
        assert_equal_states(weights.fetch(redis_client, key_prefix, ann, store), small)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


KILLED_ACTOR = """
import os, sys
from common import weights
from common.redis_server import connect
from common.snapshot_stores import HostCache
client = connect(sys.argv[1])
weights.fetch(client, sys.argv[2], weights.latest(client, sys.argv[2]), cache=HostCache(sys.argv[3]))
os._exit(0)  # as a killed actor: no close
"""


def test_the_host_copy_goes_with_the_last_actor_and_what_a_killed_one_left_goes_with_the_next(
    redis_url, redis_client, key_prefix, tmp_path
) -> None:
    """The copies are memory: they must not outlive the actors that use them."""
    weights.store_snapshot(redis_client, key_prefix, 1, mixed_state(), "full", "run-a", chunk_bytes=CHUNK)
    ann = weights.latest(redis_client, key_prefix)
    root = tmp_path / "cache"

    def copies() -> list[str]:
        return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []

    first, second = HostCache(root), HostCache(root)
    weights.fetch(redis_client, key_prefix, ann, cache=first)
    weights.fetch(redis_client, key_prefix, ann, cache=second)
    first.close()
    assert copies() == ["run-a-v1"], "removed while another actor still uses it"
    second.close()
    assert not root.exists(), "the last actor left its copy in memory"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", KILLED_ACTOR, redis_url, key_prefix, str(root)], env=env, capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr[-2000:]
    assert copies() == ["run-a-v1"]
    third = HostCache(root)
    weights.fetch(redis_client, key_prefix, ann, cache=third)
    assert third.fills == 1, "the next actor found the killed one's copy instead of starting afresh"
    third.close()
    assert not root.exists()


def test_a_host_cache_in_a_folder_others_may_write_is_not_used(redis_client, key_prefix, tmp_path, caplog) -> None:
    """/dev/shm is everyone's: a cache folder another user could write into (or own) would let them swap the
    weights. It is refused by name and the actor reads the snapshot for itself."""
    state = mixed_state()
    ann = weights.store_snapshot(redis_client, key_prefix, 1, state, "full", "run-a", chunk_bytes=CHUNK)
    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o777)
    cache = HostCache(shared / key_prefix)
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, cache=cache), state)
    assert cache.fills == 0 and "is not a folder of this user's own" in caplog.text
    assert not list((shared / key_prefix).glob("run-a-*"))


def test_a_server_that_does_not_answer_now_is_tried_again_later(tiny_models, redis_client, key_prefix, tmp_path) -> None:
    """A snapshot that could not be read now is not refused as a damaged one would be: the next poll tries it again."""
    import zmq

    from common.snapshot_serve import ServedSnapshots, SnapshotServer

    folder = tiny_models["llama"]
    model, tokenizer = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    policy = LLMPolicy(model, tokenizer, SamplingConfig())
    learner = DirectorySnapshots(tmp_path / "learner")
    new = full_weights(folder, 3)
    weights.store_snapshot(redis_client, key_prefix, 1, new, "full", "run-a", store=learner)
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    follower = WeightFollower(redis_client, key_prefix, poll_s=0.0)
    follower.store = ServedSnapshots(silent.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=0.3)
    try:
        assert not catch_up(policy, follower, wait=True)
        assert follower.refused is None and policy.policy_version == 0
    finally:
        silent.close()
    server = SnapshotServer(learner, "tcp://127.0.0.1:*")
    try:
        follower.store = ServedSnapshots(server.endpoint)
        assert catch_up(policy, follower, wait=True) and policy.policy_version == 1
        assert all(torch.equal(t, new[name]) for name, t in model.state_dict().items())
    finally:
        server.close()
        follower.close()
