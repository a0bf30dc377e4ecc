"""Chunked weight snapshots (common/weights.py) in both stores, on a real redis-server: tensors of every
shape and dtype the policies have, split across chunks, round-trip exactly; damage anywhere is refused by
name; old snapshots are removed; and a full snapshot over Redis's 512 MB value limit is published,
fetched by an actor and applied."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import redis as redis_py
import torch
import xxhash

from common import weights
from common.segments import RedisKeys

CHUNK = 4096  # bytes of tensor data per chunk: small, so a few tensors already span many chunks


def mixed_state() -> dict[str, torch.Tensor]:
    """Shapes a policy has: a big embedding split by rows, odd row counts, a vector, a scalar, an empty
    tensor, a non-contiguous view, bf16, integers and booleans."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(301, 17, generator=g),  # 20 KB: six chunks of rows
        "layer.0.q_proj.lora_A.weight": torch.randn(4, 33, generator=g),
        "layer.0.q_proj.lora_B.weight": torch.randn(33, 4, generator=g).t(),  # not contiguous
        "norm.weight": torch.randn(1025, generator=g),  # one dimension, bigger than a chunk
        "head.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "logit_scale": torch.tensor(0.125),
        "empty": torch.empty(0, 5),
        "positions": torch.arange(2000, dtype=torch.int64).reshape(1000, 2),
        "mask": torch.rand(40, generator=g) > 0.5,
    }


@pytest.fixture(params=["redis", "directory"])
def store(request, redis_client, key_prefix, tmp_path) -> weights.SnapshotStore:
    return weights.snapshot_store(redis_client, key_prefix, str(tmp_path / "weights") if request.param == "directory" else "")


def chunk_of(store: weights.SnapshotStore, run: str, version: int, index: int) -> bytes | None:
    """A stored chunk's bytes, or None."""
    chunk = store.open_chunk(run, version, index)
    if chunk is None:
        return None
    data = bytearray(chunk.size)
    chunk.read_into(0, memoryview(data))
    chunk.close()
    return bytes(data)


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_a_snapshot_round_trips_exactly_through_many_chunks(redis_client, key_prefix, store):
    state = mixed_state()
    ann = weights.store_snapshot(redis_client, key_prefix, 1, state, "full", "run-a", store=store, chunk_bytes=CHUNK)
    assert weights.latest(redis_client, key_prefix) == ann
    manifest = msgpack.unpackb(store.manifest("run-a", 1))
    assert xxhash.xxh3_128_hexdigest(store.manifest("run-a", 1)) == ann.checksum
    assert len(manifest["chunks"]) >= 10, "the big tensors must be split"
    for index, entry in enumerate(manifest["chunks"]):
        data = chunk_of(store, "run-a", 1, index)
        assert len(data) == entry["size"] <= CHUNK and xxhash.xxh3_128_hexdigest(data) == entry["xxh3"]
    # A chunk is its pieces' raw bytes back to back: the embedding's first rows are where its piece says.
    first = next(c for c in manifest["chunks"] if c["pieces"][0][1] == "embed.weight")
    key, _, start, end, offset = first["pieces"][0]
    data = chunk_of(store, "run-a", 1, manifest["chunks"].index(first))
    rows = torch.frombuffer(bytearray(data[offset : offset + (end - start) * 17 * 4]), dtype=torch.float32).view(end - start, 17)
    assert torch.equal(rows, state["embed.weight"][start:end]), key
    assert ann.size == sum(entry["size"] for entry in manifest["chunks"])
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, store, threads=3), state)


def test_a_generator_is_consumed_one_tensor_at_a_time(redis_client, key_prefix, store):
    """A sharded learner gathers a tensor only when it is written: the publisher must not collect them first."""
    state = mixed_state()
    taken: list[str] = []

    def gathered():
        for name, tensor in state.items():
            taken.append(name)
            yield name, tensor

    ann = weights.store_snapshot(redis_client, key_prefix, 1, gathered(), "full", "run-a", store=store, chunk_bytes=CHUNK)
    assert taken == list(state)
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, store), state)


@pytest.mark.parametrize("damage", ["chunk_byte", "chunk_missing", "manifest_byte", "announced_size"])
def test_damage_anywhere_is_refused_by_name(redis_client, key_prefix, tmp_path, damage):
    store = weights.RedisSnapshots(redis_client, key_prefix)
    keys = RedisKeys(key_prefix)
    ann = weights.store_snapshot(redis_client, key_prefix, 2, mixed_state(), "full", "run-a", store=store, chunk_bytes=CHUNK)
    chunk3 = keys.weights_chunk("run-a", 2, 3)
    if damage == "chunk_byte":
        data = bytearray(redis_client.get(chunk3))
        data[-1] ^= 1
        redis_client.set(chunk3, bytes(data))
        expected = "chunk 3 does not match its checksum"
    elif damage == "chunk_missing":
        redis_client.delete(chunk3)
        expected = "lacks chunk 3"
    elif damage == "manifest_byte":
        manifest = bytearray(redis_client.get(keys.weights_manifest("run-a", 2)))
        manifest[10] ^= 1
        redis_client.set(keys.weights_manifest("run-a", 2), bytes(manifest))
        expected = "manifest checksum"
    else:
        ann = weights.Announcement(ann.version, ann.checksum, ann.size + 1, ann.kind, ann.run)
        expected = "do not add up"
    with pytest.raises(weights.WeightsError, match=expected):
        weights.fetch(redis_client, key_prefix, ann, store)


