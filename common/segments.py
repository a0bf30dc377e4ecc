"""What PPOZ's processes share in Redis: every key, the segment format, the consumer group.

The broker writes sessions, open segments and closed segments; the learner
reads the segment stream through a consumer group and writes weight snapshots
and its latest figures; actors read the snapshots; the ledger, `ppoz status`
and the demo read the figures. Every key is built here and nowhere else
(`RedisKeys`; P is `key_prefix`):

    P:tasks             SET     task ids of live sessions                                     broker
    P:task:{task_id}    HASH    created_ms, seq, epoch, pending, attach_rid,                  broker
                                recent:0 .. recent:7 (the last 8 step/feedback replies, for
                                retries; an older broker's last_rid/last_reply is read as one)
    P:seg:{task_id}     LIST    the open segment: one msgpack `Transition` per element         broker
    P:hist:{task_id}    LIST    rag_step: the task's last steps (prompt end, action, reward)  broker
    P:detached:{tid}    STRING  the reply to a detach, kept an hour for a retried detach     broker
    P:{stream_key}      STREAM  closed segments (`Segment`), read by the learners' group     broker -> learner
    P:weights:latest    HASH    version, checksum, size, kind, run of the newest snapshot    learner -> actors
    P:weights:kept      LIST    the kept snapshots, newest first: "{run}:{n}:{chunks}"         learner
    P:weights:{run}:v{n} STRING snapshot n's manifest (msgpack; common/weights.py)           learner -> actors
    P:weights:{run}:v{n}:c{i} STRING  its chunk i: safetensors bytes, at most 64 MiB        learner -> actors
    P:learner:latest    HASH    the learner's latest figures and cumulative counters         learner -> status, ledger
    P:learner:backlog   STRING  the stream backlog (transitions) the learner can train      learner -> broker
                                within its lag bound: the broker's default back-pressure limit
    P:samples           HASH    sample id -> the reward stored with it: a feedback's          broker -> drivers
                                `sample`, written in the same script as its transition, and
                                only once per id (a second feedback with it stores nothing)
    P:samples:duplicates STRING feedbacks acknowledged with a sample id stored before, which  broker -> ledger
                                stored nothing (a killed driver's retry after its successor's)
    P:samples:scores    HASH    sample id -> its raw score, written by a GRPO driver before   drivers
                                its group's feedbacks (a cut group is completed with them)
    P:learner:samples   HASH    sample id -> times an update consumed it: counted in the      learner -> ledger
                                script that acknowledges its entry, once per acknowledgement

A stream entry (one closed segment) has the fields in `ENTRY_FIELDS`; the
broker's Lua script writes them (broker/store.py builds it from these names)
and `Segment.from_entry` reads them. `transitions` is one msgpack array of
`Transition` maps, `next_obs` a msgpack observation or nil; docs/protocol.md,
section 7, describes each field.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import msgpack
import redis

from common.protocol import OP_GENERATE

# --- the stream entry's fields, in the order the broker writes them ---------------------------
F_SEG_ID = "seg_id"  # "<task_id>:<epoch>:<seq>", unique across a task id's sessions
F_TASK_ID = "task_id"
F_SEQ = "seq"  # the segment's number within its session
F_REASON = "reason"  # why it closed: done, length, orphan_step, truncated, detach, expired
F_DONE = "done"  # "1": the episode ended with the last transition (no bootstrap)
F_TRUNCATED = "truncated"  # "1": cut short (time limit, detach, expiry)
F_N = "n"  # number of transitions
F_NEXT_OBS = "next_obs"  # msgpack: the observation after the last transition, or nil
F_TRANSITIONS = "transitions"  # msgpack array of Transition maps
F_CLOSED_MS = "closed_ms"  # wall-clock time the segment closed
ENTRY_FIELDS = (F_SEG_ID, F_TASK_ID, F_SEQ, F_REASON, F_DONE, F_TRUNCATED, F_N, F_NEXT_OBS, F_TRANSITIONS, F_CLOSED_MS)


@dataclass(frozen=True)
class RedisKeys:
    """Every Redis key of one PPOZ deployment (one `key_prefix`)."""

    prefix: str
    stream_key: str = "segments"

    @property
    def stream(self) -> str:
        return f"{self.prefix}:{self.stream_key}"

    @property
    def tasks(self) -> str:
        return f"{self.prefix}:tasks"

    def task(self, task_id: str) -> str:
        return f"{self.prefix}:task:{task_id}"

    def open_segment(self, task_id: str) -> str:
        return f"{self.prefix}:seg:{task_id}"

    def history(self, task_id: str) -> str:
        return f"{self.prefix}:hist:{task_id}"

    def tombstone(self, task_id: str) -> str:
        return f"{self.prefix}:detached:{task_id}"

    @property
    def weights_latest(self) -> str:
        return f"{self.prefix}:weights:latest"

    @property
    def weights_kept(self) -> str:
        return f"{self.prefix}:weights:kept"

    def weights_manifest(self, run: str, version: int) -> str:
        return f"{self.prefix}:weights:{run}:v{version}"

    def weights_chunk(self, run: str, version: int, index: int) -> str:
        return f"{self.prefix}:weights:{run}:v{version}:c{index}"

    @property
    def learner_latest(self) -> str:
        return f"{self.prefix}:learner:latest"

    @property
    def learner_backlog(self) -> str:
        return f"{self.prefix}:learner:backlog"

    @property
    def samples(self) -> str:
        return f"{self.prefix}:samples"

    @property
    def sample_scores(self) -> str:
        return f"{self.prefix}:samples:scores"

    @property
    def duplicate_samples(self) -> str:
        return f"{self.prefix}:samples:duplicates"

    @property
    def samples_trained(self) -> str:
        return f"{self.prefix}:learner:samples"


def ensure_group(client: redis.Redis, keys: RedisKeys, group: str) -> None:
    """Create the segment stream and the learners' consumer group if either is missing (broker and learner both do)."""
    try:
        client.xgroup_create(keys.stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


# Acknowledging stream entries and counting their samples in one atomic script: an entry's samples are
# counted only when its XACK acknowledges it (returns 1), so a repeated call (a retry after a lost reply, the
# repair of a checkpointed update at resume) counts nothing twice. KEYS: stream, P:learner:samples; ARGV:
# the group, then per entry its id, the number of its sample ids and the ids.
ACK_LUA = """
local acked = 0
local i = 2
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    acked = acked + 1
    for j = 1, n do
      redis.call('HINCRBY', KEYS[2], ARGV[i + 1 + j], 1)
    end
  end
  redis.call('XDEL', KEYS[1], id)
  i = i + 2 + n
end
return acked
"""


def acknowledge(client: redis.Redis, keys: RedisKeys, group: str, entries: list[tuple[str, list[str]]]) -> int:
    """Acknowledge and delete stream entries, each given with the sample ids of its transitions, and count each
    sample in `P:learner:samples` once per entry this call acknowledges; the number acknowledged."""
    if not entries:
        return 0
    argv: list[str] = [group]
    for entry_id, samples in entries:
        argv += [entry_id, str(len(samples)), *samples]
    return int(client.eval(ACK_LUA, 2, keys.stream, keys.samples_trained, *argv))


def entry_samples(fields: dict[bytes, bytes] | None) -> list[str]:
    """The sample ids (feedback's `sample`) of a stream entry's transitions; [] for an entry that is gone or unreadable."""
    if not fields:
        return []
    try:
        transitions = unpack(fields[F_TRANSITIONS.encode()])
        return [t["sample"] for t in transitions if isinstance(t, dict) and isinstance(t.get("sample"), str)]
    except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return []


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


NEXT_OBS = "next_obs"  # the one observation that is a segment's field, not a transition's (its errors say so)


def _field(where: str) -> str:
    """How an error names the field `where` (a dotted path): "transition field `obs.prompt`", "segment field `next_obs`"."""
    record = "segment" if where.split(".")[0] == NEXT_OBS else "transition"
    return f"{record} field `{where}`"


def _checked(
    d: dict[str, Any], where: str, name: str, kind: type | tuple[type, ...], what: str, items: type | tuple[type, ...] = ()
) -> Any:
    """`d[name]` if it is a `kind` (a list: of `items` only; never a bool for a number); else ValueError naming `where.name`."""
    value = d.get(name)
    number = kind is int or (isinstance(kind, tuple) and int in kind)
    if not isinstance(value, kind) or (number and isinstance(value, bool)):
        raise ValueError(f"{_field(f'{where}.{name}')} must be {what}, got {type(value).__name__}")
    if items and not all(isinstance(x, items) and not isinstance(x, bool) for x in d[name]):
        raise ValueError(f"{_field(f'{where}.{name}')} must be {what}, one holds something else")
    return value


def _a_map(d: Any, where: str, kind: str) -> dict[str, Any]:
    """`d` if it is a map; else ValueError naming `where`, an observation of `kind`."""
    if not isinstance(d, dict):
        raise ValueError(f"{_field(where)} of a {kind} must be a map, got {type(d).__name__}")
    return d


@dataclass
class CandidateObservation:
    """A step's or rag_step's observation, as common/protocol.py's `check_obs` returned it and the broker stores
    it: the text the policy scores (a rag_step's prompt with its retrieved context at the end) and the
    candidate actions."""

    prompt: str
    question: str | None  # None: a record written without it (read as "", and left off the wire again)
    action: list[str]  # the candidates, in order: a transition's `action` indexes them

    def to_wire(self) -> dict[str, Any]:
        """The map, its keys in `check_obs`'s order."""
        if self.question is None:
            return {"prompt": self.prompt, "action": self.action}
        return {"prompt": self.prompt, "question": self.question, "action": self.action}

    @classmethod
    def from_wire(cls, d: Any, where: str = "obs") -> CandidateObservation:
        """Raises ValueError naming the field that is missing or of the wrong type."""
        d = _a_map(d, where, "step")
        return cls(
            prompt=_checked(d, where, "prompt", str, "a str"),
            question=_checked(d, where, "question", str, "a str") if d.get("question") is not None else None,
            action=_checked(d, where, "action", list, "an array of str", str),
        )


@dataclass
class GenerateObservation:
    """A generate turn's observation, as the broker stores it: the prompt as the actor tokenized it, and the
    request's `sampling` map as common/protocol.py checked it (kept for the record: the learner reads the
    sampling settings from `GeneratedResponse`)."""

    prompt_ids: list[int]
    sampling: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt_ids, "sampling": self.sampling}

    @classmethod
    def from_wire(cls, d: Any, where: str = "obs") -> GenerateObservation:
        """Raises ValueError naming the field that is missing or of the wrong type."""
        d = _a_map(d, where, "generate turn")
        return cls(
            prompt_ids=_checked(d, where, "prompt_ids", list, "an array of token ids", int),
            sampling=_checked(d, where, "sampling", dict, "a map (the request's sampling settings)"),
        )


