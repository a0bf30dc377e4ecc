"""The processes as systemd runs them: READY, WATCHDOG, STATUS, STOPPING, and a SIGTERM drain.

Each `ppoz` command runs as a real process with NOTIFY_SOCKET pointing at a unix
datagram socket of the test's own, as systemd's would.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from actor_node.link import BrokerLink
from actor_node.policies import UniformPolicy
from actor_node.worker import serve
from client import Client, Overloaded, RequestTimeout
from tests.helpers import OBS, PROCESS_START_S, TORCH_START_S, wait_for
from tests.processes import NotifySocket, free_port, start_service, stop


@pytest.mark.slow
def test_broker_notifies_ready_when_bound_pings_the_watchdog_reports_status_and_stops(tmp_path, redis_url, key_prefix):
    notify = NotifySocket(tmp_path / "notify.sock")
    front, back = free_port(), free_port()
    proc = start_service(
        [
            "broker",
            "--frontend",
            f"tcp://127.0.0.1:{front}",
            "--backend",
            f"tcp://127.0.0.1:{back}",
            "--redis-url",
            redis_url,
            "--key-prefix",
            key_prefix,
        ],
        notify,
    )
    try:
        ready = notify.wait_for("READY=1", PROCESS_START_S)
        assert f"127.0.0.1:{front}" in ready
        with Client(f"tcp://127.0.0.1:{front}", deadline=2, attempt_timeout=2) as c:  # a ready broker answers in ms; x1000
            assert c.ping()["status"] == "ok"  # READY means it can do its job now
        # Every 0.2 s for a 0.4 s watchdog: four pings waited for, not counted in 2.5 s (a count per unit of time, which a
        # loaded machine's late loop could miss); 0.8 s alone, x12
        wait_for(lambda: notify.count("WATCHDOG=1") >= 4, timeout=10, what=f"four watchdog pings: {notify.messages}")
        wait_for(lambda: any("sessions" in m and m.startswith("STATUS=") for m in notify.messages), what="a status with the sessions")
    finally:
        code, err = stop(proc)
        notify.settle("STOPPING=1")
        notify.close()
    assert code == 0, err[-2000:]
    assert notify.count("STOPPING=1") == 1


@pytest.mark.slow
def test_broker_sigterm_with_steps_no_actor_is_left_to_answer_stops_without_waiting_out_the_drain(tmp_path, redis_url, key_prefix):
    """`ppoz up` stops its actors before the broker: the steps still queued then can never be answered, and the
    broker waited its whole drain_timeout_s (10 s by default) for them at every stack's stop."""
    notify = NotifySocket(tmp_path / "notify.sock")
    front, back = free_port(), free_port()
    args = ["broker", "--frontend", f"tcp://127.0.0.1:{front}", "--backend", f"tcp://127.0.0.1:{back}"]
    proc = start_service([*args, "--redis-url", redis_url, "--key-prefix", key_prefix, "--drain-timeout-s", "120"], notify)
    try:
        notify.wait_for("READY=1", 60)  # a broker imports no torch: 1 s alone on the 2-core VM
        # `c`: a ready broker answers in ms (x1000); `stepping`'s 1 s is the timeout the queued step must meet
        with Client(f"tcp://127.0.0.1:{front}", deadline=30) as c, Client(f"tcp://127.0.0.1:{front}", deadline=1) as stepping:
            task = c.attach()
            with pytest.raises(RequestTimeout):  # no actor: the step waits in the queue
                stepping.step(task, OBS)
            assert c.status()["jobs"] == 1
        proc.send_signal(signal.SIGTERM)
        # Far below the 120 s drain: the broker stops as soon as it sees no actor can answer (well under 1 s alone).
        assert proc.wait(60) == 0
        assert "no actor is left to answer them" in Path(proc.log_path).read_text()
    finally:
        stop(proc)
        notify.close()


