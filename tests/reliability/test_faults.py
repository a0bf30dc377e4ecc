"""Faults with real processes: actors SIGKILLed or frozen, the broker, Redis and the learner SIGKILLed and restarted.

Each scenario ends with the ledger (tools/reliability/ledger.py): every feedback the
clients were told was recorded is stored, and every stored transition was
trained or dropped by a counted rule. The learner is the real one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest

from client import Client
from common.redis_server import EmbeddedRedis, connect
from learner_node import checkpoint
from tests.helpers import OBS, TORCH_START_S, wait_for
from tests.processes import PPOZ, BrokerProcess
from tests.reliability.conftest import SETTLE_STALL_S, RunningLearner
from tools.reliability.ledger import Ledger, settle_ledger

# These scenarios wait on progress (the ledger moving, SETTLE_STALL_S without it is a failure), not on a
# total time; the suite-wide 300 s per test would cut a slow but moving run short on a loaded machine.
pytestmark = pytest.mark.timeout(1800)
# About 1,200 tokens (the tiny models' byte tokenizer): an actor batch and a learner update take seconds, so
# a fault lands while work is under way. MEDIUM_OBS (about 400) where the fault needs traffic, not slow work.
LONG_OBS = dict(OBS, prompt=OBS["prompt"] + " History: " + "TouchEvent(view=Cart) -> CartActivity. " * 30)
MEDIUM_OBS = dict(OBS, prompt=OBS["prompt"] + " History: " + "TouchEvent(view=Cart) -> CartActivity. " * 10)


def start_actor_process(backend: str, tiny_model: str, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *PPOZ,
            "actor",
            "--broker",
            backend,
            "--model",
            tiny_model,
            "--lora-rank",
            "0",
            "--device",
            "cpu",
            "--name",
            name,
            "--heartbeat-ms",
            "100",
            "--credits",
            "64",
            "--max-batch",
            "1",
        ],
        stderr=subprocess.DEVNULL,
    )


def play_emulators(
    frontend: str,
    n: int,
    steps: int,
    acknowledged: list[int],
    errors: list[BaseException],
    make_client: Callable[..., Client],
    obs: dict[str, Any] = LONG_OBS,
) -> list[threading.Thread]:
    """n emulators, each: attach, `steps` x (step, feedback), detach; acknowledged feedbacks are counted."""
    lock = threading.Lock()

    def emulator() -> None:
        try:
            # A step waits behind the others' at an actor of one job a batch (LONG_OBS: 0.1-0.5 s each) and through the
            # faults: an attempt that times out is resent (the rid makes it safe); the deadline, x20 of the slowest wait
            c = make_client(frontend, deadline=120, attempt_timeout=10)
            task = c.attach()
            for _ in range(steps):
                c.step(task, obs)
                c.feedback(task, 1.0)
                with lock:
                    acknowledged[0] += 1
            c.detach(task)
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=emulator) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def settle(redis_url: str, key_prefix: str, acknowledged: int, learner: RunningLearner) -> Ledger:
    """Wait while the learner works through the stream (the ledger moving); fail with the last ledger read if it stalls."""
    client = connect(redis_url)

    def learner_alive() -> None:
        if not learner.alive():
            pytest.fail(f"the learner died: {learner.said()[-3000:]}")

    try:
        ledger = settle_ledger(client, key_prefix, acknowledged, SETTLE_STALL_S, learner_alive, poll_s=0.5)
    finally:
        client.close()
    if not ledger.balanced:
        pytest.fail(f"the ledger stopped moving for {SETTLE_STALL_S} s without balancing: {ledger}\n{learner.said()[-3000:]}")
    return ledger


def assert_trained_once(learner: RunningLearner, stored: int) -> None:
    """The learner's last checkpoint: every segment id trained at most once, every stored transition counted once."""
    state = learner.checkpoint_state()
    trained = state["recent_segments"]
    assert len(trained) == len(set(trained)), f"a segment was trained twice: {len(trained)} trainings of {len(set(trained))} segments"
    assert state["counters"]["segments_trained"] == len(trained)
    assert state["counters"]["transitions_stored"] == stored, state["counters"]


