"""From segments to a training batch: the bootstrap rules, GAE per segment, the staleness filter."""

import pytest

from common.segments import CandidateObservation, Segment, Transition
from learner_node.rollout import build_rollout


def obs(name):
    return CandidateObservation(name, "", ["a", "b"])


def transition(name, reward, done=False, version=5):
    return Transition(
        obs=obs(name),
        action=1,
        logprob=-0.7,
        probs=[0.5, 0.5],
        policy_version=version,
        reward=reward,
        done=done,
        truncated=False,
        mode="step",
    )


def segment(seg_id, transitions, next_obs=None, done=False, truncated=False):
    return Segment(
        seg_id=seg_id, task_id="t", seq=0, reason="x", done=done, truncated=truncated, next_obs=next_obs, transitions=transitions
    )


VALUES = {"s0": 0.5, "s1": 0.4, "s2": 0.3, "after": 2.0}


def value_of(observations):
    return [VALUES[o.prompt] for o in observations]


def test_done_segment_keeps_its_terminal_transition_and_bootstraps_nothing():
    r = build_rollout(
        [segment("t:0", [transition("s0", 1.0), transition("s1", 3.0, done=True)], done=True)],
        value_of,
        gamma=1.0,
        lam=1.0,
        current_version=5,
        max_policy_lag=0,
    )
    assert r.returns == pytest.approx([4.0, 3.0])
    assert r.advantages == pytest.approx([4.0 - 0.5, 3.0 - 0.4])
    assert r.episodic_returns == [4.0] and len(r) == 2 and r.stored == 2


def test_segment_closed_by_length_bootstraps_from_next_obs():
    r = build_rollout(
        [segment("t:0", [transition("s0", 1.0), transition("s1", 0.0)], next_obs=obs("after"))],
        value_of,
        gamma=0.5,
        lam=1.0,
        current_version=5,
        max_policy_lag=0,
    )
    assert r.returns == pytest.approx([1.0 + 0.5 * 0.0 + 0.25 * 2.0, 0.0 + 0.5 * 2.0])
    assert r.episodic_returns == []


def test_truncated_without_successor_drops_its_last_transition_and_bootstraps_from_it():
    r = build_rollout(
        [segment("t:0", [transition("s0", 1.0), transition("s1", 9.0)], truncated=True)],
        value_of,
        gamma=0.5,
        lam=1.0,
        current_version=5,
        max_policy_lag=0,
    )
    assert len(r) == 1 and r.dropped_truncated == 1 and r.stored == 2
    assert r.returns == pytest.approx([1.0 + 0.5 * 0.4])
    lonely = build_rollout([segment("t:1", [transition("s2", 1.0)], truncated=True)], value_of, 0.5, 1.0, 5, 0)
    assert len(lonely) == 0 and lonely.dropped_truncated == 1


def test_stale_transitions_are_dropped_and_counted_after_gae():
    r = build_rollout(
        [segment("t:0", [transition("s0", 1.0, version=1), transition("s1", 1.0, done=True, version=5)], done=True)],
        value_of,
        gamma=1.0,
        lam=1.0,
        current_version=5,
        max_policy_lag=2,
    )
    assert r.dropped_stale == 1 and len(r) == 1 and r.versions == [5]
    assert r.returns == pytest.approx([1.0])
    assert r.episodic_returns == [2.0]  # the episode still counts whole


def test_an_episode_spanning_segments_and_rollouts_counts_once_with_its_whole_return():
    from learner_node.rollout import EpisodeReturns

    episodes = EpisodeReturns()
    first = build_rollout(
        [segment("t:0", [transition("s0", 1.0), transition("s1", 2.0)], next_obs=obs("after"))], value_of, 1.0, 1.0, 5, 0, episodes
    )
    assert first.episodic_returns == []  # the episode goes on in the next segment
    second = build_rollout(
        [segment("t:1", [transition("s2", 3.0), transition("s0", 4.0, done=True)], done=True)], value_of, 1.0, 1.0, 5, 0, episodes
    )
    assert second.episodic_returns == [10.0]
    assert episodes.running == {}