@pytest.mark.slow
def test_broker_sigterm_drains_steps_in_flight_refuses_new_ones_and_loses_nothing(tmp_path, redis_url, key_prefix, zmq_context):
    notify = NotifySocket(tmp_path / "notify.sock")
    front, back = free_port(), free_port()
    args = [
        "broker",
        "--frontend",
        f"tcp://127.0.0.1:{front}",
        "--backend",
        f"tcp://127.0.0.1:{back}",
        "--redis-url",
        redis_url,
        "--key-prefix",
        key_prefix,
        "--heartbeat-ms",
        "100",
        "--drain-timeout-s",
        "20",
    ]
    proc = start_service(args, notify)

    class SlowPolicy(UniformPolicy):
        def choose_batch(self, jobs):
            time.sleep(2.0)  # a long forward: SIGTERM arrives while it runs
            return super().choose_batch(jobs)

    link = BrokerLink(f"tcp://127.0.0.1:{back}", name="slow", credits=4, heartbeat_ms=100, context=zmq_context).start()
    stop_actor = threading.Event()
    actor = threading.Thread(target=serve, args=(link, SlowPolicy(0), stop_actor), daemon=True)
    actor.start()
    replies: list[dict] = []
    try:
        notify.wait_for("READY=1", PROCESS_START_S)
        # The step in flight is answered after the policy's 2 s forward (a timer) and the drain: the clients' 30 s, x15
        with Client(f"tcp://127.0.0.1:{front}", deadline=30, context=zmq_context) as c:
            wait_for(lambda: c.status()["actors"], timeout=20, what="the actor")  # a link of this process: 0.1-0.5 s alone; x40
            task = c.attach()
            stepping = Client(f"tcp://127.0.0.1:{front}", deadline=30, context=zmq_context)  # its own socket: Client serialises calls
            stepper = threading.Thread(target=lambda: replies.append(stepping.step(task, OBS, rid="in-flight-1")))
            stepper.start()
            wait_for(lambda: c.status()["jobs"] == 1, timeout=10, what="the step in flight")  # ms alone; x1000
            proc.send_signal(signal.SIGTERM)
            notify.wait_for("STOPPING=1", 10)  # the broker's loop takes the signal at once: ms alone; x1000
            # how long `late` retries the `overloaded` it is refused at once, short on purpose (as in tests/broker)
            with Client(f"tcp://127.0.0.1:{front}", deadline=0.5, attempt_timeout=0.5, context=zmq_context) as late:
                with pytest.raises(Overloaded):
                    late.step(task, OBS, rid="new-during-drain")
            stepper.join(20)  # the rest of the 2 s forward, then the reply; x10
            stepping.close()
        try:
            assert proc.wait(30) == 0  # its drain ends with the step answered, then it exits: about 2 s alone; x15
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(proc.log_path.read_text()[-3000:])
        assert len(replies) == 1 and 0 <= replies[0]["action"] < len(OBS["action"]), "the step in flight was answered"
        # Nothing lost: a restarted broker takes the feedback for the step answered during the drain.
        restarted_at = len(notify.messages)
        proc = start_service(args, notify)
        notify.wait_for("READY=1", PROCESS_START_S, since=restarted_at)  # the restarted broker's, not the first one's
        with Client(f"tcp://127.0.0.1:{front}", deadline=10, context=zmq_context) as c:  # a ready broker: ms; x1000
            assert c.feedback(task, 1.0, done=True)["status"] == "ok"
    finally:
        stop_actor.set()
        actor.join(10)  # serve() sees the event between its 0.1 s polls (or after the 2 s forward in hand); x5
        link.close()
        stop(proc)
        notify.close()


@pytest.mark.slow
def test_actor_is_ready_only_with_its_model_loaded_and_stops_cleanly(tmp_path, start_broker, tiny_models, redis_url, key_prefix):
    broker = start_broker()
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start_service(
        [
            "actor",
            "--broker",
            broker.backend,
            "--model",
            tiny_models["llama"],
            "--lora-rank",
            "0",
            "--device",
            "cpu",
            "--name",
            "svc-actor",
            "--heartbeat-ms",
            "100",
        ],
        notify,
    )
    try:
        ready = notify.wait_for("READY=1", TORCH_START_S)
        assert tiny_models["llama"] in ready and "policy version 0" in ready
        # ready: it has registered, or does within a heartbeat (0.1 s); a step of the tiny model, 0.05-0.5 s; x10 and more
        with Client(broker.frontend, deadline=5) as c:
            wait_for(lambda: any(a["name"] == "svc-actor" for a in c.status()["actors"]), timeout=10, what="the actor at the broker")
            task = c.attach()
            assert 0 <= c.step(task, OBS)["action"] < len(OBS["action"])
        # pings waited for, not counted in 3 s (as in the broker's test above): 0.4 s alone; x25
        wait_for(lambda: notify.count("WATCHDOG=1") >= 2, timeout=10, what=f"two watchdog pings: {notify.messages}")
    finally:
        code, err = stop(proc)
        notify.settle("STOPPING=1")
        notify.close()
    assert code == 0, err[-2000:]
    assert notify.count("STOPPING=1") == 1
    with Client(broker.frontend, deadline=5) as c:
        # its goodbye, or three missed 0.1 s heartbeats: under 0.5 s alone; x20
        wait_for(lambda: not c.status()["actors"], timeout=10, what="the broker to see the actor leave")


