"""The PPOAPI HTTP gateway, driven by the HTTP client Kea uses, copying Kea's calling pattern."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from actor_node.policies import UniformPolicy
from common import protocol as p
from gateway.config import GatewayConfig
from gateway.server import Gateway
from tests.helpers import OBS, PROCESS_START_S, actors_ready, router_stand_in, wait_for
from tests.processes import PPOZ, free_port

# One HTTP request to a gateway thread of this process, through a broker and an actor of this process: 10-100 ms alone
# (a step of the slow stand-in policy below, 0.3 s a batch); x100 and more.
HTTP_S = 30


class KeaHTTPClient:
    """What Kea's kea/api_interface.py PPOClient does, call for call (requests, raise_for_status, the same JSON)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.task_id: str | None = None

    def attach(self) -> str:
        res = requests.post(f"{self.base_url}/attach", timeout=HTTP_S)
        res.raise_for_status()
        self.task_id = res.json()["task_id"]
        return self.task_id

    def ask(self) -> dict[str, Any]:
        res = requests.post(f"{self.base_url}/ask", params={"task_id": self.task_id}, timeout=HTTP_S)
        res.raise_for_status()
        return res.json()

    def step(self, obs: dict[str, Any]) -> dict[str, Any]:
        res = requests.post(f"{self.base_url}/step", json={"task_id": self.task_id, "obs": obs}, timeout=HTTP_S)
        res.raise_for_status()
        return res.json()

    def feedback(self, reward: float, done: bool, next_obs: dict | None = None) -> dict[str, Any]:
        payload = {"task_id": self.task_id, "reward": reward, "done": done, "next_obs": next_obs or {}}
        res = requests.post(f"{self.base_url}/feedback", json=payload, timeout=HTTP_S)
        res.raise_for_status()
        return res.json()

    def detach(self) -> None:
        res = requests.post(f"{self.base_url}/detach", params={"task_id": self.task_id}, timeout=HTTP_S)
        res.raise_for_status()
        self.task_id = None

    def guided_step(self, obs: dict[str, Any]) -> int:
        """Kea's LLMPolicy step: ask; if not ok, wait and step anyway; perform; feedback (done is always false)."""
        if self.ask().get("status") != "ok":
            time.sleep(0.1)  # Kea sleeps 1 s (not a deadline: it steps anyway)
        action = self.step(obs)["action"]
        self.feedback(0.5 + 0.3 * (action == 1), False)
        return action


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., Gateway]]:
    started: list[tuple[Gateway, threading.Thread]] = []

    def start(broker: str, **overrides: Any) -> Gateway:
        gateway = Gateway(GatewayConfig(port=0, broker=broker, **overrides)).start()
        thread = threading.Thread(target=gateway.serve, daemon=True)
        thread.start()
        started.append((gateway, thread))
        return gateway

    yield start
    for gateway, thread in started:
        gateway.stop()
        thread.join(10)  # serve_forever ends within its 0.2 s poll interval; x50 (a daemon thread)


JSON = {"Content-Type": "application/json"}


def url(gateway: Gateway) -> str:
    return f"http://127.0.0.1:{gateway.port}"


def test_an_unmodified_kea_client_runs_its_whole_life_cycle(start_broker, start_actor, make_client, start_gateway):
    broker = start_broker(segment_len=4)
    start_actor(broker.backend)
    status = make_client(broker.frontend)
    wait_for(lambda: actors_ready(status, 1), what="the actor")
    kea = KeaHTTPClient(url(start_gateway(broker.frontend)))
    task = kea.attach()
    assert isinstance(task, str) and task
    actions = [kea.guided_step(OBS) for _ in range(10)]
    assert all(0 <= a < len(OBS["action"]) for a in actions)
    kea.detach()
    counters = status.status()["counters"]
    assert counters["broker/steps"] == 10 and counters["broker/feedbacks"] == 10
    assert counters["broker/detached"] == 1 and counters["broker/segments_closed"] == 3  # 4 + 4 by length, 2 at detach