@pytest.mark.slow
def test_actor_killed_mid_batch_its_requests_go_to_another_and_nothing_is_lost(
    start_broker, start_actor, start_learner, make_client, tiny_models, redis_url, key_prefix
):
    broker = start_broker(max_stream_backlog=0)
    learner = start_learner(redis_url, key_prefix)
    doomed = start_actor_process(broker.backend, tiny_models["llama"], "doomed")
    status = make_client(broker.frontend)
    try:
        wait_for(lambda: status.status()["actors"], timeout=TORCH_START_S, what="the actor process")
        acknowledged, errors = [0], []
        threads = play_emulators(broker.frontend, 16, 5, acknowledged, errors, make_client)
        # 16 emulators attach and step at once: their steps reach the actor in about 1 s alone; x60
        wait_for(lambda: sum(a["inflight"] for a in status.status()["actors"]) >= 10, timeout=60, what="a batch at the actor")
        doomed.send_signal(signal.SIGKILL)  # in the middle of its work: jobs scored, queued and in the forward
        doomed.wait(10)  # SIGKILL ends it at once (ms); x1000
        start_actor(broker.backend, name="survivor")
        for t in threads:
            t.join(180)  # the rest served by the uniform survivor, in ms each: a few s alone; x30
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()
    assert not errors, errors[:3]
    assert acknowledged[0] == 80
    counters = status.status()["counters"]
    assert counters["jobs/requeued"] >= 1, counters  # the killed actor's jobs went elsewhere
    assert counters["broker/steps"] == 80 and counters["broker/feedbacks"] == 80  # none answered twice, none lost
    ledger = settle(redis_url, key_prefix, acknowledged[0], learner)
    assert ledger.balanced and ledger.stored == 80, str(ledger)
    assert_trained_once(learner, 80)


@pytest.mark.slow
def test_a_frozen_actor_is_bypassed_and_rejoins_when_it_resumes(
    start_broker, start_actor, start_learner, make_client, tiny_models, redis_url, key_prefix
):
    broker = start_broker(max_stream_backlog=0, heartbeat_liveness=5, actor_job_timeout_ms=3000)
    learner = start_learner(redis_url, key_prefix)
    frozen = start_actor_process(broker.backend, tiny_models["llama"], "frozen")
    status = make_client(broker.frontend)
    try:
        wait_for(lambda: status.status()["actors"], timeout=TORCH_START_S, what="the actor process")
        acknowledged, errors = [0], []
        threads = play_emulators(broker.frontend, 8, 5, acknowledged, errors, make_client)
        wait_for(lambda: sum(a["inflight"] for a in status.status()["actors"]) >= 4, timeout=60, what="jobs at the actor")  # as above
        os.kill(frozen.pid, signal.SIGSTOP)  # hung, not dead: its socket stays open
        start_actor(broker.backend, name="healthy")
        for t in threads:
            t.join(180)  # the frozen actor's jobs requeued after its 3 s job timeout, the rest in ms: a few s alone; x30
        assert not errors, errors[:3]
        counters = status.status()["counters"]
        assert counters.get("actors/dead", 0) + counters.get("actors/hung", 0) >= 1, counters
        os.kill(frozen.pid, signal.SIGCONT)
        # SIGCONT: its next heartbeat (0.1 s) or ready, and the broker's answer: under 1 s alone; x60
        wait_for(lambda: any(a["name"] == "frozen" for a in status.status()["actors"]), timeout=60, what="the resumed actor to rejoin")
        task = status.attach()  # and it serves again (the broker may pick either actor; both answer)
        for _ in range(4):
            status.step(task, OBS)
            status.feedback(task, 1.0)
            acknowledged[0] += 1
        status.detach(task)
    finally:
        if frozen.poll() is None:
            os.kill(frozen.pid, signal.SIGCONT)
            frozen.terminate()
            frozen.wait(30)  # PROCESS_STOP_S: an actor's exit after SIGTERM
    assert acknowledged[0] == 44
    assert status.status()["counters"]["broker/feedbacks"] == 44
    ledger = settle(redis_url, key_prefix, acknowledged[0], learner)
    assert ledger.balanced and ledger.stored == 44, str(ledger)
    assert_trained_once(learner, 44)


