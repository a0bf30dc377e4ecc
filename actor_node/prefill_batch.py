"""One prefill forward of the generation engine (actor_node/generation_engine.py): which joining rows' prompts it
computes, how many tokens of each, and the right-padded inputs that carry them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actor_node.responses import Row


@dataclass(frozen=True)
class PrefillBatch:
    """The next chunks of the oldest prompts as one forward's inputs, each row at its own positions."""

    chosen: list[tuple[Row, int]]  # each row that prefills and how many of its context's tokens this forward computes
    ids: torch.Tensor  # [rows, q] the chunks' token ids, right-padded with 0
    positions: torch.Tensor  # [rows, q] each token's position; padding repeats its row's last
    real: torch.Tensor  # [rows, q] False at padding
    width: int  # the positions attention reads: the furthest a row reaches after this chunk
    tokens: int  # the chunks' tokens, padding not counted

    @classmethod
    def plan(cls, queue: list[Row], contexts: dict[Row, list[int]], budget: int) -> PrefillBatch:
        """The rows of `queue` (oldest first) that fit `budget` padded tokens and their chunks of `contexts`."""
        chosen: list[tuple[Row, int]] = []
        width_q = 0
        for row in queue:  # the oldest always goes; others while the padded batch stays within the budget
            take = min(len(contexts[row]) - row.filled, budget)
            if chosen and (len(chosen) + 1) * max(width_q, take) > budget:
                continue  # a shorter prompt further back may still fit
            chosen.append((row, take))
            width_q = max(width_q, take)
        rows = [r for r, _ in chosen]
        steps = torch.arange(width_q)
        starts = torch.tensor([r.filled for r in rows])
        lengths = torch.tensor([take for _, take in chosen])
        real = steps[None, :] < lengths[:, None]
        positions = starts[:, None] + torch.minimum(steps[None, :], lengths[:, None] - 1)
        ids = torch.zeros(len(rows), width_q, dtype=torch.long)
        for b, (row, take) in enumerate(chosen):
            ids[b, :take] = torch.tensor(contexts[row][row.filled : row.filled + take])
        width = int((starts + lengths).max())
        return cls(chosen, ids, positions, real, width, int(lengths.sum()))
