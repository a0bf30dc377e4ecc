"""The broker -> learner contract: Redis keys, stream entries written by the broker's own script, read back as Segments."""

import pytest

from broker.sessions import SegmentClose, Session
from broker.store import Batch, SessionStore
from common.protocol import encode
from common.segments import ENTRY_FIELDS, CandidateObservation, RedisKeys, Segment, Transition, ensure_group

OBS = {"prompt": "Screen: Main", "question": "Next? ", "action": ["a", "b"]}


def transition(reward: float, done: bool = False) -> Transition:
    return Transition(
        obs=CandidateObservation.from_wire(OBS),
        action=1,
        logprob=-0.69,
        probs=[0.5, 0.5],
        policy_version=3,
        mode="step",
        reward=reward,
        done=done,
        truncated=False,
        step_ms=1,
        feedback_ms=2,
    )


def test_keys_have_one_layout():
    keys = RedisKeys("P", "segs")
    assert (keys.stream, keys.tasks, keys.task("t"), keys.open_segment("t"), keys.history("t"), keys.tombstone("t")) == (
        "P:segs",
        "P:tasks",
        "P:task:t",
        "P:seg:t",
        "P:hist:t",
        "P:detached:t",
    )
    assert (keys.weights_latest, keys.weights_manifest("r1", 7), keys.weights_chunk("r1", 7, 2), keys.learner_latest) == (
        "P:weights:latest",
        "P:weights:r1:v7",
        "P:weights:r1:v7:c2",
        "P:learner:latest",
    )


def test_a_segment_closed_by_the_broker_script_reads_back_field_for_field(redis_client, key_prefix):
    keys = RedisKeys(key_prefix)
    store = SessionStore(redis_client, keys, "learners")
    store.ensure_stream()
    session = Session("emu-1", segment_len=4, epoch="e1")
    batch = Batch()
    for t in (transition(0.5), transition(1.0, done=True)):
        store.stage_transition(batch, session, t)
    store.stage_close(batch, session, SegmentClose("emu-1", 0, "done", True, False, None, 2, "e1"))
    store.apply(batch)
    [(_, fields)] = redis_client.xrange(keys.stream)
    assert tuple(k.decode() for k in fields) == ENTRY_FIELDS  # exactly the names the learner reads, in order
    seg = Segment.from_entry(fields)
    assert (seg.seg_id, seg.task_id, seg.seq, seg.reason, seg.done, seg.truncated, seg.next_obs) == (
        "emu-1:e1:0",
        "emu-1",
        0,
        "done",
        True,
        False,
        None,
    )
    assert seg.transitions == [transition(0.5), transition(1.0, done=True)]
    assert not redis_client.exists(keys.open_segment("emu-1"))


def test_an_entry_that_is_not_a_segment_is_refused_by_name(redis_client, key_prefix):
    with pytest.raises(ValueError, match="not a segment entry.*seg_id"):
        Segment.from_entry({b"task_id": b"t"})
    good = {name.encode(): b"0" for name in ENTRY_FIELDS}
    good.update({b"seg_id": b"t:0", b"task_id": b"t", b"reason": b"done", b"next_obs": encode({}), b"transitions": b"\xc1"})
    with pytest.raises(ValueError, match="not a segment entry"):  # 0xc1 is never valid msgpack
        Segment.from_entry(good)
    good[b"transitions"] = encode([{"obs": OBS}])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="transition lacks action"):
        Segment.from_entry(good)


def test_the_consumer_group_is_created_once_whoever_comes_first(redis_client, key_prefix):
    keys = RedisKeys(key_prefix)
    ensure_group(redis_client, keys, "learners")
    ensure_group(redis_client, keys, "learners")  # the second caller (broker or learner) finds it there
    assert [g["name"] for g in redis_client.xinfo_groups(keys.stream)] == [b"learners"]


