"""The retry rule both clients share (client/retry.py), decided without sockets."""

from __future__ import annotations

import time

import pytest

from client import errors
from client.retry import RETRIED_CODES, RetryRule, build_request, check_timeouts, feedback_fields
from common import protocol as p


def error_reply(code: str, **extra) -> dict:
    return p.error_body("r1", "step", code, "why", **extra)


def test_each_request_gets_a_fresh_rid_unless_one_is_given():
    a, b = build_request("ping"), build_request("ping")
    assert a["rid"] != b["rid"] and len(a["rid"]) == 32
    body = build_request("step", "s1", {"task_id": "emu-7"})
    assert body == {"proto": "ppoz", "v": 1, "op": "step", "rid": "s1", "task_id": "emu-7"}


def test_every_attempt_sends_the_same_bytes_with_the_same_rid():
    rule = RetryRule("step", None, {"task_id": "t"}, deadline=5, attempt_timeout=1)
    assert p.decode(rule.data) == rule.body and rule.body["rid"] == rule.rid


def test_feedback_sends_next_obs_only_when_it_is_an_observation():
    assert "next_obs" not in feedback_fields("t", 0.5, next_obs={})
    assert "next_obs" not in feedback_fields("t", 0.5, next_obs=None)
    obs = {"prompt": "p", "action": ["a"]}
    assert feedback_fields("t", 0.5, truncated=True, next_obs=obs) == {
        "task_id": "t",
        "reward": 0.5,
        "done": False,
        "truncated": True,
        "next_obs": obs,
    }


def test_a_reply_without_error_is_the_answer():
    rule = RetryRule("ping", None, {}, deadline=5, attempt_timeout=1)
    assert rule.wait_before_retry({"rid": rule.rid, "status": "ok"}) is None


@pytest.mark.parametrize("code", sorted(RETRIED_CODES))
def test_retried_codes_wait_retry_after_ms_or_100_ms(code):
    rule = RetryRule("step", None, {}, deadline=5, attempt_timeout=1)
    assert rule.wait_before_retry(error_reply(code, retry_after_ms=250)) == pytest.approx(0.25)
    assert rule.wait_before_retry(error_reply(code)) == pytest.approx(0.1)
    assert rule.wait_before_retry(error_reply(code, retry_after_ms="soon")) == pytest.approx(0.1)


@pytest.mark.parametrize("code", sorted(set(p.ERROR_CODES) - RETRIED_CODES) + ["a_code_from_the_future"])
def test_other_codes_raise_their_exception_at_once(code):
    rule = RetryRule("step", None, {}, deadline=5, attempt_timeout=1)
    with pytest.raises(errors.BY_CODE.get(code, errors.PPOZError)) as info:
        rule.wait_before_retry(error_reply(code))
    assert info.value.code == errors.BY_CODE.get(code, errors.PPOZError).code
    assert info.value.reply["error"]["code"] == code


def test_every_error_code_has_its_own_exception_class():
    assert set(errors.BY_CODE) == set(p.ERROR_CODES)
    assert len(set(errors.BY_CODE.values())) == len(p.ERROR_CODES)


def test_a_retry_that_would_end_past_the_deadline_raises_the_error():
    rule = RetryRule("step", None, {}, deadline=0.5, attempt_timeout=1)
    with pytest.raises(errors.Overloaded):
        rule.wait_before_retry(error_reply(p.E_OVERLOADED, retry_after_ms=1000))


def test_attempts_are_bounded_by_the_attempt_timeout_and_the_deadline():
    # what is left of the deadline, read at once: the deadline was 0.3 s and the bound 0.2 s, so a stall of 0.1 s between
    # the two lines (a loaded machine's) failed it; 3 s and 2 s leave it a second
    rule = RetryRule("step", None, {}, deadline=3, attempt_timeout=10)
    assert 2 < rule.next_attempt() <= 3
    rule = RetryRule("step", None, {}, deadline=30, attempt_timeout=2)
    assert rule.next_attempt() == 2
    rule = RetryRule("step", None, {}, deadline=0.05, attempt_timeout=2)
    time.sleep(0.06)  # past the deadline under test: load can only make it later
    with pytest.raises(errors.RequestTimeout, match="no reply to step within 0.1 s"):
        rule.next_attempt()


@pytest.mark.parametrize(
    "deadline, attempt, bad",
    [
        (0, 1, "`deadline`"),
        (-1, 1, "`deadline`"),
        (5, 0, "`attempt_timeout`"),
        (float("inf"), 1, "`deadline`"),
        (5, None, "`attempt_timeout`"),
    ],
)
def test_timeouts_must_be_positive_and_named_when_not(deadline, attempt, bad):
    with pytest.raises(ValueError, match=bad):
        check_timeouts(deadline, attempt)
