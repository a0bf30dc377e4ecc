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
        self.actors[identity] = Actor(identity, name, credits, now, now, policy_version, heartbeat_s)
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

    def stuck(self, now: float, job_timeout_s: float) -> list[Actor]:
        """Actors holding a job past its time: hung. A scoring job has `job_timeout_s` from its dispatch; a
        generate job runs as long as its deadline allows (the actor answers it `timeout` at its deadline
        itself), so it is past its time `job_timeout_s` after its deadline."""

        def late(job: Job) -> bool:
            start = job.deadline if job.mode == OP_GENERATE else job.dispatched_at
            return now - start > job_timeout_s

        return [a for a in self.actors.values() if any(late(j) for j in a.inflight.values())]