Observation = CandidateObservation | GenerateObservation


def next_observation(d: Any) -> Observation | None:
    """A segment's `next_obs` off the wire: nil, or the observation of a step ({prompt, question, action}) or of a
    generate turn ({prompt_ids, sampling}), told apart by `prompt_ids`. Raises ValueError naming a bad field."""
    if d is None:
        return None
    if isinstance(d, dict) and "prompt_ids" in d:
        return GenerateObservation.from_wire(d, NEXT_OBS)
    return CandidateObservation.from_wire(d, NEXT_OBS)


@dataclass
class GeneratedResponse:
    """A generate turn's response, as the actor wrote it and the broker checked it (broker/actor_ops.py)."""

    response_ids: list[int]
    logprobs: list[float]  # per token, of the distribution sampled from (temperature and top-p applied)
    finish_reason: str  # eos, stop or length
    temperature: float  # the sample's own; 0: greedy (nothing to train on)
    top_p: float | None = None  # None: a record written without it
    token_versions: list[int] | None = None  # the policy version of each token (new weights may come mid-response); None: not recorded

    OPTIONAL = ("top_p", "token_versions")  # left off the wire when None, as a record written without them had them

    def to_wire(self) -> dict[str, Any]:
        wire = dict(self.__dict__)
        for name in self.OPTIONAL:
            if wire[name] is None:
                del wire[name]
        return wire

    @classmethod
    def from_wire(cls, d: Any) -> GeneratedResponse:
        """Raises ValueError naming the field that is missing or of the wrong type. The values are kept as they
        came (an int temperature stays an int), so that encoding the record again gives the same bytes."""
        if not isinstance(d, dict):
            raise ValueError(f"transition field `generation` must be a map or nil, got {type(d).__name__}")
        number = (int, float)
        return cls(
            response_ids=_checked(d, "generation", "response_ids", list, "an array of token ids", int),
            logprobs=_checked(d, "generation", "logprobs", list, "an array of numbers", number),
            finish_reason=_checked(d, "generation", "finish_reason", str, "a str"),
            temperature=_checked(d, "generation", "temperature", number, "a number"),
            top_p=_checked(d, "generation", "top_p", number, "a number") if d.get("top_p") is not None else None,
            token_versions=(
                _checked(d, "generation", "token_versions", list, "an array of ints", int) if d.get("token_versions") is not None else None
            ),
        )


