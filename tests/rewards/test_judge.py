"""The LLM judge through the official openai client against a local stand-in of the chat-completions API."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from rewards.functions import RewardError
from rewards.judge import Judge, JudgeConfig, api_key, parse_score
from tools.bench.judge_stand_in import chat_server


def grader(body: dict[str, Any], n: int) -> str:
    """A judge that reads the reference and the response out of the math preset's message and compares them."""
    user = body["messages"][1]["content"]
    reference = re.search(r"Reference answer:\n(.*?)\n\nResponse:", user, re.S).group(1)
    response = re.search(r"Response:\n(.*?)\n\nIs the response", user, re.S).group(1)
    return f"The reference is {reference}.\nScore: {int(response.strip().endswith(reference))}"


def make(server, **kw: Any) -> Judge:
    return Judge(JudgeConfig(model="judge-1", base_url=server.base_url, retries=kw.pop("retries", 0), **kw))


def test_the_math_preset_scores_through_the_api_with_the_rendered_template_and_the_key(monkeypatch) -> None:
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-123")
    with chat_server(grader) as server:
        judge = make(server, api_key_env="MY_JUDGE_KEY")
        items = [("2+3?", "so it is 5", "5"), ("2+2?", "it is 5", "4"), ("1+1?", "2", 2)]
        verdicts = judge.judge_many(items)
        judge.close()
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0] and [v.raw_score for v in verdicts] == [1.0, 0.0, 1.0]
    body, headers = next((b, h) for b, h in server.requests if "2+3?" in b["messages"][1]["content"])
    assert body["model"] == "judge-1" and body["temperature"] == 0.0 and body["max_tokens"] == 512
    assert body["messages"][0]["role"] == "system" and "Score: N" in body["messages"][0]["content"]
    assert "Problem:\n2+3?\n\nReference answer:\n5\n\nResponse:\nso it is 5" in body["messages"][1]["content"]
    assert headers["authorization"] == "Bearer sk-test-123"


def test_replies_it_cannot_read_are_counted_never_a_silent_zero() -> None:
    replies = iter(["Looks good to me.", "Score: 7", "Score: 0.5", "**Score:** 1"])
    with chat_server(lambda body, n: next(replies)) as server:
        judge = make(server)
        verdicts = [judge.judge(f"p{i}", "r", "1") for i in range(4)]
    assert [v.reward for v in verdicts] == [None, None, 0.5, 1.0]
    assert "no `Score: N`" in verdicts[0].error and "outside its scale, 0 to 1" in verdicts[1].error
    assert judge.counts["unreadable"] == 2
    assert parse_score("first Score: 3 then Score: 8", 1, 10) == (8.0, "")  # the last one counts


def test_server_errors_are_retried_with_back_off_then_reported() -> None:
    with chat_server(lambda body, n: (500, 0.0, "overloaded") if n <= 2 else "Score: 1") as server:
        verdict = make(server, retries=2).judge("p", "r", "1")
    assert verdict.reward == 1.0 and len(server.requests) == 3
    with chat_server(lambda body, n: (503, 0.0, "down")) as server:
        judge = make(server, retries=1)
        verdict = judge.judge("p", "r", "1")
    assert verdict.reward is None and "InternalServerError" in verdict.error and len(server.requests) == 2
    assert judge.counts["failed"] == 1


def test_a_slow_judge_times_out() -> None:
    with chat_server(lambda body, n: (200, 3.0, "Score: 1")) as server:
        started = time.monotonic()
        verdict = make(server, timeout_s=0.3).judge("p", "r", "1")
        elapsed = time.monotonic() - started
    # its 0.3 s timeout, not the stand-in's 3 s: 2.2 s left for a loaded machine
    assert verdict.reward is None and "Timeout" in verdict.error and elapsed < 2.5


def test_concurrency_is_limited_and_repeated_requests_come_from_the_cache() -> None:
    with chat_server(lambda body, n: (200, 0.15, "Score: 1")) as server:
        judge = make(server, concurrency=3)
        items = [(f"prompt {i}", "r", "1") for i in range(12)]
        assert all(v.reward == 1.0 for v in judge.judge_many(items))
        assert server.most_in_flight == 3  # 12 requests, never more than 3 at once (and the limit was reached)
        again = judge.judge_many(items[:4])
        judge.close()
    assert all(v.cached for v in again) and len(server.requests) == 12 and judge.counts["cache_hits"] == 4


def test_keys_providers_and_settings_are_checked(monkeypatch) -> None:
    for name in ("DASHSCOPE_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "ANTHROPIC_API_KEY", "CLAUDE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RewardError, match="needs an API key in DASHSCOPE_API_KEY"):
        Judge(JudgeConfig(model="qwen-plus", provider="dashscope"))
    with pytest.raises(RewardError, match="ANTHROPIC_API_KEY or CLAUDE_API_KEY"):
        Judge(JudgeConfig(model="claude", provider="claude"))
    monkeypatch.setenv("GOOGLE_API_KEY", "g-key")  # the second name a provider accepts
    assert api_key(JudgeConfig(model="gemini-x", provider="gemini")) == "g-key"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    with chat_server(lambda body, n: "Score: 1") as server:  # a server of one's own: the provider's key is not sent to it
        Judge(JudgeConfig(model="m", base_url=server.base_url, retries=0)).judge("p", "r")
        Judge(JudgeConfig(model="m", base_url=server.base_url, api_key_env="GOOGLE_API_KEY", retries=0)).judge("q", "r")
    assert [h["authorization"] for _, h in server.requests] == ["Bearer none", "Bearer g-key"]


