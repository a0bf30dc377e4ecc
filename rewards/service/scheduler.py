"""How the reward service shares its scorers among the requests in progress: round-robin, in equal shares.

The service's reward-model thread and its judge thread each hand out the rows of the requests in progress the
same way (`round_robin`): each request gets an equal share of every batch of pairs, or of the judge calls that
come free, in turn, so a small request is not held behind a large one for longer than a batch or a judge call
or two. Nothing here touches a socket or a model: rewards/service/server.py does both.
"""

from __future__ import annotations

import collections
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Scoring:
    """A request's progress: its first `done` rows are handed out to be scored; `results` in order as they come
    back (from the judge's calls, in any order: `record` and `give_up` may be called from any thread)."""

    job: Job
    done: int = 0
    failed: bool = False  # answered with an error (or timed out): nothing more of it is scored or sent
    answered: int = 0
    results: list[Any] = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.job.rows)

    @property
    def finished(self) -> bool:
        """Nothing more to hand out: every row handed out, or the request failed."""
        return self.failed or self.done == len(self.job.rows)

    def record(self, start: int, values: Sequence[Any]) -> bool:
        """Keep the results of the rows from `start`; True when they were its last (its reply is due now)."""
        with self.lock:
            if self.failed:
                return False
            self.results[start : start + len(values)] = values
            self.answered += len(values)
            return self.answered == len(self.results)

    def give_up(self) -> bool:
        """Mark it failed; True the one time that its error reply is due (not when it was answered or failed before)."""
        with self.lock:
            if self.failed or self.answered == len(self.results):
                return False
            self.failed = True
            return True


def fair_shares(active: Sequence[Scoring], batch_size: int) -> list[tuple[Scoring, int]]:
    """How many of its next pairs each request in progress gets in a batch of at most `batch_size`: equal shares in
    turn (the first in `active` first), what one leaves unused going to the others."""
    left = {id(s): len(s.job.rows) - s.done for s in active}
    taken = {id(s): 0 for s in active}
    room = batch_size
    while room > 0:
        wanting = [s for s in active if left[id(s)] > 0]
        if not wanting:
            break
        each = max(1, room // len(wanting))
        for s in wanting:
            n = min(each, left[id(s)], room)
            taken[id(s)] += n
            left[id(s)] -= n
            room -= n
            if room == 0:
                break
    return [(s, taken[id(s)]) for s in active if taken[id(s)]]


@dataclass
class Job:
    """One request being scored; `envelopes`: where its reply goes (more than one when a retry joined it)."""

    op: str
    rid: Any
    rows: list[tuple[Any, ...]]
    envelopes: list[tuple[bytes, ...]]
    key: tuple[str, bytes] = ("", b"")  # what a retry must match (`request_key`)
    received: float = field(default_factory=time.monotonic)


def request_key(op: str, body: bytes) -> tuple[str, bytes]:
    """A request's identity for joining retries: its op and a digest of its whole encoded body (rid, rows and
    all), so a retry, which sends the same bytes, joins the request in progress, and a request of another
    client that reuses the rid with other content is scored on its own (the rid alone let one client read
    another's verdict)."""
    return op, hashlib.blake2b(body, digest_size=16).digest()


def split(values: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """`values` cut into consecutive runs of `sizes` (one batch's scores, back to the requests it joined)."""
    out, start = [], 0
    for size in sizes:
        out.append(list(values[start : start + size]))
        start += size
    return out


def round_robin(
    jobs: queue.Queue[Job | str | None],
    room: Callable[[], int],
    wait_s: float,
    hand_out: Callable[[list[tuple[Scoring, int, int]]], None],
    expired: Callable[[Scoring], bool],
) -> None:
    """Hand out the rows of the requests in progress, as many at a time as `room()` allows, shared round-robin:
    each request gets an equal share (fair_shares) of each hand-out, what one leaves unused going to the others,
    and the first in turn moves on after each. `hand_out` gets (request, its first row, rows) for each share.
    Every request that has arrived joins each hand-out; more are waited for (`wait_s`) only while the rows
    waiting would not fill the room. A request that failed, or that `expired` says waited too long (it answers it),
    leaves. Returns when `jobs` gives None; any other item than a Job only wakes it (`room()` may have grown).

    Both scorers run on it: the reward model's batches (room: batch_size; hand_out scores them, and returns
    when they are scored) and the judge's calls (room: the calls free; hand_out starts them). First come, first
    served, a request of 1,000 long pairs held every driver until its last pair (20 to 83 s), and one of many
    judge items held every other judge request until its last verdict."""
    active: collections.deque[Scoring] = collections.deque()

    def take(item: Job | str | None) -> bool:
        if isinstance(item, Job):
            active.append(Scoring(item))
        return item is not None

    while True:
        while not active or room() < 1:  # nothing to hand out, or no room for it
            if not take(jobs.get()):
                return
        until = time.monotonic() + wait_s
        while True:
            waiting = sum(len(s.job.rows) - s.done for s in active)
            wait = until - time.monotonic() if waiting < room() else 0.0
            try:
                item = jobs.get(timeout=wait) if wait > 0 else jobs.get_nowait()
            except queue.Empty:
                break
            if not take(item):
                return  # closing: the service answered or gave up on what was in progress (drain_timeout_s)
        for scoring in [s for s in active if s.failed or expired(s)]:
            active.remove(scoring)
        if not active:
            continue
        shares = [(scoring, scoring.done, n) for scoring, n in fair_shares(active, room())]
        for scoring, _, n in shares:
            scoring.done += n
        hand_out(shares)
        for scoring in [s for s in active if s.finished]:
            active.remove(scoring)
        active.rotate(-1)  # the next hand-out starts with the next request