@dataclass
class Transition:
    """One step and its reward, as the broker stores it (an element of an open segment, then of a stream entry).

    Its kind is `mode`: a choice among candidates ("step", "rag_step"), whose `obs` is a `CandidateObservation`
    (the client's observation as the policy scores it) and whose `generation` is None; or a generated response
    ("generate"), whose `obs` is a `GenerateObservation` and `generation` a `GeneratedResponse` (action 0,
    probs [], logprob the response's sum). On the wire both are maps (`to_wire`, `from_wire`)."""

    obs: Observation  # the observation scored
    action: int  # index of the chosen candidate
    logprob: float  # behaviour log-probability of `action`
    probs: list[float]  # behaviour probabilities of every candidate
    policy_version: int  # the weights that chose it
    mode: str  # "step", "rag_step" or "generate"
    reward: float
    done: bool
    truncated: bool
    step_ms: int = 0  # when the step was answered
    feedback_ms: int = 0  # when its reward came
    # What it was scored with: common.shared_settings.PolicyStamp's wire map, as the broker checked it; None: not
    # stamped. Kept as the map: the learner drops a transition whose stamp it cannot read, and counts it (`stamp`).
    policy: dict[str, Any] | None = None
    generation: GeneratedResponse | None = None
    sample: str | None = None  # the feedback's `sample`: the client's id for this sample (P:samples, P:learner:samples)

    @property
    def candidate_obs(self) -> CandidateObservation:
        """A step's or rag_step's observation (TypeError for a generate turn's)."""
        if not isinstance(self.obs, CandidateObservation):
            raise TypeError(f"a {self.mode} transition has no candidate observation")
        return self.obs

    @property
    def generate_obs(self) -> GenerateObservation:
        """A generate turn's observation (TypeError for a step's)."""
        if not isinstance(self.obs, GenerateObservation):
            raise TypeError(f"a {self.mode} transition has no generate observation")
        return self.obs

    @property
    def response(self) -> GeneratedResponse:
        """A generate turn's response (TypeError for a transition without one)."""
        if self.generation is None:
            raise TypeError(f"this {self.mode} transition has no generated response")
        return self.generation

    def to_wire(self) -> dict[str, Any]:
        # Its fields as they are, shared not copied: msgpack only reads them. (dataclasses.asdict
        # deep-copies the observation on every feedback: 20% of the broker's CPU per pair.)
        wire = dict(self.__dict__)
        wire["obs"] = self.obs.to_wire()
        if self.generation is not None:
            wire["generation"] = self.generation.to_wire()
        if wire["sample"] is None:  # only a feedback that named its sample carries the field
            del wire["sample"]
        return wire

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Transition:
        """Raises ValueError naming a field that is missing, or (the observation and response) of the wrong type."""
        known = {f.name: f for f in fields(cls)}
        missing = [name for name, f in known.items() if name not in d and f.default is MISSING]
        if missing:
            raise ValueError(f"transition lacks {', '.join(missing)}")
        given = {k: v for k, v in d.items() if k in known}
        if given["mode"] == OP_GENERATE:
            given["obs"] = GenerateObservation.from_wire(given["obs"])
        else:
            given["obs"] = CandidateObservation.from_wire(given["obs"])
        if given.get("generation") is not None:
            given["generation"] = GeneratedResponse.from_wire(given["generation"])
        return cls(**given)