def test_the_openai_account_headers_go_to_openai_alone(monkeypatch) -> None:
    """The openai package sends OPENAI_ORG_ID and OPENAI_PROJECT_ID as headers to any base_url: they name the
    user's OpenAI account, so a judge of one's own (or another provider) must not get them."""
    monkeypatch.setenv("OPENAI_ORG_ID", "org-private")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-private")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    with chat_server(lambda body, n: "Score: 1") as server:
        Judge(JudgeConfig(model="m", base_url=server.base_url, retries=0)).judge("p", "r")
        Judge(JudgeConfig(model="m", base_url=server.base_url, api_key_env="OPENAI_API_KEY", retries=0)).judge("q", "r")
    assert len(server.requests) == 2
    for _, headers in server.requests:
        assert not {"openai-organization", "openai-project"} & headers.keys(), headers
    assert all("private" not in value for _, headers in server.requests for value in headers.values())
    own = Judge(JudgeConfig(model="gpt-x", provider="openai"))  # OpenAI's own endpoint keeps them (nothing is sent here)
    assert (own.client.organization, own.client.project) == ("org-private", "proj-private")
    assert own.client.default_headers["OpenAI-Organization"] == "org-private"
    own.close()
    for bad, words in [
        (dict(model=""), "needs `model`"),
        (dict(model="m", provider="acme"), "provider"),
        (dict(model="m", preset="poetry"), "preset"),
        (dict(model="m", template="{prompt} {answer}"), "only {prompt}"),
        (dict(model="m", concurrency=0), "concurrency"),
        (dict(model="m", score_low=5, score_high=1), "low < high"),
    ]:
        with pytest.raises(ValueError, match=words):
            JudgeConfig(**bad)


def test_a_template_of_ones_own_with_its_range() -> None:
    with chat_server(lambda body, n: "Reasoning.\nScore: 4") as server:
        judge = make(server, preset="dialogue", template="Q: {prompt}\nA: {response}", score_low=0, score_high=8)
        verdict = judge.judge("hi", "hello")
    assert verdict.reward == 0.5 and server.requests[0][0]["messages"][1]["content"] == "Q: hi\nA: hello"


def reply_for(replies: dict[str, str]):
    """A judge whose reply is chosen by the response it is shown (the requests overlap, so not by order)."""
    return lambda body, n: replies[body["messages"][1]["content"].rsplit("\n", 1)[-1]]


def test_scores_are_read_by_the_documented_grammar_and_anything_else_is_unreadable(caplog) -> None:
    """A fraction, an exponent, a number off the scale or two numbers are unreadable; today's `Score: 1e-9`
    and `Score: 1/10` no longer read as 1 (a reward of 1.0 on the math preset)."""
    math_replies = {"r1": "Tiny.\nScore: 1e-9", "r2": "Score: 1/10", "r3": "Score: -1", "r4": "Score: 1", "r5": "**Score:** 0.5"}
    code_replies = {
        "c1": "Good.\nScore: 7",
        "c2": "Score: 7.5",
        "c3": "score: 10",
        "c4": "Score: 11",
        "c5": "Score: 7 or 8",
        "c6": "Score: seven",
        "c7": "Score: 3\nOn reflection,\nScore: 9.",  # the last label counts
    }
    caplog.set_level("WARNING", logger="rewards.judge")
    with chat_server(reply_for({**math_replies, **code_replies})) as server:
        math_judge = make(server, template="{prompt}\n{response}")
        code_judge = make(server, preset="code", template="{prompt}\n{response}")
        on_math = math_judge.judge_many([("p", r, "1") for r in math_replies])
        on_code = code_judge.judge_many([("p", r, "") for r in code_replies])
    assert [v.reward for v in on_math] == [None, None, None, 1.0, 0.5]
    assert [v.reward for v in on_code] == [0.7, 0.75, 1.0, None, None, None, 0.9]
    assert "'1e-9' is not one number in digits (an integer or a decimal from 0 to 1)" in on_math[0].error
    assert "'1/10' is not one number in digits" in on_math[1].error
    assert "the judge's score -1 is outside its scale, 0 to 1" in on_math[2].error
    assert "the judge's score 11 is outside its scale, 0 to 10" in on_code[3].error
    assert "'7 or 8' is not one number" in on_code[4].error and "'seven' is not one number" in on_code[5].error
    assert math_judge.counts["unreadable"] == 3 and code_judge.counts["unreadable"] == 3
    logged = [r.getMessage() for r in caplog.records if r.name == "rewards.judge"]
    assert len(logged) == 6 and any("Tiny.\\nScore: 1e-9" in m for m in logged)  # the raw reply, in the log


def test_the_edges_of_the_grammar() -> None:
    long_reply = "blah " * 2000 + "Score: 1/10"
    value, why = parse_score(long_reply, 0, 10)
    assert value is None and len(why) < 200
    assert parse_score("Score: _7_.", 0, 10) == (7.0, "") and parse_score("Score = +3", 0, 10) == (3.0, "")
    assert parse_score("Score: " + "9" * 400, 0, 10)[0] is None  # float("99...9") is inf: off any scale
    assert parse_score("Score:\n7", 0, 10)[0] is None  # the number must be on the label's line
    assert parse_score("subscore: 7", 0, 10)[0] is None  # a label is the word `score`, not part of one
    assert parse_score("Score: \u0667", 0, 10)[0] is None and parse_score("Score: \uff17", 0, 10)[0] is None  # not ASCII digits


def test_a_long_unreadable_reply_is_truncated_in_the_log(caplog) -> None:
    caplog.set_level("WARNING", logger="rewards.judge")
    with chat_server(lambda body, n: "blah " * 2000 + "Score: 1/10") as server:
        verdict = make(server).judge("p", "r", "1")
    assert verdict.reward is None
    [record] = [r for r in caplog.records if r.name == "rewards.judge"]
    assert len(record.getMessage()) < 600 and record.getMessage().endswith("Score: 1/10'")
