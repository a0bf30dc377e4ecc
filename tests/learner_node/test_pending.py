"""The learner's reads of its consumer group: pending entries are read once, none is left behind.

Regressions for issue 14. A rollout the learner had read when Redis went away
(or when the learner was killed) stays in its consumer's pending list and is
read first afterwards. The old reader asked for the pending list from its
start ("0") on every read of a rollout, so pending entries fewer than a
rollout came back a second time, were trained twice and counted twice as
stored (the ledger then never balanced: 108 stored for 96 acknowledged in a
learner-kill run). And it looked at the pending list only after a restart or
an outage it noticed, so entries delivered by a read whose reply was lost
(redis-py retries a failed command on a new connection) stayed pending for ever.
"""

from __future__ import annotations

import threading

import pytest

from common.redis_server import EmbeddedRedis, connect
from common.shared_settings import PolicySpec, StoreSettings
from learner_node.config import LearnerConfig
from learner_node.worker import Learner
from tests.learner_node.test_async_ppo import durably
from tests.learner_node.test_resume import write_segments

GROUP, CONSUMER = "learners", "learner-0"


def make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path, **overrides) -> Learner:
    settings = dict(
        policy=PolicySpec(model=tiny_models["llama"], lora_rank=0, normalisation="token"),
        device="cpu",
        store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
        rollout_batch=4,
        policy_minibatch=4,
        micro_batch=4,
        update_epochs=1,
        max_policy_lag=1000,
        weights_bind="tcp://127.0.0.1:*",
        checkpoint_dir=str(tmp_path / "ckpt"),
        tensorboard_dir="",
        read_block_ms=100,
    )
    settings.update(overrides)
    learner = Learner(LearnerConfig(**settings), redis_client)
    learner.start()
    return learner


def deliver_unseen(redis_client, key_prefix: str, n: int) -> list[bytes]:
    """Deliver n new entries to the learner's consumer without the learner seeing them (a lost read reply)."""
    got = redis_client.xreadgroup(GROUP, CONSUMER, {f"{key_prefix}:segments": ">"}, count=n)
    return [entry_id for entry_id, _ in got[0][1]]


def trained_once(learner: Learner) -> None:
    trained = list(learner.seen)
    assert len(trained) == len(set(trained)), f"a segment was trained twice: {sorted(trained)}"
    assert learner.counters["transitions_stored"] == learner.counters["segments_trained"] == len(trained), learner.counters


@pytest.mark.slow
def test_pending_entries_fewer_than_a_rollout_are_read_once(tiny_models, redis_url, redis_client, key_prefix, tmp_path):
    write_segments(redis_client, key_prefix, 6)  # one transition each
    learner = make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path)
    try:
        deliver_unseen(redis_client, key_prefix, 2)  # a rollout read, then dropped when Redis went away
        assert learner.step() is not None
        durably(learner)
        trained_once(learner)
        assert learner.counters["transitions_stored"] == 4  # the 2 pending and 2 new, each once
        assert redis_client.xlen(f"{key_prefix}:segments") == 2
        assert redis_client.xpending(f"{key_prefix}:segments", GROUP)["pending"] == 0
    finally:
        learner.close()


@pytest.mark.slow
def test_entries_delivered_by_a_lost_read_are_trained_by_the_next_rollout(tiny_models, redis_url, redis_client, key_prefix, tmp_path):
    write_segments(redis_client, key_prefix, 8)
    learner = make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path, rollout_timeout_s=0.5)
    try:
        assert learner.step() is not None  # 4 of 8
        deliver_unseen(redis_client, key_prefix, 2)  # delivered to this consumer; the learner never saw the reply
        assert learner.step() is not None  # must take the 2 pending and the 2 new
        durably(learner)
        trained_once(learner)
        assert learner.counters["transitions_stored"] == 8
        assert redis_client.xlen(f"{key_prefix}:segments") == 0
        assert redis_client.xpending(f"{key_prefix}:segments", GROUP)["pending"] == 0
    finally:
        learner.close()


@pytest.mark.slow
def test_pending_entries_deleted_from_the_stream_do_not_stall_the_reader(tiny_models, redis_url, redis_client, key_prefix, tmp_path):
    write_segments(redis_client, key_prefix, 6)
    learner = make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path)
    stream = f"{key_prefix}:segments"
    try:
        gone = deliver_unseen(redis_client, key_prefix, 2)
        redis_client.xdel(stream, *gone)  # trimmed away while pending: nothing left to train
        result: list = []
        worker = threading.Thread(target=lambda: result.append(learner.step()), daemon=True)
        worker.start()
        worker.join(120)  # one rollout of the tiny model, read and trained: 1-3 s alone; x40
        if worker.is_alive():
            learner.stop()
            worker.join(30)  # the update in hand, then the loop sees the stop; x10
            pytest.fail("the learner kept re-reading pending entries that are no longer in the stream")
        assert result and result[0] is not None
        durably(learner)
        trained_once(learner)
        assert learner.counters["transitions_stored"] == 4
        assert redis_client.xpending(stream, GROUP)["pending"] == 0  # the deleted ones were acknowledged, not kept
    finally:
        learner.close()


@pytest.mark.slow
def test_entries_waiting_for_their_checkpoint_are_not_read_again_by_each_rollout(tiny_models, key_prefix, tmp_path):
    """With a checkpoint by time, trained entries stay pending for seconds: a rollout must not fetch them again.
    The reader used to rescan its whole pending list at every rollout, so the k-th update since a checkpoint
    read k rollouts of entries (145 responses/s on the demo where a checkpoint every update gave 237). What
    Redis sends is counted on a server of this test's own: each rollout's reads are about the first's."""
    with EmbeddedRedis() as server:
        client = connect(server.url)
        try:
            write_segments(client, key_prefix, 5 * 16)
            cadence = {"checkpoint_every": 0, "checkpoint_every_s": 29.0}  # no checkpoint while the 5 updates run
            learner = make_learner(tiny_models, server.url, client, key_prefix, tmp_path, rollout_batch=16, policy_minibatch=16, **cadence)
            try:
                sent = []
                for _ in range(5):
                    before = int(client.info("stats")["total_net_output_bytes"])
                    assert learner.step() is not None
                    sent.append(int(client.info("stats")["total_net_output_bytes"]) - before)
                assert len(learner.checkpointer.undurable) == 5 * 16, "a checkpoint was written meanwhile: the test saw nothing"
                assert max(sent[1:]) < 1.5 * sent[0], f"bytes Redis sent per update: {sent}"
                durably(learner)
                trained_once(learner)
                assert learner.counters["transitions_stored"] == 5 * 16
                assert client.xpending(f"{key_prefix}:segments", GROUP)["pending"] == 0
            finally:
                learner.close()
        finally:
            client.close()
