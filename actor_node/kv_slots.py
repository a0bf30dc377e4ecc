"""The generation engine's KV cache: one preallocated slot of positions per row, written in place.

Per layer, keys and values live in one tensor each, [slots, kv_heads, capacity + 1,
head_dim], allocated once (on the layer's first write, when its head shape and dtype
are known). Row r owns slot r: its token at position p has its key at [r, :, p].
A forward writes each row's new keys at that row's own positions (index_put, no
concatenation), and attention reads the first `width` positions of the rows it runs
as a strided view of the same memory; nothing is copied per step. The last column
(`capacity`) is a sink: padding tokens of a batched prefill write there, and no
mask ever reads it.

Why slots and not pages (vLLM's PagedAttention, transformers' `PagedAttentionCache`):
paging needs an attention kernel that reads keys through a block table; on a CPU,
or through transformers' standard attention functions, reading pages means gathering
them into one tensor per step, which is the whole-cache copy this cache exists to
avoid. docs/benchmarks.md ("Generation") measures transformers' paged engine beside
this one. The cost of slots is memory reserved per row up to `capacity`, whether
a response uses it or not.

This class is a transformers `Cache` so that a decoder's attention layers call its
`update` as they call any cache's; the engine (actor_node/generation_engine.py) says before
each forward which slots run and where each token goes (`plan`), and passes its own
4D attention mask, so transformers builds none from the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache


class SlotCache(Cache):
    def __init__(self, slots: int, capacity: int, device: torch.device) -> None:
        super().__init__(layers=[])
        self.slots = slots
        self.capacity = capacity
        self.device = device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows: slice | torch.Tensor = slice(0, 0)
        self._where: tuple[torch.Tensor, torch.Tensor] = (torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long))
        self._width = 0

    # --- what the next forward does ----------------------------------------------------------
    def plan(self, rows: list[int], positions: torch.Tensor, width: int) -> None:
        """The next forward runs these slots (one per input row, in order); token j of input row b is
        written at positions[b, j] of its slot (`capacity`, the sink, for padding); attention reads
        positions [0, width) of each slot."""
        consecutive = all(b - a == 1 for a, b in zip(rows, rows[1:]))
        index = torch.tensor(rows, device=self.device)
        self._rows = slice(rows[0], rows[-1] + 1) if consecutive else index
        positions = positions.to(self.device)
        self._where = (index[:, None].expand_as(positions), positions)
        self._width = width

    def plan_fixed(self, rows: int, slots: torch.Tensor, positions: torch.Tensor, width: int) -> None:
        """`plan` for slots 0..rows-1 from tensors already on the device (slots and positions [rows, q]): no
        host-to-device copy, and the same tensors every time, as a captured decode step needs."""
        self._rows = slice(0, rows)
        self._where = (slots, positions)
        self._width = width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx == len(self.keys):
            self._allocate(key_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = self._rows
        # [B, heads, q, dim] -> [B, q, heads, dim]: advanced indices on dims 0 and 2 put their broadcast shape first
        slot, position = self._where
        keys[slot, :, position] = key_states.transpose(1, 2)
        values[slot, :, position] = value_states.transpose(1, 2)
        if isinstance(rows, slice):
            return keys[rows, :, : self._width], values[rows, :, : self._width]
        return keys[:, :, : self._width].index_select(0, rows), values[:, :, : self._width].index_select(0, rows)

    def _allocate(self, like: torch.Tensor) -> None:
        shape = (self.slots, like.shape[1], self.capacity + 1, like.shape[3])
        self.keys.append(torch.zeros(shape, dtype=like.dtype, device=self.device))
        self.values.append(torch.zeros(shape, dtype=like.dtype, device=self.device))

    # --- rows arriving and leaving -------------------------------------------------------------
    def write(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Put a cached prompt's KV (per layer [1, heads, >= length, dim]) at positions [0, length) of a slot."""
        if not self.keys:
            for k, _ in kv:
                self._allocate(k)  # [1, heads, len, dim]: heads and dim where _allocate reads them
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][slot, :, :length] = k[0, :, :length]
            self.values[layer][slot, :, :length] = v[0, :, :length]

    def read(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of a slot's first `length` positions, per layer [1, heads, length, dim] (for the prefix cache)."""
        return [(k[slot : slot + 1, :, :length].clone(), v[slot : slot + 1, :, :length].clone()) for k, v in zip(self.keys, self.values)]

    def clear(self, slot: int) -> None:
        """Zero a slot (its row failed on non-finite values: attention reads a slot past its row's own length)."""
        for keys, values in zip(self.keys, self.values):
            keys[slot].zero_()
            values[slot].zero_()

    def copy(self, source: int, target: int, length: int) -> None:
        """Positions [0, length) of slot `source` into slot `target`: a row moving, or a shared prompt's KV."""
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]

    # --- what transformers may ask of a cache ----------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
