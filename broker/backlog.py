"""The segment stream's backlog in transitions: what back-pressure compares with its limit.

Redis says how many entries the stream holds (XLEN), but an entry is a segment of 1 to `segment_len`
transitions, and the same farm closes segments of very different lengths: by length, at an episode's
end, by age (`segment_max_versions`). A limit in entries let a stalled learner's backlog triple in
transitions: with the policy version frozen, no segment closed by age, segments grew from ~10 to 32
transitions, and the 26 entries the learner allowed held ~900 transitions instead of ~260 (issue 55's
farm: 1,067 of 2,434 steps dropped as stale, the clients held back for 40 s after).

The learner reads the stream oldest first and deletes what it trained, so the entries left are, to a
close approximation, the newest the broker wrote: their transitions are the sum of the lengths of the
last XLEN segments this broker closed, kept as running totals; a broker starting reads the lengths
(`n`) of the entries already in the stream first. Entries beyond those known count at the known
segments' mean length, or at `segment_len` while none is known (the most they can hold).
"""

from __future__ import annotations

import collections
import math

KEEP_SEGMENTS = 1 << 15  # lengths remembered: far beyond any backlog limit, 2 MB at most


class StreamTally:
    """The transitions of the segments this broker closed, newest last, to count those still in the stream."""

    def __init__(self, segment_len: int, keep: int = KEEP_SEGMENTS) -> None:
        self.segment_len = segment_len
        # running totals: totals[-1] - totals[-1 - n] is the transitions of the newest n segments (the last `keep`)
        self.totals: collections.deque[int] = collections.deque([0], maxlen=keep + 1)

    def add(self, length: int) -> None:
        """A segment of `length` transitions went to the stream."""
        self.totals.append(self.totals[-1] + length)

    def transitions(self, entries: int) -> int:
        """The transitions in a stream of `entries` segments, taken as the newest this broker closed."""
        if entries <= 0:
            return 0
        known = len(self.totals) - 1
        newest = min(entries, known)
        total = self.totals[-1] - self.totals[-1 - newest]
        older = entries - newest
        if older:
            per_segment = (self.totals[-1] - self.totals[0]) / known if known else self.segment_len
            total += math.ceil(older * per_segment)
        return total