@dataclass
class Segment:
    """A closed segment: consecutive transitions of one task, and what follows them."""

    seg_id: str
    task_id: str
    seq: int
    reason: str
    done: bool
    truncated: bool
    next_obs: Observation | None  # the observation after the last transition: its value bootstraps it; None: none known
    transitions: list[Transition] = field(default_factory=list)
    closed_ms: int = 0

    @classmethod
    def from_entry(cls, entry: dict[bytes, bytes]) -> Segment:
        """A stream entry's fields (as redis-py returns them) as a Segment; ValueError if it is not one."""
        try:
            segment = cls(
                seg_id=entry[F_SEG_ID.encode()].decode(),
                task_id=entry[F_TASK_ID.encode()].decode(),
                seq=int(entry[F_SEQ.encode()]),
                reason=entry[F_REASON.encode()].decode(),
                done=entry[F_DONE.encode()] == b"1",
                truncated=entry[F_TRUNCATED.encode()] == b"1",
                next_obs=None,  # read after the transitions, whose errors say more of what is wrong
                transitions=[Transition.from_wire(t) for t in unpack(entry[F_TRANSITIONS.encode()])],
                closed_ms=int(entry[F_CLOSED_MS.encode()]),
            )
            segment.next_obs = next_observation(unpack(entry[F_NEXT_OBS.encode()]))
            return segment
        except (KeyError, TypeError, ValueError, UnicodeDecodeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ValueError(f"not a segment entry: {type(e).__name__}: {e}") from e
