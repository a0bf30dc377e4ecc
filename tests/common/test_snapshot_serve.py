"""The learner's snapshot server (common/snapshot_serve.py) on real ZeroMQ sockets: actors fetch a snapshot's
chunks from it through a host cache, every chunk checked; bad requests get errors that name the fault; a
server that does not answer is a deadline, not a hang."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from common import protocol as p
from common import weights
from common.snapshot_serve import OP_CHUNK, ServedSnapshots, SnapshotServer
from common.snapshot_stores import DirectorySnapshots, HostCache
from tests.common.test_weights import CHUNK, assert_equal_states, mixed_state


@pytest.fixture
def served(redis_client, key_prefix, tmp_path):
    store = DirectorySnapshots(tmp_path / "learner")
    server = SnapshotServer(store, "tcp://127.0.0.1:*")
    yield store, server
    server.close()


def test_an_actor_fetches_a_snapshot_from_the_learners_server_through_its_host_cache(redis_client, key_prefix, tmp_path, served) -> None:
    store, server = served
    state = mixed_state()
    ann = weights.store_snapshot(redis_client, key_prefix, 4, state, "full", "run-a", store=store, chunk_bytes=CHUNK)
    source = ServedSnapshots(server.endpoint)
    first, second = HostCache(tmp_path / "host"), HostCache(tmp_path / "host")
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, source, threads=3, cache=first), state)
    chunks = server.served
    assert chunks >= 10
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, source, cache=second), state)
    assert (first.fills, second.fills, server.served) == (1, 0, chunks), "the second actor asked the learner again"
    # Without a cache, straight from the server; a version it does not have is named.
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, source), state)
    missing = weights.Announcement(9, ann.checksum, ann.size, "full", "run-a")
    with pytest.raises(weights.WeightsError, match="v9 is not stored"):
        weights.fetch(redis_client, key_prefix, missing, source)


def test_a_chunk_damaged_at_the_learner_is_refused_on_arrival(redis_client, key_prefix, tmp_path, served) -> None:
    store, server = served
    ann = weights.store_snapshot(redis_client, key_prefix, 1, mixed_state(), "full", "run-a", store=store, chunk_bytes=CHUNK)
    path = store.final("run-a", 1) / DirectorySnapshots.chunk_name(2)
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(weights.WeightsError, match="chunk 2 does not match its checksum"):
        weights.fetch(redis_client, key_prefix, ann, ServedSnapshots(server.endpoint), cache=HostCache(tmp_path / "host"))
    assert not [q for q in (tmp_path / "host").iterdir() if not q.name.startswith(".")], "a damaged copy was kept on the host"


def ask(endpoint: str, body: bytes) -> list[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", body])
        assert sock.poll(10_000), "no answer"
        return sock.recv_multipart()
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b"\xc1not msgpack", p.E_BAD_REQUEST, "not valid msgpack"),
        (p.encode({**p.header("snapshot_delete", "r1"), "run": "a", "version": 1}), p.E_UNKNOWN_OP, "snapshot_delete"),
        (p.encode({**p.header(OP_CHUNK, "r1"), "run": "../etc", "version": 1, "index": 0}), p.E_BAD_REQUEST, "run id"),
        (p.encode({**p.header(OP_CHUNK, "r1"), "run": "a", "version": -1, "index": 0}), p.E_BAD_REQUEST, "0 or more"),
        (p.encode({**p.header(OP_CHUNK, "r1"), "run": "a", "version": 1}), p.E_BAD_REQUEST, "`index` is missing"),
    ],
)
def test_a_bad_request_is_answered_with_an_error_that_names_it(served, body, code, words) -> None:
    _, server = served
    frames = ask(server.endpoint, body)
    assert len(frames) == 2
    error = p.decode(frames[1])["error"]
    assert error["code"] == code and words in error["message"]


def test_an_absurdly_large_request_is_dropped_and_the_server_serves_on(redis_client, key_prefix, served) -> None:
    store, server = served
    ann = weights.store_snapshot(redis_client, key_prefix, 1, {"w": torch.ones(3)}, "full", "run-a", store=store)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send_multipart([b"", b"x" * (30 << 20)])  # 30 MB: over the request limit, the connection is dropped
    assert not sock.poll(500)
    sock.close()
    got = weights.fetch(redis_client, key_prefix, ann, ServedSnapshots(server.endpoint))
    assert torch.equal(got["w"], torch.ones(3))


def test_a_server_that_does_not_answer_is_a_deadline() -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # binds, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        source = ServedSnapshots(silent.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(weights.WeightsError, match="did not answer in 0 s|did not answer in 1 s"):
            source.manifest("run-a", 1)
        assert time.monotonic() - started < 30
    finally:
        silent.close()


def test_an_actor_named_a_weights_source_follows_the_learner_through_its_host_cache(
    tiny_models, redis_client, key_prefix, tmp_path, served
) -> None:
    """WeightFollower(source=...) as `ppoz actor --weights-source` makes it: the announcement from Redis, the
    chunks from the learner's server, one copy on the host."""
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from actor_node.weight_follower import WeightFollower
    from actor_node.worker import catch_up
    from models.policy_model import ModelSpec, load_policy, policy_state_dict

    store, server = served
    learner, _ = load_policy(ModelSpec(model=tiny_models["qwen2"], device="cpu", lora_rank=0))
    with torch.no_grad():
        for param in learner.parameters():
            param.add_(1.0)
    weights.store_snapshot(redis_client, key_prefix, 2, policy_state_dict(learner), "full", "run-a", store=store)
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["qwen2"], device="cpu", lora_rank=0))
    policy = LLMPolicy(model, tokenizer, SamplingConfig())
    follower = WeightFollower(redis_client, key_prefix, poll_s=0.0, source=server.endpoint, cache_dir=str(tmp_path / "host"))
    try:
        assert catch_up(policy, follower, wait=True) and policy.policy_version == 2
        assert all(torch.equal(t, learner.state_dict()[name]) for name, t in model.state_dict().items())
        assert follower.cache is not None and follower.cache.fills == 1
    finally:
        follower.close()
    assert not (tmp_path / "host").exists(), "the host copy outlived its only actor"


def test_the_host_cache_is_where_snapshots_come_over_a_network(tmp_path) -> None:
    from actor_node.weight_follower import host_cache_dir
    from common.shared_settings import StoreSettings

    redis_only = StoreSettings(redis_url="redis://x", key_prefix="farm")
    shm = StoreSettings(redis_url="redis://x", key_prefix="farm", weights_dir="/dev/shm/ppoz-weights")
    nfs = StoreSettings(redis_url="redis://x", key_prefix="farm", weights_dir=str(tmp_path / "mnt"))
    auto = host_cache_dir("auto", redis_only)
    assert auto.endswith("/farm") and "weights" in auto
    assert host_cache_dir("auto", shm) == ""  # a tmpfs directory is the host's copy already
    assert host_cache_dir("auto", nfs) == auto  # a shared file system: one read per host, not per actor
    assert host_cache_dir("auto", shm, source="tcp://learner:5558") == auto
    assert host_cache_dir("off", redis_only) == "" and host_cache_dir("/srv/cache", redis_only) == "/srv/cache"
