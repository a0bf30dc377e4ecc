"""Packed forwards: the log-probabilities of many responses of different lengths, in few forwards.

Prompts and responses of different lengths go one after another in rows as long
as the longest sequence, position ids restarting at 0 for each; transformers
builds the mask of packed sequences from those position ids (block-causal,
sliding windows included), so each sequence sees only itself and little compute
goes to padding; several rows make one forward, up to a token budget
(`packed_hidden`, `response_logprobs`). `check_layout` proves at start-up that
this gives the model's own log-probabilities, or falls back to one right-padded
sequence per row. The LM head runs only at the positions that predict response
tokens, in float32 (models.scoring.head_logits), in chunks recomputed in the
backward pass so a 150k vocabulary never holds every position's logits at once
(`head_logprobs`).

The generation update (learner_node/token_update.py) scores its batches with these.
The formulas and choices are in docs/design.md, "Generation: token-level PPO".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from models import scoring

log = logging.getLogger(__name__)


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sequence indices into rows of at most `budget` tokens, in order (a longer sequence gets a row alone)."""
    rows: list[list[int]] = []
    used = budget + 1
    for i, n in enumerate(lengths):
        if used + n > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def fill_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices in rows of at most `capacity` tokens, longest first, each into the first row it fits
    (first-fit decreasing: at most 11/9 of the fewest rows possible, plus one); a longer sequence gets a row alone."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


LAYOUTS = ("packed", "padded")  # how a forward lays out sequences of different lengths (check_layout picks one)


def packed_hidden(
    decoder: Any, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], budget: int, layout: str = "packed"
) -> list[torch.Tensor]:
    """The decoder's last hidden state at `positions[i]` of each sequence i, [len(positions[i]), width].

    `packed`: sequences go one after another in rows as long as the longest of them (`fill_rows`), with position ids that
    restart at 0 for each and no attention mask: from position ids alone transformers builds the mask of
    packed sequences itself (block-causal, with each layer's sliding window, for eager and sdpa attention;
    varlen kernels for flash-attention), so each sequence sees only itself, as the model would score it
    alone. A row as long as the longest sequence keeps a row's attention at about what its longest
    sequence's own costs (one long row of many sequences under a dense mask would cost its length squared).
    `padded`: one sequence per row, right-padded to the longest sequence given, under a 2D padding mask: what
    every model accepts, and what packing saves (`ppoz bench update`). As many rows as fit in `budget` tokens go through one forward.
    Gradients flow if enabled."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    device = next(decoder.parameters()).device
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    longest = max([len(s) for s in sequences], default=1)
    rows = fill_rows([len(s) for s in sequences], longest) if layout == "packed" else [[i] for i in range(len(sequences))]
    per_forward = max(1, budget // longest)
    for first in range(0, len(rows), per_forward):
        group = rows[first : first + per_forward]
        # packed: as long as the group's fullest row; padded: every row as long as the call's longest sequence, as a
        # trainer without packing holds its batch (right-padded to its longest, micro-batches sliced from it)
        length = max(sum(len(sequences[i]) for i in row) for row in group) if layout == "packed" else longest
        # Built on the host as lists and copied once per tensor: a tensor op per sequence costs more than
        # the forward itself on short responses (the arithmetic demo's 2 tokens).
        ids: list[list[int]] = []
        pos: list[list[int]] = []
        mask: list[list[int]] = []
        gather: list[int] = []  # each sequence's scored positions in the forward's flattened [rows * length]
        order: list[int] = []
        for b, row in enumerate(group):
            row_ids: list[int] = []
            row_pos: list[int] = []
            for i in row:
                start = b * length + len(row_ids)
                gather.extend(start + q for q in positions[i])
                order.append(i)
                row_ids.extend(sequences[i])
                row_pos.extend(range(len(sequences[i])))
            pad = length - len(row_ids)
            mask.append([1] * len(row_ids) + [0] * pad)
            ids.append(row_ids + [0] * pad)
            pos.append(row_pos + list(range(pad)))  # padding: a sequence of its own, never read
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if layout == "packed":
            hidden = decoder(input_ids=input_ids, position_ids=torch.tensor(pos, dtype=torch.long, device=device), use_cache=False)
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=torch.tensor(mask, dtype=torch.long, device=device), use_cache=False)
        states = hidden.last_hidden_state
        scored = states.reshape(-1, states.shape[-1])[torch.tensor(gather, dtype=torch.long, device=device)]
        for i, h in zip(order, scored.split([len(positions[i]) for i in order])):
            out[i] = h
    return out


def check_layout(model: Any, budget: int = 4096) -> str:
    """The first layout of LAYOUTS whose log-probabilities are the model's own, checked at start-up as the
    candidate path checks its scoring path (models/scoring.py, `select_path`): on probe prompts and responses
    of different lengths in one forward, one of them longer than the model's sliding window if it has one,
    against `model(input_ids).logits` of each sequence alone, in float32 (on `scoring.float32_probe`, a small
    model of the same architecture), to within scoring.FLOAT32_TOLERANCE. A model whose attention ignores the
    position ids' packing (or a transformers release that does not build the packed mask) fails it and gets
    `padded`."""
    limit = scoring.position_limit(model) or 4096
    w = min(scoring.sliding_window(model.config) or 8, (limit - 8) // 2)
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    with scoring.float32_probe(model) as checked, torch.inference_mode():
        vocab = checked.get_output_embeddings().weight.shape[0]

        def tokens(n: int) -> list[int]:
            return torch.randint(3, vocab, (n,), generator=gen).tolist()

        # sequences (prompt + response - 1) of 2w + 4, w + 2 and w + 1 tokens: the first fills a row; the other two
        # share the next, the last starting mid-row and longer than the window, which must hold after position 0
        prompts, responses = [tokens(n) for n in (2 * w - 1, w - 2, w - 1)], [tokens(n) for n in (6, 5, 3)]
        temperatures = [1.0, 0.7, 1.3]
        device = next(checked.parameters()).device
        own = []
        for p, r, t in zip(prompts, responses, temperatures):
            logits = checked(input_ids=torch.tensor([p + r], device=device)).logits[0, len(p) - 1 : -1].float() / t
            own.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r, device=device).unsqueeze(-1)).squeeze(-1))
        for layout in LAYOUTS:
            try:
                got, _ = response_logprobs(checked, prompts, responses, temperatures, max(budget, 6 * w), layout)
                errors[layout] = max(float((g.float() - o).abs().max()) for g, o in zip(got, own))
            except Exception as e:  # a model that rejects this layout's inputs
                log.info("generation layout %s unavailable on this model: %s", layout, e)
                errors[layout] = math.inf
            if errors[layout] <= scoring.FLOAT32_TOLERANCE:
                log.info("generation layout %s (checked against model(input_ids).logits: max diff %.2e)", layout, errors[layout])
                return layout
            log.warning("generation layout %s differs from model(input_ids).logits on this model (%.2e); not used", layout, errors[layout])
    raise scoring.ScoringError(f"no generation layout reproduces this model's log-probabilities: {errors}")


def _logprob_entropy(
    head: Any, post: scoring.LogitTransform, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = post(scoring.head_logits(head, hidden)) / temps.unsqueeze(-1)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def head_logprobs(
    head: Any, post: scoring.LogitTransform, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T) at each position, in chunks of positions
    (`scoring.in_chunks`: with gradients on, each chunk's logits are recomputed in the backward pass instead of kept)."""
    logp, ent = scoring.in_chunks(_logprob_entropy, head, post, hidden, targets, temps)
    return logp, ent


