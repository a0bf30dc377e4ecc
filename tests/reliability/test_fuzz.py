"""The fuzzer against a real broker process, a uniform actor and the HTTP gateway (the CI budget: 5,000 messages)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.gateway.test_gateway import start_gateway  # noqa: F401 - a fixture
from tests.helpers import wait_for
from tests.processes import PPOZ, free_port
from tests.reliability.conftest import SETTLE_STALL_S
from tools.reliability import fuzz, fuzz_cases
from tools.reliability.ledger import settle_ledger


@pytest.fixture
def broker_process(redis_url: str, key_prefix: str) -> Iterator[tuple[subprocess.Popen, str, str]]:
    front, back = free_port(), free_port()
    proc = subprocess.Popen(
        [
            *PPOZ,
            "--log-level",
            "error",
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
        ],
    )
    yield proc, f"tcp://127.0.0.1:{front}", f"tcp://127.0.0.1:{back}"
    proc.terminate()
    try:
        proc.wait(15)  # `ppoz broker` drains and exits in under 1 s alone; x15
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)  # SIGKILL ends it at once (ms)


def test_generators_are_deterministic():
    first, second = fuzz_cases.cases(7), fuzz_cases.cases(7)
    for i in range(300):
        a, b = first(i), second(i)
        assert (a.kind, a.frames, a.rid) == (b.kind, b.frames, b.rid)


@pytest.mark.slow
def test_fuzz_broker_and_gateway(
    broker_process, start_actor, start_learner, make_client, start_gateway, redis_url, redis_client, key_prefix
):  # noqa: F811
    proc, frontend, backend = broker_process
    learner = start_learner(redis_url, key_prefix)
    start_actor(backend)
    # the broker process (no torch) up in about 1 s alone, the actor thread registered on 0.1 s heartbeats: x10; a
    # status attempt is answered in ms once it is up, 1 s attempts only resend sooner while it starts
    probe = make_client(frontend, deadline=20, attempt_timeout=1)
    wait_for(lambda: probe.status()["actors"], timeout=20, what="the actor to register")
    gateway = start_gateway(frontend)

    report = fuzz.run(
        frontend,
        5_000,
        seed=0,
        gateway_url=f"http://127.0.0.1:{gateway.port}",
        http_share=0.1,
        pid=proc.pid,
        flood_size=1000,
        reply_timeout=20.0,  # a broker reply, ms alone, a second behind the fuzz's 1,000-message flood; x20
    )
    print(fuzz.format_report(report))

    assert proc.poll() is None, "the broker process died"
    assert report.broker_alive, "the broker does not answer ping after the fuzz"
    assert probe.ping()["status"] == "ok"
    assert report.well_framed > 0 and report.unanswered == 0 and report.unmatched_rids == 0
    assert report.extra_replies == 0 and report.bad_replies == []
    assert report.client_errors == [] and report.client_steps > 0
    assert report.http_sent > 0
    assert report.http_failures == []
    assert report.rss_after_kb - report.rss_before_kb < 200 * 1024
    # Nothing the fuzz did cost an acknowledged feedback: all of them were stored and trained (or dropped by rule).
    try:
        ledger = settle_ledger(redis_client, key_prefix, report.acknowledged_feedbacks, stall_s=SETTLE_STALL_S)
    finally:
        learner.stop()
    assert ledger.balanced and ledger.stored == report.acknowledged_feedbacks >= report.client_steps > 0, str(ledger)


def test_gateway_answers_deep_json_and_huge_ints(broker_process, start_gateway):  # noqa: F811
    _, frontend, _ = broker_process
    gateway = start_gateway(frontend)
    base = f"http://127.0.0.1:{gateway.port}"
    deep = b'{"task_id": "t", "obs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge = b'{"task_id": "t", "reward": 1000000000000000000000000000000, "done": false}'
    for path, body in (("/step", deep), ("/feedback", huge)):
        status, problem = fuzz.send_http(base, fuzz_cases.HTTPCase("probe", fuzz_cases.http_request("POST", path, body)))
        assert problem == "" and status == 400, (path, status, problem)
