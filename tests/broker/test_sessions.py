"""The session state machine (pure: no Redis, no sockets)."""

import pytest

from broker import sessions as s


def step(n, rid=None, version=3):
    obs = {"prompt": f"screen {n}", "question": "q", "action": ["a", "b"]}
    return s.PendingStep(rid or f"r{n}", "step", obs, 1, -0.7, [0.5, 0.5], version, 0, b"reply")


def test_feedback_turns_the_pending_step_into_a_transition():
    session = s.Session("t", segment_len=4)
    assert session.record_step(step(0)) == ([], False)
    transition, closes = session.record_feedback(0.5, False, False, None)
    assert closes == []
    assert transition.obs.prompt == "screen 0"
    assert (transition.action, transition.logprob, transition.reward, transition.policy_version) == (1, -0.7, 0.5, 3)
    assert session.pending is None and session.open_len == 1


def test_full_segment_closes_at_the_next_step_with_its_observation_as_next_obs():
    session = s.Session("t", segment_len=2)
    for n in range(2):
        session.record_step(step(n))
        session.record_feedback(1.0, False, False, None)
    closes, orphaned = session.record_step(step(2))
    assert not orphaned
    assert len(closes) == 1
    close = closes[0]
    assert (close.seg_id, close.reason, close.length, close.done, close.truncated) == ("t:0", "length", 2, False, False)
    assert close.next_obs["prompt"] == "screen 2"
    assert session.seq == 1 and session.open_len == 0


def test_a_segment_closes_by_age_once_a_step_is_scored_max_versions_after_its_first_transition():
    """A slow client's segment: its transitions span policy versions 5, 5, 6; the step scored at version 7 (two past
    the first) closes it, long before it holds segment_len transitions, and the next one starts at 7."""
    session = s.Session("t", segment_len=32)
    for n, version in enumerate((5, 5, 6)):
        assert session.record_step(step(n, version=version), max_versions=2) == ([], False)
        session.record_feedback(1.0, False, False, None)
    assert session.open_version == 5
    closes, _ = session.record_step(step(3, version=7), max_versions=2)
    assert [(c.reason, c.length, c.next_obs["prompt"]) for c in closes] == [("age", 3, "screen 3")]
    session.record_feedback(0.0, False, False, None)
    assert session.open_version == 7 and session.open_len == 1
    # max_versions 0: by length alone, however old
    assert session.record_step(step(4, version=100), max_versions=0) == ([], False)


def test_done_closes_at_once_without_next_obs():
    session = s.Session("t", segment_len=10)
    session.record_step(step(0))
    _, closes = session.record_feedback(1.0, True, False, None)
    assert [(c.reason, c.done, c.next_obs, c.length) for c in closes] == [("done", True, None, 1)]


def test_truncated_feedback_closes_with_the_given_next_obs():
    session = s.Session("t", segment_len=10)
    session.record_step(step(0))
    _, closes = session.record_feedback(1.0, False, True, {"prompt": "after", "question": "", "action": ["x"]})
    assert [(c.reason, c.truncated, c.next_obs["prompt"]) for c in closes] == [("truncated", True, "after")]


def test_step_while_pending_drops_it_and_bootstraps_from_its_observation():
    session = s.Session("t", segment_len=10)
    session.record_step(step(0))
    session.record_feedback(1.0, False, False, None)
    session.record_step(step(1))  # its feedback never comes
    closes, orphaned = session.record_step(step(2))
    assert orphaned
    assert [(c.reason, c.length, c.next_obs["prompt"]) for c in closes] == [("orphan_step", 1, "screen 1")]
    assert session.pending.obs["prompt"] == "screen 2"


def test_step_while_pending_with_empty_segment_closes_nothing():
    session = s.Session("t", segment_len=10)
    session.record_step(step(0))
    closes, orphaned = session.record_step(step(1))
    assert orphaned and closes == []


def test_feedback_without_step_is_refused_and_changes_nothing():
    session = s.Session("t", segment_len=10)
    with pytest.raises(LookupError):
        session.record_feedback(1.0, False, False, None)
    assert session.open_len == 0 and session.seq == 0


def test_flush_marks_truncated_and_uses_the_pending_observation():
    session = s.Session("t", segment_len=10)
    session.record_step(step(0))
    session.record_feedback(1.0, False, False, None)
    session.record_step(step(1))
    closes = session.flush(s.REASON_DETACH)
    assert [(c.reason, c.truncated, c.next_obs["prompt"]) for c in closes] == [("detach", True, "screen 1")]
    assert session.pending is None
    assert s.Session("u", segment_len=10).flush(s.REASON_EXPIRED) == []


def test_replay_keeps_the_last_writes_replies_str_and_bin_rids_apart():
    session = s.Session("t", segment_len=10)
    first = session.remember("a", b"A")
    session.remember(b"a", b"BIN")
    assert (first.n, first.field) == (0, "recent:0")
    assert session.replay("a") == b"A" and session.replay(b"a") == b"BIN"
    for i in range(s.RECENT_REPLIES - 2):
        session.remember(f"x{i}", b"X")
    assert session.replay("a") == b"A"  # the oldest of the last RECENT_REPLIES writes
    last = session.remember("y", b"Y")
    assert session.replay("a") is None and session.replay(b"a") == b"BIN"  # "a" fell out; its Redis slot is "y"'s now
    assert last.field == first.field and len(session.recent) == s.RECENT_REPLIES


def test_replay_of_a_rid_used_twice_gives_its_newest_reply_and_restore_rebuilds_the_same_window():
    session = s.Session("t", segment_len=10)
    entries = [session.remember(rid, rid.encode()) for rid in ("a", "b", "a", "c")]
    assert session.replay("a") == b"a" and list(session.recent) == [("str", "b"), ("str", "a"), ("str", "c")]
    restored = s.Session("t", segment_len=10)
    for entry in entries:  # Redis holds every slot; loading restores them oldest first
        restored.restore(entry)
    assert restored.recent == session.recent and restored.writes == session.writes == 4


def test_a_pending_step_written_by_an_older_broker_replays_its_own_reply():
    session = s.Session("t", segment_len=10)
    session.record_step(step(5, rid="stepped"))
    assert session.replay("stepped") == b"reply"