def response_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperatures: Sequence[float],
    budget: int,
    layout: str = "packed",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per response token: log pi(token | prompt, earlier tokens) with the logits divided by the sample's
    temperature (the distribution the actor sampled from before top-p), and that distribution's entropy."""
    return logprobs_of_hidden(model, response_hidden(model, prompts, responses, budget, layout), responses, temperatures)


def response_hidden(
    model: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], budget: int, layout: str = "packed"
) -> list[torch.Tensor]:
    """The decoder's last hidden state before each response token, [len(response), width] per response: what the
    LM head scores it from, and what the critic values it from (`GenerationUpdate.targets`)."""
    decoder = scoring.model_parts(model)[0]
    sequences = [list(p) + list(r[:-1]) for p, r in zip(prompts, responses)]  # the last token predicts nothing we score
    positions = [range(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(prompts, responses)]
    return packed_hidden(decoder, sequences, positions, budget, layout)


def logprobs_of_hidden(
    model: Any, hidden: Sequence[torch.Tensor], responses: Sequence[Sequence[int]], temperatures: Sequence[float]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`response_logprobs` from `response_hidden`'s states: the LM head, the temperature, the log-softmax."""
    _, head, post = scoring.model_parts(model)
    device = next(model.parameters()).device
    flat = torch.cat(list(hidden))
    targets = torch.tensor([t for r in responses for t in r], device=device)
    temps = torch.tensor([t for r, temp in zip(responses, temperatures) for t in [temp] * len(r)], dtype=torch.float32, device=device)
    logp, ent = head_logprobs(head, post, flat, targets, temps)
    sizes = [len(r) for r in responses]
    return list(logp.split(sizes)), list(ent.split(sizes))