def test_a_truncated_episode_counts_with_the_return_it_had_and_tasks_are_apart():
    from learner_node.rollout import EpisodeReturns

    episodes = EpisodeReturns()
    a0 = Segment(
        seg_id="a:0",
        task_id="a",
        seq=0,
        reason="length",
        done=False,
        truncated=False,
        next_obs=obs("after"),
        transitions=[transition("s0", 1.0), transition("s1", 1.0)],
    )
    b0 = Segment(
        seg_id="b:0",
        task_id="b",
        seq=0,
        reason="length",
        done=False,
        truncated=False,
        next_obs=obs("after"),
        transitions=[transition("s0", 5.0)],
    )
    a1 = Segment(
        seg_id="a:1", task_id="a", seq=1, reason="detach", done=False, truncated=True, next_obs=None, transitions=[transition("s2", 0.5)]
    )
    assert episodes.add(a0) == [] and episodes.add(b0) == []
    assert episodes.add(a1) == [2.5]  # Kea's episodes never end with done: they end when the emulator detaches
    assert episodes.running == {"b": 5.0}
    # A done in the middle of a segment ends one episode and starts the next.
    c0 = Segment(
        seg_id="c:0",
        task_id="c",
        seq=0,
        reason="length",
        done=False,
        truncated=False,
        next_obs=obs("after"),
        transitions=[transition("s0", 1.0, done=True), transition("s1", 7.0)],
    )
    assert episodes.add(c0) == [1.0] and episodes.running["c"] == 7.0


def test_the_running_returns_are_bounded():
    from learner_node.rollout import EpisodeReturns

    episodes = EpisodeReturns(max_tasks=2)
    for task in "xyz":
        episodes.add(
            Segment(
                seg_id=f"{task}:0",
                task_id=task,
                seq=0,
                reason="length",
                done=False,
                truncated=False,
                next_obs=obs("after"),
                transitions=[transition("s0", 1.0)],
            )
        )
    assert list(episodes.running) == ["y", "z"]


def stamped(name, stamp, version=5):
    t = transition(name, 1.0, done=True, version=version)
    t.policy = None if stamp is None else stamp.to_wire()
    return segment(f"{name}:0", [t], done=True)


def test_transitions_scored_otherwise_than_the_learner_scores_are_dropped_and_counted_by_reason():
    from dataclasses import replace

    from common.shared_settings import PolicyStamp

    mine = PolicyStamp(run="run-b", normalisation="token", temperature=1.0, lora_rank=8, greedy=False)
    cases = [
        stamped("s0", replace(mine, path="kv_batch")),  # another path computes the same function: kept
        stamped("s1", None),  # unstamped (a uniform actor, an older broker): kept
        stamped("s2", replace(mine, run="run-a")),  # another run's weights
        stamped("s0", replace(mine, greedy=True)),  # a greedy actor: its behaviour probability is 1, not the logged softmax
        stamped("s1", replace(mine, normalisation="word")),
        stamped("s2", replace(mine, temperature=0.7)),
        stamped("s0", replace(mine, lora_rank=16)),
        stamped("s1", replace(mine, run="")),  # base weights while the learner is at version 5
    ]
    bad = transition("s2", 1.0, done=True)
    bad.policy = {"run": 3}
    cases.append(segment("bad:0", [bad], done=True))
    r = build_rollout(cases, value_of, 1.0, 1.0, current_version=5, max_policy_lag=0, expected=mine)
    assert len(r) == 2 and r.dropped_mismatched == 7 and r.stored == 9
    assert dict(r.mismatched) == {"run": 2, "greedy": 1, "normalisation": 1, "temperature": 1, "lora_rank": 1, "stamp": 1}
    # The base weights are the learner's version 0 (a fresh adapter is the identity): kept then.
    base = build_rollout([stamped("s0", replace(mine, run=""), version=0)], value_of, 1.0, 1.0, 0, 0, expected=mine)
    assert len(base) == 1 and base.dropped_mismatched == 0
    # ... whatever the learner's version now: their lag decides (an actor still on the base weights after version 1 was out).
    base = build_rollout([stamped("s0", replace(mine, run=""), version=0)], value_of, 1.0, 1.0, 2, 4, expected=mine)
    assert len(base) == 1 and base.lags == [2] and base.dropped_mismatched == 0
    base = build_rollout([stamped("s0", replace(mine, run=""), version=0)], value_of, 1.0, 1.0, 5, 4, expected=mine)
    assert len(base) == 0 and base.dropped_stale == 1 and base.dropped_mismatched == 0
