"""The broker's view of actor processes: credits, in-flight jobs, liveness."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from common.protocol import OP_GENERATE

MAX_ATTEMPTS = 3
"""A job whose actor died this many times is answered with an error rather than sent again:
an observation that crashes actors must not take the whole farm down one actor at a time."""


@dataclass
class Job:
    """One step request on its way to an actor, and every client envelope waiting for it."""

    job_id: int
    task_id: str
    mode: str
    rid: Any
    obs: dict[str, Any]
    waiters: list[tuple[bytes, ...]]
    deadline: float  # monotonic seconds
    created: float
    client: bytes  # the asking connection's routing id: the step queue takes turns between clients (broker/scheduling.py)
    actor: bytes | None = None
    dispatched_at: float = 0.0
    attempts: int = 0
    abandoned: bool = False  # answered already (timeout, detach); a late result is dropped
    held: bool = False  # came while the stream backlog was over its limit: waits for the learner (broker/backpressure.py)


@dataclass
class Actor:
    identity: bytes
    name: str
    credits: int
    last_heard: float
    last_sent: float
    policy_version: int = -1
    heartbeat_s: float = 1.0  # the slower of the broker's and the actor's heartbeat intervals
    inflight: dict[int, Job] = field(default_factory=dict)
    served: int = 0
    progress: int | None = None  # the count its heartbeats carry, which grows while it computes (None: it sends none)
    progress_at: float = 0.0  # when it last made progress: its count grew, or it answered a job
    answered_up_to: float = 0.0  # the latest dispatch time of a scoring job it answered

    def progressed(self, now: float, count: int | None = None) -> None:
        """A heartbeat said `count`: progress if it differs from the last."""
        if count is None or count != self.progress:
            self.progress_at = now
        if count is not None:
            self.progress = count

    def answered(self, job: Job, now: float) -> None:
        """It answered `job`: progress, and (a scoring job) every scoring job dispatched before it is due too."""
        self.progressed(now)
        if job.mode != OP_GENERATE:
            self.answered_up_to = max(self.answered_up_to, job.dispatched_at)

    @property
    def free(self) -> int:
        return self.credits - len(self.inflight)


class ActorRegistry:
    """Known actors; hands out the least loaded one that has a free credit."""

    def __init__(self) -> None:
        self.actors: dict[bytes, Actor] = {}
        self._job_ids = itertools.count(1)

    def next_job_id(self) -> int:
        return next(self._job_ids)

    def register(self, identity: bytes, name: str, credits: int, policy_version: int, now: float, heartbeat_s: float) -> list[Job]:
        """Add or refresh an actor; jobs it held before announcing itself again are returned for requeueing."""
        orphaned = self.remove(identity)
        self.actors[identity] = Actor(identity, name, credits, now, now, policy_version, heartbeat_s, progress_at=now)
        return orphaned

    def remove(self, identity: bytes) -> list[Job]:
        """Forget an actor; return its in-flight jobs that still have a client waiting."""
        actor = self.actors.pop(identity, None)
        if actor is None:
            return []
        return [job for job in actor.inflight.values() if not job.abandoned]

    def get(self, identity: bytes) -> Actor | None:
        return self.actors.get(identity)

    def pick(self) -> Actor | None:
        """The actor with the lowest load (in-flight / credits) among those with a free credit."""
        best, best_load = None, 2.0
        for actor in self.actors.values():
            if actor.free > 0:
                load = len(actor.inflight) / actor.credits
                if load < best_load:
                    best, best_load = actor, load
        return best

    def silent(self, now: float, liveness: int) -> list[Actor]:
        """Actors not heard from for `liveness` of their heartbeat intervals: dead."""
        return [a for a in self.actors.values() if now - a.last_heard > liveness * a.heartbeat_s]

    def stuck(self, now: float, job_timeout_s: float) -> list[tuple[Actor, Job]]:
        """Actors holding a job past its time, each with the job that is latest: hung. A scoring job's time runs
        `job_timeout_s` from its dispatch or from the actor's last progress, whichever is later: an actor whose
        heartbeats say it computes (a long prompt, a model on a slow device) is busy, not hung, however long the
        job takes, and its job is never handed to a second actor while it progresses. A generate job runs as long
        as its deadline allows (the actor answers it `timeout` at its deadline itself), so it is past its time
        `job_timeout_s` after its deadline. A scoring job held `job_timeout_s` while one sent after it was answered
        is lost in its actor, which is hung then, whatever its progress."""

        def overdue(actor: Actor, job: Job) -> float:
            if job.mode == OP_GENERATE:
                start = job.deadline
            elif job.dispatched_at < actor.answered_up_to:
                # an actor scores its jobs in the order they came: one sent later was answered, so this one is lost
                # in it, however busy it is
                start = job.dispatched_at
            else:
                start = max(job.dispatched_at, actor.progress_at)
            return now - start - job_timeout_s

        hung = []
        for actor in self.actors.values():
            worst = max(actor.inflight.values(), key=lambda j: overdue(actor, j), default=None)
            if worst is not None and overdue(actor, worst) > 0:
                hung.append((actor, worst))
        return hung
