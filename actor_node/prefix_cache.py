"""A KV cache of recent prompt contexts, reused across steps and tasks.

Kea's prompts grow by appending (the history of completed steps is never
cleared), so consecutive prompts of one task share a long token prefix, and
different tasks share the task instructions. An entry is the KV of one whole
context; a lookup returns the entry with the longest common token prefix with
the new context and that length m: the first m positions of its KV are exactly
what a forward of those m tokens would compute. One entry per task is kept
(the newest context supersedes the older); entries are evicted least recently
used past the memory budget, and everything is dropped when the weights change.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Entry:
    ids: torch.Tensor  # the context's token ids, 1D long
    kv: KV  # per layer (key, value), each [1, heads, len(ids), head_dim]
    nbytes: int


class PrefixCache:
    def __init__(self, budget_mb: float, min_prefix: int = 16) -> None:
        self.budget = int(budget_mb * 1024 * 1024)
        self.min_prefix = min_prefix
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # task -> entry, LRU order
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def lookup(self, context: tuple[int, ...] | list[int]) -> tuple[KV, int] | None:
        """(KV of the longest cached prefix, its length m), or None. m < len(context): the
        last context token is always computed, since its hidden state scores the first candidate token."""
        if not self.enabled or not self.entries:
            self.misses += 1
            return None
        ids = torch.tensor(context, dtype=torch.long)
        best_key, best_m = None, 0
        for key, entry in self.entries.items():
            n = min(len(entry.ids), len(ids) - 1)
            if n <= best_m:
                continue
            same = entry.ids[:n] == ids[:n]
            m = n if bool(same.all()) else int(same.to(torch.int8).argmin())
            if m > best_m:
                best_key, best_m = key, m
        if best_key is None or best_m < self.min_prefix:
            self.misses += 1
            return None
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best_m
        entry = self.entries[best_key]
        return [(k[:, :, :best_m], v[:, :, :best_m]) for k, v in entry.kv], best_m

    def insert(self, key: str, context: tuple[int, ...] | list[int], kv: KV) -> None:
        """Store a context's KV under `key` (a task id), replacing that task's older entry."""
        if not self.enabled:
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.budget:
            return
        self._drop(key)
        self.entries[key] = Entry(torch.tensor(context, dtype=torch.long), kv, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        """Forget everything (the weights changed, so every cached KV is stale)."""
        self.entries.clear()
        self.nbytes = 0

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def stats(self) -> dict[str, float]:
        return {
            "entries": len(self.entries),
            "mb": round(self.nbytes / 2**20, 1),
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
        }
