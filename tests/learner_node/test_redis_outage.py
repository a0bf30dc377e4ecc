"""Redis lost between an update's checkpoint and its Redis writes: the learner finishes them once Redis is back.

After each update the learner acknowledges and deletes the entries it consumed,
stores and announces the new weights, and publishes its figures and counters
(the ledger's learner side). Here Redis is SIGKILLed right after the checkpoint
and restarted from its append-only file a few seconds later, beyond redis-py's
own quick retries; the learner must wait for it and then do all three, even when
that update was its last (`max_updates`).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time

import pytest

from common import learner_figures, weights
from common.redis_server import EmbeddedRedis, connect
from common.shared_settings import PolicySpec, StoreSettings
from learner_node.config import LearnerConfig
from learner_node.worker import Learner
from tests.helpers import REDIS_S
from tests.learner_node.test_resume import write_segments


@pytest.mark.slow
def test_an_outage_after_the_checkpoint_delays_the_updates_redis_work_but_loses_none_of_it(tiny_models, tmp_path, caplog):
    data_dir = tempfile.mkdtemp(prefix="ppoz-out-")  # short: unix socket path limit
    server = EmbeddedRedis(appendonly=True, appendfsync="always", data_dir=data_dir).start()
    client = connect(server.url)
    prefix = "outage"
    try:
        write_segments(client, prefix, 4)
        cfg = LearnerConfig(
            policy=PolicySpec(model=tiny_models["llama"], lora_rank=0, normalisation="token"),
            device="cpu",
            store=StoreSettings(redis_url=server.url, key_prefix=prefix),
            rollout_batch=4,
            policy_minibatch=4,
            micro_batch=4,
            update_epochs=1,
            max_policy_lag=1000,
            weights_bind="tcp://127.0.0.1:*",
            checkpoint_dir=str(tmp_path / "ckpt"),
            tensorboard_dir="",
            read_block_ms=100,
            max_updates=1,
        )
        learner = Learner(cfg, connect(server.url, socket_timeout=REDIS_S))
        lost = threading.Event()
        save_checkpoint = learner.save_checkpoint

        def checkpoint_then_lose_redis(entry_ids: list[str]) -> None:
            save_checkpoint(entry_ids)
            server.process.send_signal(signal.SIGKILL)  # the update is trained and checkpointed; none of its Redis work is done
            server.process.wait(10)  # SIGKILL ends it at once (ms); x1000
            lost.set()

        learner.save_checkpoint = checkpoint_then_lose_redis  # type: ignore[method-assign]
        caplog.set_level("INFO", logger="learner_node.worker")
        runner = threading.Thread(target=learner.run, daemon=True)
        runner.start()
        assert lost.wait(120), f"the learner did not reach its checkpoint: {caplog.text[-2000:]}"  # one update: 2-5 s alone; x24
        # Restarted from this thread: the server dies with the thread that started it (PR_SET_PDEATHSIG).
        time.sleep(4.0)  # past redis-py's own retries (about 1.6 s): the learner's back-off must take over (not a deadline)
        server.start()
        runner.join(120)  # the back-off's next try (a few s at most), then the update's Redis work: under 10 s alone; x12
        if runner.is_alive():
            learner.stop()
            runner.join(30)  # as above: the loop sees the stop within a try
            pytest.fail(f"the learner did not finish its one update: {caplog.text[-2000:]}")
        assert "Redis unreachable" in caplog.text and "Redis is back" in caplog.text
        after = connect(server.url)
        stream = f"{prefix}:segments"
        assert after.xlen(stream) == 0 and after.xpending(stream, "learners")["pending"] == 0  # acknowledged and deleted
        assert weights.latest(after, prefix).version == 1  # the new weights stored (and announced)
        counters = learner_figures.counters(learner_figures.read_latest(after, prefix))
        assert counters["transitions_stored"] == counters["transitions_trained"] == 4  # the ledger's learner side
        after.close()
    finally:
        client.close()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
