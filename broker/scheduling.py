"""The step queue: jobs waiting for an actor, served round-robin across clients.

A client is one connection to the broker's front end (its ZeroMQ routing id).
First come, first served let one client's flood of 3,000 `generate` requests
delay every other client's request by up to 71 s (issue 30). Here each client
has its own first-in-first-out line, and the lines take turns: a job of every
client with queued work is dispatched before any client's next one, so a
request waits behind at most one job per other client, whatever their floods.

Admission is fair too. The queue holds at most `limit` jobs while one client
holds more than its share (`limit` over the number of clients with queued
work); a client under its share is still admitted, so a flood that fills the
queue does not turn a polite client's requests into `overloaded`, up to twice
`limit` jobs in all, a bound memory can plan for.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from broker.actors import Job


class FairQueue:
    """Per-client lines of jobs, taken one job per client per turn (round-robin)."""

    def __init__(self) -> None:
        self._lines: dict[bytes, collections.deque[Job]] = {}
        self._turns: collections.deque[bytes] = collections.deque()  # clients with queued jobs, next to be served first
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def queued(self, client: bytes) -> int:
        line = self._lines.get(client)
        return len(line) if line is not None else 0

    def clients(self) -> int:
        """Clients with at least one job queued."""
        return len(self._lines)

    def admits(self, client: bytes, limit: int) -> bool:
        """May `client` queue one more job? Always while the queue is under `limit`; past it, only below its share
        (and under twice `limit` in all)."""
        if self._length < limit:
            return True
        queued = self.queued(client)
        sharing = len(self._lines) + (0 if queued else 1)
        return self._length < 2 * limit and queued < max(1, limit // sharing)

    def line_of(self, job: Job) -> bytes:
        """The line a job waits in: its client's. (`ppoz bench broker` puts every job in one, to compare.)"""
        return job.client

    def append(self, job: Job) -> None:
        """Queue a new job at the end of its client's line; a client new to the queue takes its turn last."""
        key = self.line_of(job)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = collections.deque()
            self._turns.append(key)
        line.append(job)
        self._length += 1

    def appendleft(self, job: Job) -> None:
        """Put a job back (its actor was lost) at the front of its client's line, and that client first in turn:
        it had already waited its turn once."""
        key = self.line_of(job)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = collections.deque()
        else:
            self._turns.remove(key)  # rare (a lost actor's jobs), so the linear search is fine
        self._turns.appendleft(key)
        line.appendleft(job)
        self._length += 1

    def popleft(self) -> Job:
        """The next job: the first of the line whose turn it is; that client then goes to the back of the turns."""
        return self._take(0)

    def popleft_due(self, due: Callable[[Job], bool]) -> Job | None:
        """The next job for which `due(job)` holds, looking at each line's first job in turn order (None: no line's
        first job is due). A line's later jobs are younger than its first, so they wait behind it."""
        for position, client in enumerate(self._turns):
            if due(self._lines[client][0]):
                return self._take(position)
        return None

    def _take(self, position: int) -> Job:
        """The first job of the line at `position` in the turns; that client then goes to the back of the turns."""
        client = self._turns[position]
        del self._turns[position]
        line = self._lines[client]
        job = line.popleft()
        self._length -= 1
        if line:
            self._turns.append(client)
        else:
            del self._lines[client]
        return job