def test_replies_have_ppoapi_shapes(start_broker, start_actor, make_client, start_gateway):
    broker = start_broker()
    start_actor(broker.backend)
    wait_for(lambda: actors_ready(make_client(broker.frontend), 1), what="the actor")
    base = url(start_gateway(broker.frontend))
    attached = requests.post(f"{base}/attach", timeout=HTTP_S).json()
    assert attached["status"] == "attached" and isinstance(attached["task_id"], str)
    task = attached["task_id"]
    assert requests.post(f"{base}/ask", params={"task_id": task}, timeout=HTTP_S).json() == {"status": "ok", "task_id": task}
    step = requests.post(f"{base}/step", json={"task_id": task, "obs": OBS}, timeout=HTTP_S).json()
    assert step["status"] == "ok" and step["task_id"] == task and isinstance(step["action"], int)
    assert "proto" not in step and "rid" not in step
    rag = requests.post(f"{base}/rag_step", json={"task_id": task, "obs": OBS}, timeout=HTTP_S)
    assert rag.status_code == 200 and isinstance(rag.json()["action"], int)  # an orphan step: the first is closed
    fb = requests.post(f"{base}/feedback", json={"task_id": task, "reward": 0.8, "done": False, "next_obs": {}}, timeout=HTTP_S)
    assert fb.status_code == 200 and fb.json()["status"] == "ok"
    detached = requests.post(f"{base}/detach", params={"task_id": task}, timeout=HTTP_S).json()
    assert detached["status"] == "detached"
    assert requests.get(f"{base}/health", timeout=HTTP_S).json() == {"status": "ok"}


@pytest.mark.slow
def test_kea_ordering_faults_get_proper_statuses_and_lose_nothing(start_broker, start_actor, make_client, start_gateway):
    broker = start_broker()
    start_actor(broker.backend)
    status = make_client(broker.frontend)
    wait_for(lambda: actors_ready(status, 1), what="the actor")
    kea = KeaHTTPClient(url(start_gateway(broker.frontend)))
    kea.attach()
    # Feedback with no step before it (Kea skipped the server for this event).
    with pytest.raises(requests.HTTPError) as caught:
        kea.feedback(0.5, False)
    assert caught.value.response.status_code == 409
    assert caught.value.response.json()["code"] == "feedback_without_step" and "error" in caught.value.response.json()
    # A step whose reply was lost: Kea logs it, skips, and steps again without feedback.
    kea.step(OBS)
    kea.guided_step(OBS)
    kea.guided_step(OBS)
    counters = status.status()["counters"]
    assert counters["broker/orphan_steps"] == 1 and counters["broker/feedbacks"] == 2 and counters["broker/steps"] == 3
    kea.detach()


def test_bad_http_requests_are_named(start_broker, start_gateway):
    broker = start_broker()
    base = url(start_gateway(broker.frontend, max_body_bytes=4096))
    task = requests.post(f"{base}/attach", timeout=HTTP_S).json()["task_id"]
    cases = [
        (requests.post(f"{base}/ask", timeout=HTTP_S), 400, "task_id"),
        (requests.post(f"{base}/ask", params={"task_id": "nobody"}, timeout=HTTP_S), 404, "unknown_task"),
        (requests.post(f"{base}/step", data=b"{not json", headers=JSON, timeout=HTTP_S), 400, "not valid JSON"),
        (requests.post(f"{base}/step", data=b"{not json", timeout=HTTP_S), 415, "Content-Type: application/json"),
        (requests.post(f"{base}/step", json=["a"], timeout=HTTP_S), 400, "JSON object"),
        (requests.post(f"{base}/step", json={"obs": OBS}, timeout=HTTP_S), 400, "task_id"),
        (requests.post(f"{base}/step", json={"task_id": "t", "obs": "text"}, timeout=HTTP_S), 400, "`obs`"),
        (requests.post(f"{base}/feedback", json={"task_id": task, "reward": "high", "done": False}, timeout=HTTP_S), 400, "reward"),
        (requests.post(f"{base}/generate", json={}, timeout=HTTP_S), 400, "task_id"),
        (requests.post(f"{base}/teleport", json={}, timeout=HTTP_S), 404, "/attach"),
        (requests.get(f"{base}/step", timeout=HTTP_S), 405, "GET"),
        (requests.post(f"{base}/step", data=b"x" * 5000, timeout=HTTP_S), 413, "4096"),
    ]
    for response, code, words in cases:
        body = response.json()
        assert response.status_code == code, (response.request.url, body)
        assert words in body["error"] or words == body["code"], body


