"""The learner publishes its weights in the background (learner_node/publisher.py): an update does not wait for
its weights to be stored, the store gets a copy taken at the update's end (not weights a later update changed),
and a publication that fails in the background is done again with the newest version once Redis is back.

The store is held or failed at a chosen moment by wrapping the publisher's own `_store` (the real store runs,
against the real Redis, when the test lets it): the timing is the test's, the work is the product's."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from common import weights
from common.redis_server import connect
from models.policy_model import policy_state_dict
from tests.helpers import REDIS_S, wait_for
from tests.learner_node.helpers import restartable_redis
from tests.learner_node.test_pending import make_learner
from tests.learner_node.test_resume import write_segments

DEADLINE_S = 120  # an update of a tiny model: about 1 s alone; x120


@pytest.mark.slow
def test_an_update_goes_on_while_its_weights_are_stored_and_the_store_gets_that_updates_weights(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
):
    write_segments(redis_client, key_prefix, 8)  # two rollouts of 4
    learner = make_learner(tiny_models, redis_url, redis_client, key_prefix, tmp_path)
    store, held, release = learner.publisher._store, threading.Event(), threading.Event()
    stored: dict[int, dict[str, torch.Tensor]] = {}  # by version: the weights in the store once it was written

    def held_store(version, run_id, tensors):
        held.set()
        assert release.wait(DEADLINE_S)
        store(version, run_id, tensors)
        stored[version] = weights.fetch(redis_client, key_prefix, weights.latest(redis_client, key_prefix))

    learner.publisher._store = held_store  # type: ignore[method-assign]
    try:
        first = threading.Thread(target=learner.step, daemon=True)
        first.start()
        first.join(DEADLINE_S)
        assert not first.is_alive(), "the update waited for its weights to be stored"
        assert held.wait(DEADLINE_S) and learner.version == 1 and not stored  # version 1's store is held, in flight
        at_version_1 = {name: t.clone() for name, t in policy_state_dict(learner.lp.model).items()}
        second = threading.Thread(target=learner.step, daemon=True)
        second.start()  # reads and trains the next rollout while version 1 is stored; publishing 2 waits for 1
        wait_for(lambda: learner.version == 2, DEADLINE_S, "the second update, while the first's weights are stored")
        release.set()
        second.join(DEADLINE_S)
        assert not second.is_alive()
        learner.owed.finish_publishing()
        assert sorted(stored) == [1, 2]
        at_version_2 = policy_state_dict(learner.lp.model)
        assert any(not torch.equal(at_version_1[n], at_version_2[n]) for n in at_version_1)  # the second update changed them
        # the store got each update's own weights: version 1's copy was taken before the second update changed them
        for version, want in ((1, at_version_1), (2, at_version_2)):
            got = stored[version]
            assert got.keys() <= want.keys() and all(torch.equal(got[n], want[n]) for n in got), f"version {version}"
        assert weights.latest(redis_client, key_prefix).version == 2
    finally:
        release.set()
        learner.close()


@pytest.mark.slow
def test_a_publication_that_fails_in_the_background_is_done_again_when_redis_is_back(tiny_models, tmp_path, caplog):
    prefix = "pubfail"
    with restartable_redis() as (server, client):
        write_segments(client, prefix, 4)
        learner = make_learner(tiny_models, server.url, connect(server.url, socket_timeout=REDIS_S), prefix, tmp_path, max_updates=1)
        store, lost = learner.publisher._store, threading.Event()

        def store_after_redis_is_lost(version, run_id, tensors):
            if version == 1 and not lost.is_set():  # the update's own store meets a dead Redis (a real one, killed)
                server.process.send_signal(signal.SIGKILL)
                server.process.wait(10)  # SIGKILL ends it at once (ms); x1000
                lost.set()
            store(version, run_id, tensors)

        learner.publisher._store = store_after_redis_is_lost  # type: ignore[method-assign]
        caplog.set_level("INFO", logger="learner_node.worker")
        runner = threading.Thread(target=learner.run, daemon=True)
        runner.start()
        assert lost.wait(DEADLINE_S), caplog.text[-2000:]
        time.sleep(4.0)  # past redis-py's own retries (about 1.6 s): the store fails, the learner's back-off takes over (not a deadline)
        server.start()  # restarted from its append-only file; the learner's back-off finds it
        runner.join(DEADLINE_S)
        if runner.is_alive():
            learner.stop()
            runner.join(30)  # the loop sees the stop within a try
            pytest.fail(f"the learner did not finish its update's publication: {caplog.text[-2000:]}")
        assert "Redis unreachable" in caplog.text and "Redis is back" in caplog.text
        after = connect(server.url)
        assert weights.latest(after, prefix).version == 1  # stored after all, and announced
        got = weights.fetch(after, prefix, weights.latest(after, prefix))
        want = policy_state_dict(learner.lp.model)
        assert got.keys() <= want.keys() and all(torch.equal(got[n], want[n]) for n in got)
        after.close()
        learner.close()