@pytest.mark.slow
def test_broker_killed_and_restarted_clients_go_on_and_nothing_is_applied_twice(
    start_actor, start_learner, make_client, redis_url, key_prefix
):
    broker = BrokerProcess(redis_url, key_prefix, "--heartbeat-ms", "100", "--segment-len", "4")
    learner = start_learner(redis_url, key_prefix)
    start_actor(broker.backend, name="steady")
    frontend = broker.frontend
    # `ppoz broker` (no torch) starts, then restarts, in about 1 s alone: its status calls get x60, the actor thread's
    # registration x30 (after the learner's start, which start_learner waited for)
    status = make_client(frontend, deadline=60)
    acknowledged, errors = [0], []
    try:
        wait_for(lambda: status.status()["actors"], timeout=60, what="the actor at the broker")
        threads = play_emulators(frontend, 8, 10, acknowledged, errors, make_client)
        wait_for(lambda: acknowledged[0] >= 20, timeout=60, what="some feedbacks")  # 20 steps of a uniform actor: under 1 s alone
        broker.kill()  # no drain, no flush: whatever was acknowledged is already in Redis
        broker.restart()  # sessions and open segments come back from Redis
        for t in threads:
            t.join(180)  # the restart (1 s alone), then the 60 steps left, in ms each; x60
        assert not errors, errors[:3]
        assert acknowledged[0] == 80
    finally:
        broker.stop()
    ledger = settle(redis_url, key_prefix, acknowledged[0], learner)
    assert ledger.balanced and ledger.stored == 80, str(ledger)  # retried feedbacks were not applied twice
    assert_trained_once(learner, 80)


@pytest.mark.slow
@pytest.mark.parametrize("learner_kind", ["thread", "process"])
def test_redis_killed_and_restarted_with_append_only_nothing_acknowledged_is_lost(
    start_actor, start_learner, make_client, learner_kind, tmp_path
):
    """Redis SIGKILLed (append-only, fsync always) and restarted on the same files under 8 emulators and a learner.

    The learner runs in a thread of this process or as its own process, as in a farm. Afterwards
    the ledger balances, and the learner's checkpoint shows every segment trained once.
    """
    data_dir = tempfile.mkdtemp(prefix="ppoz-aof-")  # short: a unix socket path has at most 107 bytes
    redis_server = EmbeddedRedis(appendonly=True, appendfsync="always", data_dir=data_dir).start()
    broker_log = tmp_path / "broker.log"
    broker = BrokerProcess(redis_server.url, "aof", "--heartbeat-ms", "100", "--segment-len", "4", log=broker_log)
    learner = start_learner(redis_server.url, "aof", as_process=learner_kind == "process")
    start_actor(broker.backend, name="steady")
    frontend = broker.frontend
    status = make_client(frontend, deadline=60)  # as in the test above
    acknowledged, errors = [0], []
    try:
        wait_for(lambda: status.status()["actors"], timeout=60, what="the actor at the broker")  # as in the test above
        threads = play_emulators(frontend, 8, 30, acknowledged, errors, make_client, MEDIUM_OBS)
        wait_for(lambda: acknowledged[0] >= 20, timeout=120, what="some feedbacks")  # under 1 s alone (fsync always); x100
        redis_server.process.send_signal(signal.SIGKILL)  # no shutdown save: only the append-only file survives
        redis_server.process.wait(10)  # SIGKILL ends it at once (ms); x1000
        # the broker's next write or its once-a-second read fails: 1-2 s alone; x15
        wait_for(lambda: not status.status()["storage_ok"], timeout=30, what="the broker to notice")
        # Down until the learner too has given up its client's quick retries and gone to its back-off;
        # meanwhile clients are refused with `overloaded` and retry.
        # (180 s: an update under way on a loaded 2-core machine does not touch Redis until it ends.)
        wait_for(lambda: "Redis unreachable" in learner.said() or not learner.alive(), timeout=180, what="the learner to notice")
        assert learner.alive(), f"the learner ended when Redis went away; it said:\n{learner.said()[-3000:]}"
        redis_server.start()  # same directory: it replays the append-only file
        for t in threads:
            t.join(180)  # the broker's reload (once a second) and the clients' retries, then 220 steps: 5-10 s alone; x18
        assert not errors, errors[:3]
        assert acknowledged[0] == 240
        assert status.status()["storage_ok"]
        ledger = settle(redis_server.url, "aof", acknowledged[0], learner)
        assert ledger.balanced and ledger.stored == 240, str(ledger)
        assert_trained_once(learner, 240)
        said = learner.said()
    finally:
        learner.stop()
        broker.stop()
        redis_server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    told = broker_log.read_text()
    assert "Redis unreachable" in told and "Redis is back" in told, told[-2000:]
    assert "Redis is back" in said, said[-2000:]  # the learner's