def test_a_body_the_gateway_takes_but_the_broker_refuses_as_too_large_gets_413_at_once(start_broker, start_gateway):
    """Over the broker's max_message_bytes, under the gateway's max_body_bytes: the broker's `too_large` names the rid,
    so the gateway's client stops at once (it used to wait out its deadline on a reply with rid nil, then 504)."""
    broker = start_broker(max_message_bytes=2048)
    base = url(start_gateway(broker.frontend, request_deadline_s=10.0, attempt_timeout_s=5.0))
    task = requests.post(f"{base}/attach", timeout=HTTP_S).json()["task_id"]
    started = time.monotonic()
    response = requests.post(f"{base}/step", json={"task_id": task, "obs": {**OBS, "prompt": "p" * 5000}}, timeout=HTTP_S)
    assert response.status_code == 413 and "the limit is 2048" in response.json()["error"], response.json()
    # at once (ms alone), not after the client's 5 s attempt: the bound was 3 s; 4 s tells the two apart as well
    assert time.monotonic() - started < 4


def test_many_clients_are_served_concurrently(start_broker, start_actor, make_client, start_gateway):
    class SlowPolicy(UniformPolicy):
        """A neighbour stand-in: the actor takes 0.3 s per batch and records batch sizes."""

        def __init__(self) -> None:
            super().__init__(0)
            self.batches: list[int] = []

        def choose_batch(self, jobs):
            self.batches.append(len(jobs))
            time.sleep(0.3)
            return super().choose_batch(jobs)

    broker = start_broker()
    policy = SlowPolicy()
    start_actor(broker.backend, credits=32, policy=policy)
    status = make_client(broker.frontend)
    wait_for(lambda: actors_ready(status, 1), what="the actor")
    base = url(start_gateway(broker.frontend))
    errors: list[BaseException] = []

    def emulator() -> None:
        try:
            kea = KeaHTTPClient(base)
            kea.attach()
            for _ in range(3):
                kea.guided_step(OBS)
            kea.detach()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=emulator) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # 48 steps at 0.3 s a batch, batched: 2-5 s alone; x24
    assert not errors, errors[:3]
    assert status.status()["counters"]["broker/feedbacks"] == 48
    # Requests were in flight together: the actor saw them batched, not one at a time.
    assert max(policy.batches) >= 4, policy.batches


def test_an_unreachable_broker_gives_504_within_the_deadline(start_gateway):
    base = url(start_gateway(f"tcp://127.0.0.1:{free_port()}", request_deadline_s=1.0, attempt_timeout_s=0.5))
    started = time.monotonic()
    response = requests.post(f"{base}/attach", timeout=HTTP_S)
    assert response.status_code == 504 and response.json()["code"] == "timeout"
    assert time.monotonic() - started < 10  # the gateway's 1 s deadline under test, and x10 for a loaded machine