def test_acknowledging_entries_counts_each_of_their_samples_once_however_often_it_is_repeated(redis_client, key_prefix):
    """The learner's ledger (P:learner:samples) counts a sample in the script that acknowledges its entry, and only
    when that XACK acknowledges it: a retried call, or a resumed learner repairing its last checkpointed update,
    counts nothing twice."""
    from dataclasses import replace

    from common.segments import acknowledge, entry_samples

    keys = RedisKeys(key_prefix)
    store = SessionStore(redis_client, keys, "learners")
    store.ensure_stream()
    for task, samples in (("emu-1", ["r:0", "r:1"]), ("emu-2", ["r:2"]), ("emu-3", [None])):
        session = Session(task, segment_len=8, epoch="e")
        batch = Batch()
        for n, sample in enumerate(samples):
            store.stage_transition(batch, session, replace(transition(1.0, done=n == len(samples) - 1), sample=sample))
        store.stage_close(batch, session, SegmentClose(task, 0, "done", True, False, None, len(samples), "e"))
        store.apply(batch)
    read = redis_client.xreadgroup("learners", "learner-0", {keys.stream: ">"})[0][1]
    entries = [(entry_id.decode(), entry_samples(fields)) for entry_id, fields in read]
    assert [samples for _, samples in entries] == [["r:0", "r:1"], ["r:2"], []]
    assert redis_client.hgetall(keys.samples) == {b"r:0": b"1.0", b"r:1": b"1.0", b"r:2": b"1.0"}  # the broker's marks
    assert acknowledge(redis_client, keys, "learners", entries[:2]) == 2
    assert acknowledge(redis_client, keys, "learners", entries) == 1  # again, with one more: only that one counts
    assert acknowledge(redis_client, keys, "learners", entries) == 0
    assert redis_client.hgetall(keys.samples_trained) == {b"r:0": b"1", b"r:1": b"1", b"r:2": b"1"}
    assert redis_client.xlen(keys.stream) == 0 and redis_client.xpending(keys.stream, "learners")["pending"] == 0


def generate_wire(**generation: object) -> dict:
    """A generate turn's transition as the broker writes it: the maps broker/actor_ops.py builds, in their order."""
    sampling = {"max_new_tokens": 4, "temperature": 0.8, "top_p": 0.9, "top_k": 0, "stop": [], "seed": None}
    response = {"response_ids": [7, 8], "logprobs": [-0.5, -1.25], "finish_reason": "length", "temperature": 0.8, "top_p": 0.9}
    response.update(token_versions=[3, 3], **generation)
    return {
        "obs": {"prompt_ids": [1, 2, 3], "sampling": sampling},
        "action": 0,
        "logprob": -1.75,
        "probs": [],
        "policy_version": 3,
        "mode": "generate",
        "reward": 1.0,
        "done": True,
        "truncated": False,
        "step_ms": 1,
        "feedback_ms": 2,
        "policy": None,
        "generation": response,
    }


def test_a_generate_turn_reads_back_as_records_and_encodes_to_the_same_bytes():
    from common.segments import GeneratedResponse, GenerateObservation, pack

    wire = generate_wire()
    t = Transition.from_wire(wire)
    assert t.obs == GenerateObservation([1, 2, 3], wire["obs"]["sampling"]) and t.generate_obs is t.obs
    assert t.generation == t.response == GeneratedResponse([7, 8], [-0.5, -1.25], "length", 0.8, 0.9, [3, 3])
    assert pack(t.to_wire()) == pack(wire)
    older = generate_wire()  # a record written without top_p and token_versions: none added
    del older["generation"]["top_p"], older["generation"]["token_versions"]
    assert (t := Transition.from_wire(older)).generation is not None and t.generation.top_p is None
    assert pack(t.to_wire()) == pack(older)
    with pytest.raises(TypeError):
        _ = t.candidate_obs
    with pytest.raises(TypeError):
        _ = transition(1.0).generate_obs
    with pytest.raises(TypeError):
        _ = transition(1.0).response


