"""Sessions: the per-task state machine that turns steps and feedbacks into segments.

A session is one client task (one emulator). It holds at most one *pending
step* (the observation, the chosen action, its log-probability and the policy
version, waiting for its reward) and an *open segment* of finished
transitions. The rules, also in docs/protocol.md:

- feedback: the pending step plus its reward becomes a transition appended to
  the open segment. `done` closes the segment (terminal, no bootstrap);
  `truncated` closes it too, carrying the feedback's `next_obs` if one is given.
- step, open segment full (`segment_len` transitions): the segment closes with
  this step's observation as `next_obs`, so the learner can bootstrap.
- step while a step is pending (its feedback never came): the pending step is
  dropped and counted, and the open segment closes with the dropped step's
  observation as `next_obs` (that observation is the state that followed the
  last transition, so the bootstrap stays right and no transition spans a gap).
- feedback with no pending step: refused (`feedback_without_step`), nothing changes.
- detach or expiry: the open segment closes marked truncated; the pending
  step's observation, if any, is its `next_obs`.

This module is pure state: the Redis layout lives in broker/store.py and the
sockets in broker/server.py. Transitions themselves are kept in Redis only;
a session in memory knows how many its open segment holds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import MISSING, dataclass, field
from typing import Any

from common.protocol import OP_GENERATE
from common.segments import CandidateObservation, GeneratedResponse, GenerateObservation, Observation, Transition

REASON_DONE = "done"
REASON_LENGTH = "length"
REASON_AGE = "age"
REASON_ORPHAN_STEP = "orphan_step"
REASON_TRUNCATED = "truncated"
REASON_DETACH = "detach"
REASON_EXPIRED = "expired"

RECENT_REPLIES = 8
"""Writes (step, rag_step, feedback) per task whose replies are kept, in memory and in the task's Redis hash,
so that any of them sent again with its rid gets its first reply and no second effect (docs/protocol.md,
section 5). A client has one request in flight per task, so 8 reach well past anything it may still resend."""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class PendingStep:
    """A step answered to the client and waiting for its reward."""

    rid: Any
    mode: str  # "step", "rag_step" or "generate"
    obs: dict[str, Any]
    action: int
    logprob: float
    probs: list[float]
    policy_version: int
    step_ms: int
    reply: bytes  # the encoded reply body, resent verbatim to a retry
    context_chars: int = 0  # rag_step: characters of retrieved context at the end of obs["prompt"] (the scored prompt)
    policy: dict[str, Any] | None = None  # the actor's PolicyStamp: what the choice was scored with
    # generate: the response's tokens and log-probabilities, the map of GeneratedResponse's fields as
    # broker/actor_ops.py checked it (so, too, obs: GenerateObservation's); `transition` makes them records
    generation: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)  # every field, in order, shared not copied (msgpack only reads them)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PendingStep:
        fields = cls.__dataclass_fields__
        return cls(**{k: d[k] for k in fields if k in d or fields[k].default is MISSING})  # older records lack newer fields

    def transition(self, reward: float, done: bool, truncated: bool, sample: str | None) -> Transition:
        """This step with its feedback's reward, as the learner reads it."""
        # the maps broker/actor_ops.py built and checked (a step's: common/protocol.py's check_obs): taken as they are
        obs: Observation
        generation = None
        if self.mode == OP_GENERATE:
            obs = GenerateObservation(self.obs["prompt_ids"], self.obs["sampling"])
            generation = GeneratedResponse(**self.generation) if self.generation is not None else None
        else:
            obs = CandidateObservation(self.obs["prompt"], self.obs.get("question"), self.obs["action"])
        return Transition(
            obs=obs,
            action=self.action,
            logprob=self.logprob,
            probs=self.probs,
            policy_version=self.policy_version,
            mode=self.mode,
            reward=reward,
            done=done,
            truncated=truncated,
            step_ms=self.step_ms,
            feedback_ms=now_ms(),
            policy=self.policy,
            generation=generation,
            sample=sample,
        )

    def history_entry(self, reward: float, prompt_chars: int) -> dict[str, Any]:
        """What a later rag_step of the task may retrieve about this step: its prompt's end, the action, the reward."""
        prompt = self.obs["prompt"]
        prompt = prompt[: len(prompt) - self.context_chars]  # the client's own prompt: context never nests
        return {"prompt": prompt[-prompt_chars:], "action": self.obs["action"][self.action], "reward": float(reward)}


@dataclass(frozen=True)
class Replied:
    """The reply given to one write of a task, kept for a retry with its rid (see RECENT_REPLIES)."""

    n: int  # the task's count of writes when it was made: orders them, and picks its slot in Redis
    rid: Any
    reply: bytes

    @property
    def field(self) -> str:
        """Its field in the task's Redis hash: `recent:<n mod RECENT_REPLIES>`, so a write overwrites the oldest."""
        return f"{RECENT_FIELD_PREFIX}{self.n % RECENT_REPLIES}"

    def to_wire(self) -> list[Any]:
        return [self.n, self.rid, self.reply]

    @classmethod
    def from_wire(cls, d: list[Any]) -> Replied:
        n, rid, reply = d
        return cls(int(n), rid, reply)


RECENT_FIELD_PREFIX = "recent:"


@dataclass
class SegmentClose:
    """Everything about a closing segment except its transitions (which are in Redis)."""

    task_id: str
    seq: int
    reason: str
    done: bool
    truncated: bool
    next_obs: dict[str, Any] | None
    length: int
    epoch: str = ""  # the session's own id (see Session.epoch)

    @property
    def seg_id(self) -> str:
        return f"{self.task_id}:{self.epoch}:{self.seq}" if self.epoch else f"{self.task_id}:{self.seq}"