def test_ppoz_gateway_command_serves_and_stops_on_sigterm(start_broker, start_actor, make_client):
    broker = start_broker()
    start_actor(broker.backend)
    wait_for(lambda: actors_ready(make_client(broker.frontend), 1), what="the actor")
    port = free_port()
    proc = subprocess.Popen([*PPOZ, "gateway", "--port", str(port), "--broker", broker.frontend], stderr=subprocess.PIPE, text=True)
    try:

        def healthy() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200  # one probe: ms once up
            except requests.ConnectionError:
                return False

        wait_for(healthy, timeout=PROCESS_START_S, what="ppoz gateway to answer /health")
        kea = KeaHTTPClient(f"http://127.0.0.1:{port}")
        kea.attach()
        kea.guided_step(OBS)
        kea.detach()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0  # no torch, nothing in flight: under 1 s alone; x20
        assert "gateway stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_generate_over_http(start_broker, start_actor, make_client, start_gateway, tiny_models):
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from models.policy_model import ModelSpec, load_policy

    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    broker = start_broker(max_new_tokens=32)
    start_actor(broker.backend, policy=LLMPolicy(model, tokenizer, SamplingConfig()))
    wait_for(lambda: actors_ready(make_client(broker.frontend), 1), what="the actor")
    base = url(start_gateway(broker.frontend))
    task = requests.post(f"{base}/attach", timeout=HTTP_S).json()["task_id"]
    body = {"task_id": task, "prompt": "hello there", "sampling": {"max_new_tokens": 5, "temperature": 0.9, "seed": 3}}
    reply = requests.post(f"{base}/generate", json=body, timeout=60)  # a few tokens of the tiny model: 0.05-0.5 s alone; x100
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["status"] == "ok" and out["n_tokens"] == 5 and out["finish_reason"] == "length" and isinstance(out["text"], str)
    assert out["task_id"] == task and out["logprob"] < 0 and out["policy_version"] == 0 and "rid" not in out
    assert requests.post(f"{base}/feedback", json={"task_id": task, "reward": 1.0, "done": True}, timeout=HTTP_S).status_code == 200
    # Bad input is named with the broker's words and the right status.
    too_long = requests.post(f"{base}/generate", json={**body, "sampling": {"max_new_tokens": 33}}, timeout=HTTP_S)
    assert too_long.status_code == 413 and "the limit is 32" in too_long.json()["error"]
    unknown = requests.post(f"{base}/generate", json={**body, "sampling": {"max_new_tokens": 4, "n": 2}}, timeout=HTTP_S)
    assert unknown.status_code == 400 and "unknown `sampling` keys: n" in unknown.json()["error"]
    empty = requests.post(f"{base}/generate", json={"task_id": task, "prompt": "", "sampling": {"max_new_tokens": 4}}, timeout=HTTP_S)
    assert empty.status_code == 400 and "`prompt` is empty" in empty.json()["error"]


@pytest.fixture
def echo_broker(zmq_context) -> Iterator[str]:
    """A stand-in broker that answers every generate `ok` with the `deadline_ms` it was sent as the text."""

    def answer(body: bytes) -> bytes:
        msg = p.decode(body)
        return p.encode(p.header(msg["op"], msg["rid"]) | {"task_id": msg["task_id"], "status": "ok", "text": repr(msg.get("deadline_ms"))})

    with router_stand_in(zmq_context, answer) as endpoint:
        yield endpoint


def test_a_generate_deadline_past_the_gateways_is_lowered_to_it(echo_broker, start_gateway):
    """deadline_ms 1e13 was a 400 about time_t (the waits' timeout overflowed); 10**400 no float holds. Both are
    capped at generate_deadline_s, and the broker is sent the capped value, so it stops when the gateway does."""
    base = url(start_gateway(echo_broker, generate_deadline_s=20.0))
    body = {"task_id": "qa-3", "prompt": "hi", "sampling": {"max_new_tokens": 4}}
    for asked, sent in ((10_000_000_000_000, 20_000), (10**400, 20_000), (1500, 1500), (None, None)):
        reply = requests.post(f"{base}/generate", json={**body, "deadline_ms": asked}, timeout=HTTP_S)
        assert reply.status_code == 200 and reply.json()["text"] == repr(sent), (str(asked)[:20], reply.text)


def post_raw(base: str, route: str, text: str) -> requests.Response:
    """A body sent as written: `requests`' json= refuses NaN, an emulator's own JSON writer may not."""
    return requests.post(f"{base}/{route}", data=text.encode(), headers={"Content-Type": "application/json"}, timeout=HTTP_S)