def test_old_snapshots_are_removed_and_a_rewritten_version_leaves_nothing_behind(redis_client, key_prefix, store, tmp_path):
    state = mixed_state()
    for version in range(1, 6):
        weights.store_snapshot(redis_client, key_prefix, version, state, "full", "run-a", store=store, chunk_bytes=CHUNK, keep=2)
    assert [store.manifest("run-a", v) is not None for v in range(1, 6)] == [False, False, False, True, True]
    assert all(chunk_of(store, "run-a", v, 0) is None for v in (1, 2, 3))
    # A resumed run writes version 5 again, smaller: the longer one's chunks must not linger.
    small = {"norm.weight": state["norm.weight"][:10]}
    ann = weights.store_snapshot(redis_client, key_prefix, 5, small, "full", "run-a", store=store, chunk_bytes=CHUNK, keep=2)
    assert_equal_states(weights.fetch(redis_client, key_prefix, ann, store), small)
    assert chunk_of(store, "run-a", 5, 1) is None
    # A new run (versions from 1 again) pushes the old run's snapshots out in turn.
    for version in (1, 2):
        weights.store_snapshot(redis_client, key_prefix, version, small, "full", "run-b", store=store, chunk_bytes=CHUNK, keep=2)
    assert store.manifest("run-a", 4) is None and store.manifest("run-a", 5) is None
    if isinstance(store, weights.RedisSnapshots):
        left = sorted(k.decode() for k in redis_client.scan_iter(f"{key_prefix}:weights:*"))
        assert left == sorted(
            f"{key_prefix}:weights:{name}" for name in ("latest", "kept", "run-b:v1", "run-b:v1:c0", "run-b:v2", "run-b:v2:c0")
        )
    else:
        assert sorted(p.name for p in Path(store.root).iterdir() if p.name != ".prepared") == ["run-b-v1", "run-b-v2"]