@pytest.mark.slow
def test_learner_killed_mid_update_resumes_and_the_ledger_balances(
    start_broker, start_actor, make_client, tiny_models, redis_url, redis_client, key_prefix, tmp_path
):
    """The learner process SIGKILLed with a rollout read but not acknowledged, under 8 emulators; `--resume` finishes the job."""
    broker = start_broker(max_stream_backlog=0)
    start_actor(broker.backend, name="steady")
    ckpt = tmp_path / "ckpt"
    args = [
        *PPOZ,
        "--log-level",
        "warning",
        "learner",
        "--model",
        tiny_models["llama"],
        "--lora-rank",
        "4",
        "--normalisation",
        "token",
        "--device",
        "cpu",
        "--redis-url",
        redis_url,
        "--key-prefix",
        key_prefix,
        "--rollout-batch",
        "16",
        "--rollout-timeout-s",
        "1",
        "--policy-minibatch",
        "16",
        "--micro-batch",
        "16",
        "--max-policy-lag",
        "1000",
        "--checkpoint-dir",
        str(ckpt),
        "--tensorboard-dir",
        "",
        "--weights-bind",
        "tcp://127.0.0.1:0",
        "--read-block-ms",
        "200",
    ]
    learner_log = tmp_path / "learner.log"
    learner = subprocess.Popen(args, stderr=learner_log.open("w"))
    stream = f"{key_prefix}:segments"

    def alive() -> None:
        if learner.poll() is not None:
            pytest.fail(f"the learner exited with {learner.returncode}: {learner_log.read_text()[-3000:]}")

    acknowledged, errors = [0], []
    try:
        # Phase 1: 48 feedbacks, trained and checkpointed.
        for t in play_emulators(broker.frontend, 8, 6, acknowledged, errors, make_client):
            t.join(180)  # 48 steps of a uniform actor: under 2 s alone; x90
        first = settle_ledger(redis_client, key_prefix, acknowledged[0], SETTLE_STALL_S, alive, poll_s=0.5)
        assert first.balanced and list(ckpt.glob("ckpt-*")), f"the first updates: {first}\n{learner_log.read_text()[-3000:]}"
        # Phase 2: 48 more; the learner is killed while it holds a rollout it read but has not acknowledged.
        threads = play_emulators(broker.frontend, 8, 6, acknowledged, errors, make_client)
        wait_for(  # the learner reads the next rollout as the steps come: 1-5 s alone; x36
            lambda: redis_client.xpending(stream, "learners")["pending"] >= 1,
            timeout=180,
            what=f"a rollout in the learner's hands ({learner_log.read_text()[-3000:]})",
        )
        learner.send_signal(signal.SIGKILL)
        learner.wait(10)  # SIGKILL ends it at once (ms); x1000
        killed_at = checkpoint.read_state(checkpoint.latest(ckpt) or ckpt)
        assert redis_client.xpending(stream, "learners")["pending"] >= 1  # left pending by the dead learner
        for t in threads:
            t.join(180)  # as in phase 1
        assert not errors, errors[:3]
        assert acknowledged[0] == 96
        learner = subprocess.Popen(args + ["--resume"], stderr=learner_log.open("a"))
        ledger = settle_ledger(redis_client, key_prefix, acknowledged[0], SETTLE_STALL_S, alive, poll_s=0.5)
    finally:
        if learner.poll() is None:
            learner.terminate()
            learner.wait(120)  # as tests/reliability/conftest.py's learner process (it was 60 s: x6)
    assert ledger.balanced and ledger.stored == 96, str(ledger)
    final = checkpoint.read_state(checkpoint.latest(ckpt) or ckpt)
    assert final["version"] > killed_at["version"] and final["updates"] > killed_at["updates"]  # the sequence goes on
    trained = final["recent_segments"]
    assert len(trained) == len(set(trained)), "a segment was trained twice"
    assert final["counters"]["transitions_stored"] == 96 and final["counters"]["segments_trained"] == len(trained)
    assert not redis_client.xpending(stream, "learners")["pending"]