@pytest.mark.parametrize(
    "reward, words",
    [
        ("1e300", "`reward` 1e+300 is outside the accepted range [-1000000.0, 1000000.0] (max_abs_reward)"),
        ("-1e300", "`reward` -1e+300 is outside the accepted range [-1000000.0, 1000000.0] (max_abs_reward)"),
        ("1e400", "`reward` inf is not a finite number"),  # json reads a float past float64's range as inf
        ("1" + "0" * 400, "(401 digits) is outside the accepted range [-1000000.0, 1000000.0]"),  # an integer no float holds
        (
            "NaN",
            "`reward` is NaN, which JSON does not have (RFC 8259: no NaN or Infinity); a reward must be a finite number"
            " within [-1000000.0, 1000000.0] (max_abs_reward)",
        ),
        ("Infinity", "`reward` is Infinity, which JSON does not have"),
        ("-Infinity", "`reward` is -Infinity, which JSON does not have"),
    ],
)
def test_a_reward_the_learner_could_not_take_gets_400_at_the_gateway_and_the_step_still_waits(
    reward, words, start_broker, start_actor, make_client, start_gateway
):
    broker = start_broker()
    start_actor(broker.backend)
    status = make_client(broker.frontend)
    wait_for(lambda: actors_ready(status, 1), what="the actor")
    base = url(start_gateway(broker.frontend))
    task = requests.post(f"{base}/attach", timeout=HTTP_S).json()["task_id"]
    assert requests.post(f"{base}/step", json={"task_id": task, "obs": OBS}, timeout=HTTP_S).status_code == 200
    refused = post_raw(base, "feedback", f'{{"task_id": "{task}", "reward": {reward}, "done": true, "next_obs": {{}}}}')
    assert refused.status_code == 400 and refused.json()["code"] == "bad_request", refused.json()
    assert words in refused.json()["error"] and "nothing was forwarded" in refused.json()["error"], refused.json()
    counters = status.status()["counters"]
    assert counters["broker/feedbacks"] == 0 and counters["errors/bad_request"] == 0  # refused before the broker saw it
    assert status.status()["pending_steps"] == 1
    fixed = post_raw(base, "feedback", f'{{"task_id": "{task}", "reward": 0.5, "done": true, "next_obs": {{}}}}')
    assert fixed.status_code == 200 and fixed.json()["segment_closed"] is True
    assert status.status()["counters"]["broker/feedbacks"] == 1


def test_the_gateways_own_bound_and_a_nan_anywhere_in_a_body(start_broker, start_actor, make_client, start_gateway):
    broker = start_broker()
    start_actor(broker.backend)
    status = make_client(broker.frontend)
    wait_for(lambda: actors_ready(status, 1), what="the actor")
    base = url(start_gateway(broker.frontend, max_abs_reward=10))
    task = requests.post(f"{base}/attach", timeout=HTTP_S).json()["task_id"]
    nan_prompt = post_raw(base, "step", f'{{"task_id": "{task}", "obs": {{"prompt": "p", "question": "q", "action": ["a", NaN]}}}}')
    assert nan_prompt.status_code == 400 and "`obs.action[1]` is NaN" in nan_prompt.json()["error"]
    requests.post(f"{base}/step", json={"task_id": task, "obs": OBS}, timeout=HTTP_S).raise_for_status()
    over = requests.post(f"{base}/feedback", json={"task_id": task, "reward": 11, "done": False}, timeout=HTTP_S)
    assert over.status_code == 400 and "`reward` 11.0 is outside the accepted range [-10, 10] (max_abs_reward)" in over.json()["error"]
    assert status.status()["counters"]["broker/feedbacks"] == 0  # the broker (bound 1e6) would have taken 11
    assert requests.post(f"{base}/feedback", json={"task_id": task, "reward": -10, "done": False}, timeout=HTTP_S).status_code == 200
    with pytest.raises(ValueError, match="`max_abs_reward` must be a positive finite number, got inf"):
        GatewayConfig(max_abs_reward=float("inf"))