def test_the_broker_stores_a_generate_turn_as_the_maps_its_actor_side_checked():
    """broker/actor_ops.py keeps a generate result's observation and response as maps in the pending step (and in
    Redis); the transition its feedback makes holds them as records, and encodes to the bytes those maps give."""
    from broker.sessions import PendingStep
    from common.segments import pack

    wire = generate_wire()
    session = Session("t", segment_len=4)
    step = PendingStep("r", "generate", wire["obs"], 0, -1.75, [], 3, 1, b"reply", 0, None, wire["generation"])
    session.record_step(step)
    t, _ = session.record_feedback(1.0, True, False, None)
    assert pack(t.to_wire()) == pack(dict(wire, feedback_ms=t.feedback_ms))
    assert PendingStep.from_wire(step.to_wire()) == step


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        ("generation", {"logprobs": "-0.5"}, "generation.logprobs"),
        ("generation", {"response_ids": [7, True]}, "generation.response_ids"),
        ("generation", {"temperature": None}, "generation.temperature"),
        ("generation", {"token_versions": 3}, "generation.token_versions"),
        ("obs", {"prompt_ids": "1 2 3"}, "obs.prompt_ids"),
        ("obs", {"sampling": None}, "obs.sampling"),
    ],
)
def test_a_generate_turn_with_a_field_of_the_wrong_type_is_refused_by_name(where, value, named):
    wire = generate_wire()
    wire[where].update(value)
    with pytest.raises(ValueError, match=f"`{named}`"):
        Transition.from_wire(wire)
    entry = {name.encode(): b"0" for name in ENTRY_FIELDS}
    entry.update({b"seg_id": b"t:0", b"task_id": b"t", b"reason": b"done", b"next_obs": encode(None), b"transitions": encode([wire])})
    with pytest.raises(ValueError, match=f"not a segment entry.*`{named}`"):
        Segment.from_entry(entry)


def test_a_step_reads_back_as_a_candidate_observation_and_encodes_to_the_same_bytes():
    from common.segments import pack

    wire = transition(1.0).to_wire()
    assert wire["obs"] == OBS and list(wire["obs"]) == ["prompt", "question", "action"]  # check_obs's map, in its order
    t = Transition.from_wire(wire)
    assert t.obs == t.candidate_obs == CandidateObservation("Screen: Main", "Next? ", ["a", "b"])
    assert pack(t.to_wire()) == pack(wire)
    older = dict(wire, obs={"prompt": "Screen: Main", "action": ["a", "b"]})  # a record written without the question
    assert (t := Transition.from_wire(older)).candidate_obs.question is None
    assert pack(t.to_wire()) == pack(older)


def test_the_broker_stores_a_step_as_the_map_check_obs_returned():
    from broker.sessions import PendingStep
    from common.segments import pack

    session = Session("t", segment_len=4)
    session.record_step(PendingStep("r", "step", dict(OBS), 1, -0.69, [0.5, 0.5], 3, 1, b"reply"))
    t, _ = session.record_feedback(1.0, True, False, None)
    assert t.obs == CandidateObservation.from_wire(OBS)
    assert pack(t.to_wire()) == pack(dict(transition(1.0, done=True).to_wire(), step_ms=1, feedback_ms=t.feedback_ms))


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"prompt": None}, "obs.prompt"),
        ({"question": 7}, "obs.question"),
        ({"action": "a"}, "obs.action"),
        ({"action": ["a", 3]}, "obs.action"),
    ],
)
def test_a_step_with_an_observation_field_of_the_wrong_type_is_refused_by_name(value, named):
    wire = transition(1.0).to_wire()
    wire["obs"] = dict(OBS, **value)
    with pytest.raises(ValueError, match=f"transition field `{named}`"):
        Transition.from_wire(wire)
    with pytest.raises(ValueError, match="transition field `obs` of a step must be a map"):
        Transition.from_wire(dict(wire, obs=["Screen: Main"]))


@pytest.mark.parametrize(
    ("next_obs", "named"),
    [
        ({"prompt": "p", "question": "", "action": "a"}, "next_obs.action"),
        ({"prompt_ids": [1, "2"], "sampling": {}}, "next_obs.prompt_ids"),
        ("a str", "next_obs"),
    ],
)
def test_a_next_observation_of_the_wrong_type_is_refused_by_name(next_obs, named):
    entry = {name.encode(): b"0" for name in ENTRY_FIELDS}
    wire = transition(1.0).to_wire()
    entry.update({b"seg_id": b"t:0", b"task_id": b"t", b"reason": b"length", b"next_obs": encode(next_obs), b"transitions": encode([wire])})
    with pytest.raises(ValueError, match=f"not a segment entry.*segment field `{named}`"):
        Segment.from_entry(entry)
    entry[b"next_obs"] = encode({"prompt_ids": [1, 2], "sampling": {"max_new_tokens": 2}})
    from common.segments import GenerateObservation

    assert Segment.from_entry(entry).next_obs == GenerateObservation([1, 2], {"max_new_tokens": 2})
    entry[b"next_obs"] = encode(OBS)
    assert Segment.from_entry(entry).next_obs == CandidateObservation.from_wire(OBS)