def test_a_reader_never_sees_a_half_written_directory_snapshot(redis_client, key_prefix, tmp_path):
    """Chunks are written under a hidden temporary name: until the rename, the version does not exist."""
    store = weights.DirectorySnapshots(tmp_path)
    store.begin("run-a", 1)
    store.put_chunk("run-a", 1, 0, [b"x"])
    assert store.manifest("run-a", 1) is None and chunk_of(store, "run-a", 1, 0) is None
    store.finish("run-a", 1, b"m")
    assert (store.manifest("run-a", 1), chunk_of(store, "run-a", 1, 0)) == (b"m", b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["run-a-v1"]


@pytest.mark.slow
def test_a_full_snapshot_over_512_mb_is_published_fetched_and_applied(redis_client, key_prefix, tiny_models):
    """Redis refuses a value over 512 MB (proto-max-bulk-len): a full fine-tune of ~150M float32 parameters
    could not publish as one value. In chunks it is, and an actor applies it through its own path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from actor_node.weight_follower import WeightFollower
    from actor_node.worker import catch_up
    from models.policy_model import policy_state_dict

    config = LlamaConfig(
        vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16
    )
    torch.manual_seed(0)
    learner_model = LlamaForCausalLM(config)
    torch.manual_seed(1)
    actor_model = LlamaForCausalLM(config)
    state = policy_state_dict(learner_model)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert nbytes > 512 * 2**20, f"{nbytes} bytes: not over Redis's value limit"
    weights.store_snapshot(redis_client, key_prefix, 7, state, "full", "run-big")
    keys = RedisKeys(key_prefix)
    chunks = len(msgpack.unpackb(redis_client.get(keys.weights_manifest("run-big", 7)))["chunks"])
    assert chunks >= 9 and max(redis_client.strlen(keys.weights_chunk("run-big", 7, i)) for i in range(chunks)) < 65 * 2**20

    policy = LLMPolicy(actor_model, AutoTokenizer.from_pretrained(tiny_models["llama"]), SamplingConfig(), "per_candidate")
    follower = WeightFollower(redis_client, key_prefix, poll_s=0.0)
    assert catch_up(policy, follower, wait=True), "the actor did not load the snapshot"
    assert (policy.policy_version, policy.policy_run) == (7, "run-big")
    for name, tensor in actor_model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def republish(redis_client, key_prefix, manifest: dict) -> weights.Announcement:
    """`manifest` stored in place of version 2's, announced with its own checksum: damage a checksum cannot see."""
    data = msgpack.packb(manifest)
    redis_client.set(RedisKeys(key_prefix).weights_manifest("run-a", 2), data)
    return weights.Announcement(2, xxhash.xxh3_128_hexdigest(data), sum(c["size"] for c in manifest["chunks"]), "full", "run-a")


@pytest.mark.parametrize("fault", ["overlapping", "missing_rows", "malformed_piece", "unknown_dtype", "absurd_shape"])
def test_a_manifest_with_its_own_checksum_is_still_checked_piece_by_piece(redis_client, key_prefix, fault):
    """A manifest whose checksum matches (a buggy or hostile writer) must not leave rows of torch.empty garbage."""
    ann = weights.store_snapshot(redis_client, key_prefix, 2, mixed_state(), "full", "run-a", chunk_bytes=CHUNK)
    manifest = msgpack.unpackb(redis_client.get(RedisKeys(key_prefix).weights_manifest("run-a", 2)))
    split = next(c for c in manifest["chunks"] if any(p[0].startswith("embed.weight@") for p in c["pieces"]))
    piece = next(p for p in split["pieces"] if p[0].startswith("embed.weight@"))
    if fault == "overlapping":  # the same rows twice: a count of rows would add up, a mask does not
        other = next(c for c in manifest["chunks"] if c is not split)
        other["pieces"] = [p for p in other["pieces"] if not p[0].startswith("embed.weight@")]
        split["pieces"].append(list(piece))
        expected = "overlaps"
    elif fault == "missing_rows":  # the chunk's last piece gone, and its size made to agree
        last = split["pieces"].pop()
        split["size"] = last[4]
        expected = "rows"
    elif fault == "malformed_piece":
        piece[2] = "zero"
        expected = "malformed pieces"
    elif fault == "absurd_shape":  # 4e18 bytes: refused by name, not an attempt to allocate them
        manifest["tensors"][0][2] = [10**12, 10**6]
        expected = "cannot build"
    else:
        manifest["tensors"][0][1] = "complex128"
        expected = "cannot build"
    with pytest.raises(weights.WeightsError, match=expected):
        weights.fetch(redis_client, key_prefix, republish(redis_client, key_prefix, manifest))
    assert ann.version == 2


class RedisLostAtTheThirdChunk(weights.RedisSnapshots):
    def put_chunk(self, run, version, index, parts):
        if (version, index) == (2, 2):
            raise redis_py.ConnectionError("Connection closed by server (injected)")
        super().put_chunk(run, version, index, parts)


class DiskFullAtTheThirdChunk(weights.DirectorySnapshots):
    def put_chunk(self, run, version, index, parts):
        if (version, index) == (2, 2):
            raise OSError(28, "No space left on device (injected)")
        super().put_chunk(run, version, index, parts)


@pytest.mark.parametrize("kind", ["redis", "directory"])
def test_a_publication_that_fails_half_way_leaves_nothing_behind(redis_client, key_prefix, tmp_path, kind):
    """A store that fails on the third chunk (Redis gone, a full disk): the chunks written are removed, the latest
    snapshot stays the one before, and the kept list is the one before."""
    state = mixed_state()
    store = RedisLostAtTheThirdChunk(redis_client, key_prefix) if kind == "redis" else DiskFullAtTheThirdChunk(tmp_path / "w")
    first = weights.store_snapshot(redis_client, key_prefix, 1, state, "full", "run-a", store=store, chunk_bytes=CHUNK)
    with pytest.raises((OSError, redis_py.ConnectionError), match="injected"):
        weights.store_snapshot(redis_client, key_prefix, 2, state, "full", "run-a", store=store, chunk_bytes=CHUNK)
    assert weights.latest(redis_client, key_prefix) == first
    assert redis_client.lrange(RedisKeys(key_prefix).weights_kept, 0, -1) == [b"run-a:1:" + str(len_chunks(store)).encode()]
    assert all(chunk_of(store, "run-a", 2, i) is None for i in range(3)) and store.manifest("run-a", 2) is None
    if kind == "directory":
        left = sorted(p.name for p in (tmp_path / "w").iterdir() if p.name != ".prepared")
        assert left == ["run-a-v1"], "the half-written folder must go"
        assert (tmp_path / "w" / "run-a-v1").stat().st_mode & 0o777 == 0o750, "the actors read it as the learner's group"
    else:
        assert not list(redis_client.scan_iter(f"{key_prefix}:weights:run-a:v2*"))


def len_chunks(store: weights.SnapshotStore) -> int:
    return len(msgpack.unpackb(store.manifest("run-a", 1))["chunks"])


def test_a_run_id_that_is_not_a_word_is_refused(redis_client, key_prefix, tmp_path):
    store = weights.DirectorySnapshots(tmp_path)
    with pytest.raises(ValueError, match="run id"):
        weights.store_snapshot(redis_client, key_prefix, 1, mixed_state(), "full", "../../etc", store=store)
    with pytest.raises(weights.WeightsError, match="run id"):
        store.manifest("../x", 1)