@pytest.mark.slow
def test_learner_and_gateway_notify_and_stop_cleanly(tmp_path, start_broker, tiny_models, redis_url, key_prefix):
    broker = start_broker()
    learner_notify = NotifySocket(tmp_path / "learner.sock")
    gateway_notify = NotifySocket(tmp_path / "gateway.sock")
    learner = start_service(
        [
            "learner",
            "--model",
            tiny_models["llama"],
            "--lora-rank",
            "0",
            "--device",
            "cpu",
            "--redis-url",
            redis_url,
            "--key-prefix",
            key_prefix,
            "--weights-bind",
            f"tcp://127.0.0.1:{free_port()}",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--tensorboard-dir",
            "",
        ],
        learner_notify,
    )
    gateway = start_service(["gateway", "--port", str(free_port()), "--broker", broker.frontend], gateway_notify)
    try:
        assert "policy version 0" in learner_notify.wait_for("READY=1", TORCH_START_S)
        gateway_notify.wait_for("READY=1", PROCESS_START_S)
        # pings waited for, not counted in 1.5 s (as in the broker's test above): 0.4 s alone; x25
        for n in (learner_notify, gateway_notify):
            wait_for(lambda n=n: n.count("WATCHDOG=1") >= 2, timeout=10, what=f"two watchdog pings: {n.messages}")
    finally:
        results = [stop(learner, 60), stop(gateway)]  # the learner's exit (no update in hand): 1-3 s alone; x20
        for n in (learner_notify, gateway_notify):
            n.settle("STOPPING=1")
            n.close()
    for code, err in results:
        assert code == 0, err[-2000:]
    assert learner_notify.count("STOPPING=1") == 1 and gateway_notify.count("STOPPING=1") == 1


@pytest.mark.slow
def test_actor_sigterm_finishes_its_batch_and_hands_queued_jobs_back(tmp_path, start_broker, start_actor, make_client, tiny_models):
    broker = start_broker()
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start_service(
        [
            "actor",
            "--broker",
            broker.backend,
            "--model",
            tiny_models["llama"],
            "--lora-rank",
            "0",
            "--device",
            "cpu",
            "--name",
            "leaving",
            "--heartbeat-ms",
            "100",
            "--credits",
            "64",
            "--max-batch",
            "1",
        ],
        notify,
    )
    obs = dict(OBS, prompt=OBS["prompt"] + " History: " + "TouchEvent(view=Cart) -> CartActivity. " * 100)
    replies: list[dict] = []
    errors: list[BaseException] = []
    try:
        notify.wait_for("READY=1", TORCH_START_S)
        status = make_client(broker.frontend)
        wait_for(lambda: status.status()["actors"], timeout=20, what="the actor")  # ready: registered, or within 0.1 s; x200

        def emulator() -> None:
            try:
                # 48 long steps, one a batch: each waits its turn, 0.1-0.3 s a forward, up to 10 s alone; x12
                c = make_client(broker.frontend, deadline=120)
                replies.append(c.step(c.attach(), obs))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=emulator) for _ in range(48)]
        for t in threads:
            t.start()
        # 48 threads attach and step at once: about 1 s alone; x30
        wait_for(lambda: sum(a["inflight"] for a in status.status()["actors"]) >= 20, timeout=30, what="jobs at the actor")
        proc.send_signal(signal.SIGTERM)
        # it finished the forward in progress, not every queued job: that forward and the exit, about 1 s alone; x30
        assert proc.wait(30) == 0
        start_actor(broker.backend, name="taking-over")  # the jobs it handed back go here
        for t in threads:
            t.join(120)  # the emulators' own deadline
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()  # SIGKILL ends it at once
        notify.settle("STOPPING=1")
        notify.close()
    assert not errors and len(replies) == 48, errors[:3]
    counters = status.status()["counters"]
    assert counters["jobs/requeued"] >= 1, counters
    assert notify.count("STOPPING=1") == 1
