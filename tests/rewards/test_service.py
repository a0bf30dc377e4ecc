"""The shared reward service on loopback: a real tiny reward model and the judge stand-in behind a real
ROUTER socket, called by the remote clients (and raw DEALER sockets for what a client would never send)."""

from __future__ import annotations

import math
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import zmq
from transformers import AutoTokenizer

from common import protocol
from rewards.composite import CompositeReward, Item
from rewards.config import RewardServiceConfig
from rewards.judge import Judge, JudgeConfig, Verdict
from rewards.reward_model import RewardModel, RewardModelConfig
from rewards.service import RemoteJudge, RemoteRewardModel, RewardService, RewardServiceClient, RewardServiceError
from tests.helpers import router_stand_in, wait_for
from tests.processes import free_port
from tests.rewards.test_composite import poisoned
from tests.rewards.test_judge import grader
from tests.rewards.test_reward_model import PAIRS
from tools.bench.judge_stand_in import chat_server

# A request to a reward service thread of this process: the tiny reward model scores a few pairs in 50-200 ms alone,
# the judge stand-in answers at once unless a test gives it a latency; x100 and more.
REQUEST_S = 30


@contextmanager
def serving(reward_model: Any = None, judge: Any = None, **settings: Any) -> Iterator[RewardService]:
    """A reward service on a random loopback port (or `bind`), its loop in a thread; stopped and closed on leaving."""
    settings.setdefault("bind", "tcp://127.0.0.1:*")
    names = {"reward_model": "tiny-rm" if reward_model is not None else "", "judge_model": "judge-1" if judge is not None else ""}
    service = RewardService(RewardServiceConfig(**names, **settings), reward_model, judge)
    service.start()
    thread = threading.Thread(target=service.run, name="reward-service", daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.stop()
        thread.join(30)  # the loop sees the stop within its poll and ends the batch in hand (under 1 s alone); x30
        service.close()


@pytest.fixture
def rm_dir(tiny_reward_model) -> str:
    return tiny_reward_model()


def local_judge(base_url: str) -> Judge:
    return Judge(JudgeConfig(model="judge-1", base_url=base_url, retries=0))


def judge_or_refuse(body: dict[str, Any], n: int) -> str:
    """The grader, except for prompts that ask for an unreadable reply."""
    return "I cannot tell." if "unreadable" in body["messages"][1]["content"] else grader(body, n)


@contextmanager
def dealer(endpoint: str) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


def ask(sock: zmq.Socket, body: Any, raw: bytes | None = None) -> dict[str, Any]:
    sock.send_multipart([b"", raw if raw is not None else msgpack.packb(body)])
    assert sock.poll(10_000), "no reply within 10 s"  # a refusal or a small batch: ms to 0.2 s alone; x50
    return msgpack.unpackb(sock.recv_multipart()[-1])


def test_reward_model_scores_through_the_service_equal_the_local_models(rm_dir) -> None:
    local = RewardModel(RewardModelConfig(rm_dir)).score(PAIRS)
    with serving(RewardModel(RewardModelConfig(rm_dir, batch_size=32))) as service:
        remote = RemoteRewardModel(service.endpoint, timeout_s=REQUEST_S)
        assert remote.components() == ["rm_score"]
        assert remote.score(PAIRS) == pytest.approx(local, abs=1e-5)
        assert remote.score([]) == []
        remote.close()


def test_a_judge_through_the_service_gives_the_local_judges_verdicts() -> None:
    items = [("2+3?", "so it is 5", "5"), ("2+2?", "it is 5", "4"), ("1+1?", "2", 2), ("unreadable?", "x", "1"), ("3?", "3", None)]
    with chat_server(judge_or_refuse) as api:
        local = local_judge(api.base_url).judge_many(items)
        with serving(judge=local_judge(api.base_url)) as service:
            remote = RemoteJudge(service.endpoint, timeout_s=REQUEST_S)
            verdicts = remote.judge_many(items)
            remote.close()
    assert [v.reward for v in local] == [1.0, 0.0, 1.0, None, 1.0]  # no ground truth: an empty reference, which "3" ends with
    fields = [(v.reward, v.raw_score, v.reply, v.error) for v in verdicts]
    assert fields == [(v.reward, v.raw_score, v.reply, v.error) for v in local]
    assert "no `Score: N`" in verdicts[3].error


def test_many_drivers_at_once_and_a_slow_judge_holds_up_neither_the_reward_model_nor_a_ping(rm_dir) -> None:
    """The judge is slow: the stand-in holds every call until the test lets them go. Meanwhile the three judge calls are
    at the stand-in together, a ping is answered and the reward model's requests too. (These were timings: the pings
    within 1 s, the reward model within 1.3 s and the judges within 2.9 s of a 1.5 s judge, which a loaded machine
    can miss; now each is the event itself, in the order that proves it.)"""
    local = RewardModel(RewardModelConfig(rm_dir)).score(PAIRS)
    results: dict[str, Any] = {}
    release = threading.Event()

    def rm_driver(i: int) -> None:
        client = RemoteRewardModel(service.endpoint, timeout_s=REQUEST_S)
        results[f"rm{i}"] = client.score(PAIRS[i:] + PAIRS[:i])
        client.close()

    def judge_driver(i: int) -> None:
        client = RemoteJudge(service.endpoint, timeout_s=REQUEST_S)
        results[f"judge{i}"] = client.judge_many([(f"{i}+0?", f"it is {i}", str(i))])
        client.close()

    def slow_judge(body: dict[str, Any], n: int) -> str:
        release.wait(REQUEST_S)  # held until let go (at most as long as the request's own timeout)
        return grader(body, n)

    # batch_wait_ms: the window in which the four drivers' requests must arrive to be scored together (they start in
    # ms alone). It was 300 ms: 1 s, so that a loaded machine's late thread still joins the batch.
    with chat_server(slow_judge) as api:
        judge = local_judge(api.base_url)
        with serving(RewardModel(RewardModelConfig(rm_dir, batch_size=32)), judge, batch_wait_ms=1000, judge_workers=4) as service:
            judges = [threading.Thread(target=judge_driver, args=(i,)) for i in range(3)]
            try:
                for t in judges:
                    t.start()
                wait_for(lambda: api.in_flight == 3, what="the three judge calls at the stand-in at once")
                RewardServiceClient(service.endpoint, timeout_s=5, retries=0).ping()  # answered while the judge holds three
                drivers = [threading.Thread(target=rm_driver, args=(i,)) for i in range(4)]
                for t in drivers:
                    t.start()
                for t in drivers:
                    t.join(REQUEST_S)  # the requests' own timeout: a driver held by the judge fails below
                assert sorted(results) == ["rm0", "rm1", "rm2", "rm3"], "a reward-model request waited for the judge"
            finally:
                release.set()
            for t in judges:
                t.join(REQUEST_S)
            batches, requests = service.counts["rm/batches"], service.counts["answered/rm_score"]
    for i in range(4):
        assert results[f"rm{i}"] == pytest.approx(local[i:] + local[:i], abs=1e-5)
    for i in range(3):
        (verdict,) = results[f"judge{i}"]
        assert verdict.reward == 1.0
    assert requests == 4 and batches < 4  # drivers' requests scored together


def test_bad_requests_get_named_errors_and_the_service_goes_on(rm_dir) -> None:
    with serving(RewardModel(RewardModelConfig(rm_dir)), max_items=4, max_request_bytes=4096) as service, dealer(service.endpoint) as sock:
        cases = [
            (None, b"\xc1 not msgpack", "bad_request", "not valid msgpack"),
            ({"op": "rm_score", "pairs": [["p", "r"]]}, None, "bad_request", "`rid`"),
            ({"op": "score_it", "rid": "a"}, None, "unknown_op", "ping, rm_score, judge"),
            ({"op": 7, "rid": "b"}, None, "bad_request", "`op` must be a str"),
            ({"op": "rm_score", "rid": "c"}, None, "bad_request", "`pairs` is missing"),
            ({"op": "rm_score", "rid": "d", "pairs": "p"}, None, "bad_request", "`pairs` must be an array"),
            (
                {"op": "rm_score", "rid": "e", "pairs": [["p", "r"], ["p", 3]]},
                None,
                "bad_request",
                "`pairs[1][1]` (response) must be a str",
            ),
            ({"op": "rm_score", "rid": "f", "pairs": [["p"]]}, None, "bad_request", "`pairs[0]` must be an array [prompt, response]"),
            ({"op": "rm_score", "rid": "g", "pairs": [["p", "r"]] * 5}, None, "too_large", "5 entries, the limit is 4"),
            ({"op": "rm_score", "rid": "h", "pairs": [["p" * 5000, "r"]]}, None, "too_large", "the limit is 4096"),
            ({"op": "judge", "rid": "i", "items": [["p", "r", "1"]]}, None, "not_hosted", "hosts no judge"),
        ]
        for body, raw, code, words in cases:
            reply = ask(sock, body, raw)
            assert reply["error"]["code"] == code and words in reply["error"]["message"], (body, reply)
            if isinstance(body, dict) and isinstance(body.get("rid"), str):
                assert reply["rid"] == body["rid"]
        assert ask(sock, {"op": "rm_score", "rid": "ok", "pairs": [["p", "r"]]})["scores"][0] == pytest.approx(
            RewardModel(RewardModelConfig(rm_dir)).score([("p", "r")])[0], abs=1e-5
        )
        with pytest.raises(RewardServiceError, match=r"refused `judge`: not_hosted"):
            RemoteJudge(service.endpoint, timeout_s=5).request("judge", items=[["p", "r", "1"]])  # refused at once: ms; x1000
        assert service.counts["errors/bad_request"] == 7 and service.counts["errors/too_large"] == 2


def test_a_pair_the_model_cannot_take_fails_its_own_request_alone_not_the_batch_it_shared(tmp_path, tiny_reward_model) -> None:
    path = shutil.copytree(tiny_reward_model("llama"), tmp_path / "chat-rm")  # a copy: its tokenizer gets a chat template
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(path)
    model = RewardModel(RewardModelConfig(str(path), max_length=64))  # a chat whose response alone is over 64 tokens cannot be scored
    good = [PAIRS[0], PAIRS[2]]
    expected = RewardModel(RewardModelConfig(str(path), max_length=64)).score(good)
    with serving(model, batch_wait_ms=300) as service:
        results: dict[str, Any] = {}

        def driver(name: str, pairs: list[tuple[str, str]]) -> None:
            try:
                results[name] = RemoteRewardModel(service.endpoint, timeout_s=REQUEST_S).score(pairs)
            except RewardServiceError as e:
                results[name] = e

        threads = [threading.Thread(target=driver, args=("good", good)), threading.Thread(target=driver, args=("bad", [("p", "x" * 400)]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_S)  # the requests' own timeout
        assert service.counts["errors/scoring_failed"] == 1
    assert results["good"] == pytest.approx(expected, abs=1e-5)
    assert isinstance(results["bad"], RewardServiceError)
    assert "refused `rm_score`: scoring_failed: the reward model failed: RewardError: a response alone is longer" in str(results["bad"])


def test_a_service_that_is_down_times_out_clearly_and_its_responses_go_unrewarded() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    remote = RemoteRewardModel(endpoint, timeout_s=0.3, retries=1)  # the timeouts under test: nothing answers
    started = time.monotonic()
    with pytest.raises(RewardServiceError, match=re.escape(f"the reward service at {endpoint} did not answer `rm_score` after 2 attempts")):
        remote.score(PAIRS[:1])
    # two 0.3 s attempts and the pause between them, not the drivers' default minutes: the bound was 2 s (1.5 s was
    # seen beside two spinners), 4 s
    assert time.monotonic() - started < 4.0
    reward = CompositeReward(
        {"rm_score": 0.5, "judge_score": 0.5}, reward_model=remote, judge=RemoteJudge(endpoint, timeout_s=0.3, retries=0)
    )
    (scored,) = reward.score([Item("What is 2+3?", "5", "5", where="val.jsonl line 1")])
    assert scored.reward is None and scored.components == {}
    assert scored.error.startswith("val.jsonl line 1: the reward service at") and "did not answer" in scored.error
    judged = CompositeReward({"judge_score": 1.0}, judge=RemoteJudge(endpoint, timeout_s=0.3, retries=0)).score([Item("p", "r", "1")])
    assert judged[0].reward is None and "did not answer `judge`" in judged[0].error


def test_a_client_retries_on_a_fresh_socket_until_the_service_comes_up(rm_dir) -> None:
    port = free_port()
    remote = RemoteRewardModel(f"tcp://127.0.0.1:{port}", timeout_s=0.5, retries=20)  # the attempts under test
    got: list[Any] = []
    caller = threading.Thread(target=lambda: got.append(remote.score(PAIRS[:2])))
    caller.start()
    # two attempts have gone unanswered, the third is out: waited for (it was 1.2 s of sleep, which a loaded machine's
    # late attempts need not fill); 1 s of 0.5 s attempt timers alone, x10
    wait_for(lambda: remote.attempts >= 3, what="three attempts")
    with serving(RewardModel(RewardModelConfig(rm_dir)), bind=f"tcp://127.0.0.1:{port}") as service:
        caller.join(REQUEST_S)  # the next attempt (0.5 s), then a small batch; x30
        assert got and got[0] == pytest.approx(RewardModel(RewardModelConfig(rm_dir)).score(PAIRS[:2]), abs=1e-5)
        assert remote.attempts >= 3 and service.counts["answered/rm_score"] == 1


def test_a_retried_request_joins_the_one_in_progress_and_is_judged_once() -> None:
    with chat_server(lambda body, n: (200, 0.8, "Score: 1")) as api:
        with serving(judge=local_judge(api.base_url)) as service, dealer(service.endpoint) as first, dealer(service.endpoint) as second:
            body = {"op": "judge", "rid": uuid.uuid4().hex, "items": [["p", "r", "1"]]}
            first.send_multipart([b"", msgpack.packb(body)])
            wait_for(lambda: api.requests, what="the first at the judge")  # it was a 0.2 s sleep; ms alone
            again = ask(second, body)  # the same rid from a new socket, as a client that timed out sends it
            assert first.poll(5000)  # the stand-in's 0.8 s, a timer, and ms of work; x6
            replies = [again, msgpack.unpackb(first.recv_multipart()[-1])]
    assert [r["verdicts"][0]["reward"] for r in replies] == [1.0, 1.0]
    assert len(api.requests) == 1 and service.counts["retries_joined"] == 1


def test_two_clients_with_one_rid_get_their_own_verdicts_never_each_others() -> None:
    """A second client that reuses a rid in progress, with other items, is judged on its own items: the rid
    alone once joined it to the first request, and it read the first client's verdict."""
    with chat_server(lambda body, n: (200, 0.8, "Score: 1" if "the right answer" in str(body) else "Score: 0")) as api:
        with serving(judge=local_judge(api.base_url)) as service, dealer(service.endpoint) as first, dealer(service.endpoint) as second:
            rid = uuid.uuid4().hex
            first.send_multipart([b"", msgpack.packb({"op": "judge", "rid": rid, "items": [["p", "the right answer", "1"]]})])
            wait_for(lambda: api.requests, what="the first at the judge")  # it was a 0.2 s sleep; ms alone
            theirs = ask(second, {"op": "judge", "rid": rid, "items": [["p", "a wrong one", "1"]]})
            assert first.poll(5000)  # the stand-in's 0.8 s, a timer, and ms of work; x6
            mine = msgpack.unpackb(first.recv_multipart()[-1])
    assert mine["rid"] == theirs["rid"] == rid
    assert (mine["verdicts"][0]["reward"], theirs["verdicts"][0]["reward"]) == (1.0, 0.0)
    assert len(api.requests) == 2 and service.counts["retries_joined"] == 0


def test_the_service_config_is_checked_at_start() -> None:
    for bad, words in [
        ({}, "hosts nothing"),
        ({"reward_model": "m", "batch_size": 0}, "batch_size"),
        ({"judge_model": "j", "judge_concurrency": 0}, r"\[reward_service\] judge_concurrency"),
        ({"reward_model": "m", "queue_timeout_s": 0}, "queue_timeout_s"),
        ({"reward_model": "m", "max_abs_reward": 0}, r"\[reward_service\] max_abs_reward = 0: must be a positive finite number"),
        ({"reward_model": "m", "max_abs_reward": math.nan}, r"\[reward_service\] max_abs_reward = nan"),
    ]:
        with pytest.raises(ValueError, match=words):
            RewardServiceConfig(**bad)
    assert RewardServiceConfig(reward_model="m").max_abs_reward == 1e6


def test_the_drivers_reward_bounds_are_checked_at_start() -> None:
    from dataset_driver.config import TrainConfig

    settings = TrainConfig(data="x.jsonl")
    assert (settings.max_abs_reward, settings.reward_fn_timeout_s) == (1e6, 30.0)
    for bad, words in [
        ({"max_abs_reward": math.inf}, r"\[train\] max_abs_reward = inf: must be a positive finite number"),
        ({"max_abs_reward": -1.0}, r"\[train\] max_abs_reward = -1.0"),
        ({"reward_fn_timeout_s": 0}, r"\[train\] reward_fn_timeout_s = 0: must be a positive number of seconds"),
    ]:
        with pytest.raises(ValueError, match=words):
            TrainConfig(data="x.jsonl", **bad)


# --- issue 28: no number that cannot be a reward crosses the service, either way ------------------------------
def test_a_score_that_cannot_be_a_reward_goes_out_as_nil_for_its_pair_alone(rm_dir) -> None:
    model = RewardModel(RewardModelConfig(rm_dir))
    poisoned(model, "~")  # any pair holding "~" scores NaN
    pairs = [("Say hi.", "hi"), ("Say hi.", "h~i"), ("Name one.", "one")]
    local = RewardModel(RewardModelConfig(rm_dir)).score([pairs[0], pairs[2]])
    with serving(model) as service, dealer(service.endpoint) as sock:
        raw = ask(sock, {"op": "rm_score", "rid": "r1", "pairs": [list(pair) for pair in pairs]})
        assert raw["scores"][1] is None and raw["errors"] == ["", "the reward model's score nan is not a finite number", ""]
        assert all(s is None or math.isfinite(s) for s in raw["scores"])  # no NaN on the wire
        remote = RemoteRewardModel(service.endpoint, timeout_s=REQUEST_S)
        scores = remote.score(pairs)
        reward = CompositeReward({"rm_score": 1.0}, reward_model=remote)
        scored = reward.score([Item(p, r, where=f"d.jsonl line {n}") for n, (p, r) in enumerate(pairs, 1)])
        refused = service.counts["rm/refused_scores"]
    assert [scores[0], scores[2]] == pytest.approx(local, abs=1e-5)
    assert isinstance(scores[1], RewardServiceError) and scores[1].reason == "refused_by_service"
    assert (
        str(scores[1]) == f"the reward service at {service.endpoint} sent no rm_score: the reward model's score nan is not a finite number"
    )
    assert [s.reward is None for s in scored] == [False, True, False] and scored[1].error.startswith(
        "d.jsonl line 2: the reward service at"
    )
    assert reward.unrewarded == {"rm_score/refused_by_service": 1} and refused == 3  # the raw request, the client's, the composite's


@contextmanager
def older_service(reply: dict[str, Any]) -> Iterator[str]:
    """A service of another version that sends `reply` (with the request's op and rid) to every request but ping."""

    def answer(body: bytes) -> bytes:
        request = msgpack.unpackb(body)
        answer = {"components": ["rm_score", "judge_score"]} if request["op"] == "ping" else reply
        return msgpack.packb({"op": request["op"], "rid": request["rid"], **answer})

    with router_stand_in(zmq.Context.instance(), answer) as endpoint:
        yield endpoint


def test_the_clients_hold_a_reply_to_the_bound_whatever_the_service_sends() -> None:
    scores = [math.nan, 1e300, -math.inf, 0.5, 2e6]
    with older_service({"scores": scores}) as endpoint:  # its replies come at once (ms): the clients' 5 s are x1000
        got = RemoteRewardModel(endpoint, timeout_s=5, max_abs_reward=1e6).score([("p", str(n)) for n in range(5)])
        small = RemoteRewardModel(endpoint, timeout_s=5, max_abs_reward=0.25).score([("p", str(n)) for n in range(5)])
    assert got[3] == 0.5 and small[3].reason == "out_of_range"  # a smaller bound of the driver's own holds too
    assert [e.reason for e in got if isinstance(e, RewardServiceError)] == ["not_finite", "out_of_range", "not_finite", "out_of_range"]
    assert f"the reward service at {endpoint} sent rm_score 1e+300 is outside the accepted range" in str(got[1])
    verdict = {"raw_score": 1.0, "reply": "Score: 1", "error": "", "cached": False}
    rewards = [math.nan, 1e300, 1.5, -0.5, 0.75]
    with older_service({"verdicts": [{**verdict, "reward": r} for r in rewards]}) as endpoint:
        verdicts = RemoteJudge(endpoint, timeout_s=5).judge_many([("p", str(n), None) for n in range(5)])
    assert [v.reward for v in verdicts] == [None, None, None, None, 0.75]
    assert f"the reward service at {endpoint}: the judge's reward 1e+300 is not a number in [0, 1]" == verdicts[1].error


def test_a_service_nobody_runs_is_reported_within_seconds_with_its_address_and_each_try_logged(caplog) -> None:
    """At start a driver asks the service what it hosts: before, that waited 3 silent minutes (60 s x 3 attempts)."""
    caplog.set_level("WARNING", logger="rewards.service.client")
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    client = RewardServiceClient(endpoint)  # the drivers' defaults: 60 s and 2 retries for a scoring request
    started = time.monotonic()
    with pytest.raises(RewardServiceError, match=re.escape(f"the reward service at {endpoint} did not answer `ping` after 3 attempts")):
        client.components()
    assert time.monotonic() - started < 15  # 3 x 1.5 s + 2 x 1 s of timers, and 8.5 s for a loaded machine
    tries = [r.getMessage() for r in caplog.records if "no answer to `ping`" in r.getMessage()]
    assert tries == [f"the reward service at {endpoint}: no answer to `ping` within 1.5 s (try {n} of 3), retrying in 1 s" for n in (1, 2)]
    once = RewardServiceClient(endpoint, timeout_s=1.0, retries=0)  # as `ppoz up` polls a service it started: one try
    started = time.monotonic()
    with pytest.raises(RewardServiceError, match="after 1 attempts"):  # one try: the message counts them
        once.ping()
    assert time.monotonic() - started < 5  # its 1 s, not minutes (the bound was 2 s: 5 s, for a loaded machine)


def test_the_record_count_and_size_are_refused_before_anything_is_decoded_or_scored(monkeypatch) -> None:
    """5 million empty pairs fit in 15 MB: decoding them took the service's loop seconds (11 s for 20 million), every
    other request waiting, only to refuse them for their number. The length of `pairs` or `items` is read from the
    array's header, and a request over `max_request_bytes` is refused by its size, before anything is decoded."""

    class Spy:
        calls = 0

        def score(self, pairs: list[tuple[str, str]]) -> list[float]:
            self.calls += 1
            return [0.5] * len(pairs)

        def judge_many(self, items: list[tuple[str, str, Any]]) -> list[Verdict]:
            self.calls += 1
            return [Verdict(1.0, 1.0, "Score: 1")] * len(items)

    def many(op: str, field: str, row: bytes, n: int) -> bytes:  # {op, rid, field: [row] * n}, written by hand
        head = b"".join(msgpack.packb(x) for x in ("op", op, "rid", f"many-{field}", field))
        return b"\x83" + head + b"\xdd" + n.to_bytes(4, "big") + row * n

    decoded: list[int] = []
    decode = protocol.decode
    monkeypatch.setattr(protocol, "decode", lambda frame: decoded.append(len(frame)) or decode(frame))
    spy = Spy()
    limit = 24 * 1024 * 1024
    with serving(spy, spy, max_request_bytes=limit) as service, dealer(service.endpoint) as sock:
        cases = [
            (many("rm_score", "pairs", b"\x92\xa0\xa0", 5_000_000), "`pairs` has 5000000 entries, the limit is 1024"),
            (many("judge", "items", b"\x93\xa0\xa0\xc0", 5_000_000), "`items` has 5000000 entries, the limit is 1024"),
            (msgpack.packb({"op": "rm_score", "rid": "big", "pairs": [["p" * limit, "r"]]}), f"the limit is {limit}"),
        ]
        for body, words in cases:
            started = time.monotonic()
            reply = ask(sock, None, body)
            took = time.monotonic() - started
            assert reply["error"]["code"] == "too_large" and words in reply["error"]["message"], reply
            # a timing claim, kept beside the proof below that nothing was decoded: the header read and the refusal
            # take ms once the 15-24 MB are across; decoding 5 million entries takes 3 s. Passed under --busy 2.
            assert reply["rid"] is not None and took < 1.0, f"refused after {took:.2f} s"
        assert max(decoded, default=0) < 1024 and spy.calls == 0  # nothing of them decoded, nothing scored
        assert ask(sock, {"op": "rm_score", "rid": "ok", "pairs": [["p", "r"]]})["scores"] == [0.5] and spy.calls == 1