@dataclass
class Session:
    task_id: str
    segment_len: int
    created_ms: int = field(default_factory=now_ms)
    last_seen_ms: int = field(default_factory=now_ms)
    seq: int = 0  # sequence number of the open segment
    # A client may detach and attach again under the same task_id; seq then starts at 0 again. The epoch,
    # random per session, keeps segment ids unique across those lives: the learner drops an id it has seen.
    epoch: str = ""
    open_len: int = 0  # transitions in the open segment
    open_version: int | None = None  # the policy version of its first transition (None: empty, or not known)
    pending: PendingStep | None = None
    attach_rid: Any = None
    attach_sender: str = ""  # who attached (CURVE key or address): a retried attach must come from the same client
    writes: int = 0  # steps and feedbacks recorded in this session's life: numbers the next Replied
    recent: OrderedDict = field(default_factory=OrderedDict)  # rid -> Replied, the last RECENT_REPLIES writes, oldest first
    history: list[dict[str, Any]] = field(default_factory=list)  # rag_step: the task's recent steps, oldest first (in Redis too)

    # --- replies for retried request ids ------------------------------------------
    def remember(self, rid: Any, reply: bytes) -> Replied:
        """Keep the reply of a write (step, rag_step, feedback) for its retries; the caller stages it in Redis with the write."""
        entry = Replied(self.writes, rid, reply)
        self.writes += 1
        self.restore(entry)
        return entry

    def restore(self, entry: Replied) -> None:
        """Add a kept reply (from remember, or read back from Redis oldest first).

        Kept: the replies of the last RECENT_REPLIES writes, the ones whose Redis slots
        (`recent:<n mod RECENT_REPLIES>`) they still hold, so memory and Redis agree."""
        key = rid_key(entry.rid)
        self.recent.pop(key, None)  # a rid used again for another write: its newest reply is the one to give
        self.recent[key] = entry
        self.writes = max(self.writes, entry.n + 1)
        while self.recent and next(iter(self.recent.values())).n < self.writes - RECENT_REPLIES:
            self.recent.popitem(last=False)

    def replay(self, rid: Any) -> bytes | None:
        """The reply already given to this request id (one of the task's last RECENT_REPLIES writes), if any."""
        entry = self.recent.get(rid_key(rid))
        if entry is not None:
            return entry.reply
        if self.pending is not None and rid_key(self.pending.rid) == rid_key(rid):
            return self.pending.reply  # a pending step written by a broker older than `recent`
        return None

    # --- the state machine ------------------------------------------------------------
    def record_step(self, step: PendingStep, max_versions: int = 0) -> tuple[list[SegmentClose], bool]:
        """Make `step` the pending step; return the segments this closes and whether a step was orphaned.

        `max_versions` (the broker's segment_max_versions; 0: none): the open segment also closes once `step` was
        scored that many policy versions after its first transition, so that a slow client's early transitions reach
        the learner while they are within its lag bound, not when the segment is finally full."""
        closes: list[SegmentClose] = []
        orphaned = self.pending is not None
        if self.pending is not None:
            closes += self._close(REASON_ORPHAN_STEP, done=False, truncated=False, next_obs=self.pending.obs)
        elif self.open_len >= self.segment_len:
            closes += self._close(REASON_LENGTH, done=False, truncated=False, next_obs=step.obs)
        elif max_versions and self.open_version is not None and step.policy_version - self.open_version >= max_versions:
            closes += self._close(REASON_AGE, done=False, truncated=False, next_obs=step.obs)
        self.pending = step
        return closes, orphaned

    def record_feedback(
        self, reward: float, done: bool, truncated: bool, next_obs: dict[str, Any] | None, sample: str | None = None
    ) -> tuple[Transition, list[SegmentClose]]:
        """Turn the pending step into a transition (carrying the feedback's `sample` id, if any); return it and the
        segments this closes."""
        if self.pending is None:
            raise LookupError("no pending step")
        transition = self.pending.transition(reward, done, truncated, sample)
        self.pending = None
        if self.open_len == 0:
            self.open_version = transition.policy_version
        self.open_len += 1
        closes: list[SegmentClose] = []
        if done:
            closes += self._close(REASON_DONE, done=True, truncated=False, next_obs=None)
        elif truncated:
            closes += self._close(REASON_TRUNCATED, done=False, truncated=True, next_obs=next_obs)
        return transition, closes

    def flush(self, reason: str) -> list[SegmentClose]:
        """Close whatever is open (detach, expiry); the pending step, if any, is dropped."""
        next_obs = self.pending.obs if self.pending is not None else None
        self.pending = None
        return self._close(reason, done=False, truncated=True, next_obs=next_obs)

    def _close(self, reason: str, done: bool, truncated: bool, next_obs: dict[str, Any] | None) -> list[SegmentClose]:
        if self.open_len == 0:
            return []
        close = SegmentClose(self.task_id, self.seq, reason, done, truncated, next_obs, self.open_len, self.epoch)
        self.seq += 1
        self.open_len = 0
        self.open_version = None
        return [close]


def attach_key(sender: str, rid: Any) -> Any:
    """Where an attach's rid is looked up: a retry from the same client finds its task, another client reusing
    the rid does not (issue 30: "one client can read another's verdict")."""
    return (sender, rid_key(rid))


def rid_key(rid: Any) -> Any:
    """A rid as a dict key: a str and a bin of the same bytes are distinct rids on the wire, and here too."""
    return (type(rid).__name__, rid)
