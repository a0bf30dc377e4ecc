"""The three scoring paths (`packed`, `kv_batch`, `per_candidate`: the package's docstring says how each computes
the same numbers), `score` by a path's name, and the step from summed log-probabilities to a policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from common.options import NORMALISATIONS
from models.kv_cache import cache_kwargs, returned_cache
from models.scoring.lm_head import model_parts, token_logprobs
from models.scoring.observation import ScoringError, Tokenized


# --- from summed log-probabilities to a policy -----------------------------------------
def normalise(sums: torch.Tensor, item: Tokenized, mode: str) -> torch.Tensor:
    """Divide each candidate's summed log-probability by its token count, word count, or nothing."""
    if mode == "sum":
        return sums
    if mode == "token":
        counts = [len(a) for a in item.actions]
    elif mode == "word":
        counts = list(item.words)
    else:
        raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {mode!r}")
    return sums / torch.tensor(counts, dtype=sums.dtype, device=sums.device)


def policy_logprobs(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(a | s) over the candidates: log-softmax of the normalised scores / temperature."""
    return torch.log_softmax(scores / temperature, dim=-1)


# --- attention masks and sums the paths share ------------------------------------------
def as_attention_mask(allowed: torch.Tensor, use_bool: bool, dtype: torch.dtype) -> torch.Tensor:
    """The boolean 'may attend' mask as the attention implementation needs it: as is for sdpa,
    additive (0 or the dtype's minimum) for eager, where a boolean mask would be silently wrong."""
    if use_bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _sum_per_candidate(items: Sequence[Tokenized], logp: torch.Tensor) -> list[torch.Tensor]:
    """Split a flat vector of token log-probabilities (items, candidates, tokens in order) into per-candidate sums."""
    results, offset = [], 0
    for item in items:
        sizes = [len(a) for a in item.actions]
        total = sum(sizes)  # from the host's lists: no read back from the device
        owner = torch.tensor([j for j, size in enumerate(sizes) for _ in range(size)], device=logp.device)
        results.append(torch.zeros(len(sizes), dtype=logp.dtype, device=logp.device).index_add(0, owner, logp[offset : offset + total]))
        offset += total
    return results


def _pad_to_itself(allowed: torch.Tensor, filled: int, past: int) -> None:
    """A row's padding positions (from `filled` on) attend to themselves only, so their softmax stays finite;
    `allowed` is the row's [length, past + length] mask."""
    pad = torch.arange(filled, allowed.shape[0])
    allowed[filled:, :] = False
    allowed[pad, past + pad] = True


def mask_format(model: Any) -> tuple[bool, torch.dtype]:
    """Whether the attention implementation takes a boolean 4D mask (sdpa) or needs an additive one (eager)."""
    impl = getattr(model.config, "_attn_implementation", "eager")
    return impl == "sdpa", next(model.parameters()).dtype


# --- the three paths ----------------------------------------------------------------------
def score_packed(model: Any, items: Sequence[Tokenized], past: Sequence[Any] | None = None) -> list[torch.Tensor]:
    """Summed log-probability of every candidate of every item, one forward for the whole batch.

    `past`, if given, holds for each item either None or (kv, m): the cached KV
    of its first m context tokens (a list of per-layer (key, value) tensors of
    batch 1). Items with a cached prefix compute only the rest (one forward each).
    """
    return _score_packed(model, items, past, keep_kv=False)[0]


def score_packed_kv(model: Any, items: Sequence[Tokenized], past: Sequence[Any] | None = None) -> tuple[list[torch.Tensor], list]:
    """As score_packed, and also each item's whole-context KV (for the prefix cache)."""
    return _score_packed(model, items, past, keep_kv=True)


def _score_packed(model: Any, items: Sequence[Tokenized], past: Sequence[Any] | None, keep_kv: bool) -> tuple[list, list]:
    scores: list[Any] = [None] * len(items)
    kvs: list[Any] = [None] * len(items)
    fresh = [i for i in range(len(items)) if not past or past[i] is None]
    groups = [(fresh, None, 0)] if fresh else []
    groups += [([i], past[i][0], past[i][1]) for i in range(len(items)) if past and past[i] is not None]
    for members, kv, m in groups:
        forward = _packed_forward if kv is None else _packed_single_pass
        got, cache = forward(model, [items[i] for i in members], kv, m, keep_cache=keep_kv)
        for row, i in enumerate(members):
            scores[i] = got[row]
            if keep_kv:
                c = len(items[i].context)
                # A lone row's context KV is a view (it keeps only the few candidate positions after it
                # alive); rows of a batch are copied out, or each would keep the whole batch's KV alive.
                own = (lambda t: t) if len(members) == 1 else torch.clone
                kvs[i] = [(own(layer.keys[row : row + 1, :, :c]), own(layer.values[row : row + 1, :, :c])) for layer in cache.layers]
    return scores, kvs


def _packed_single_pass(model: Any, items: Sequence[Tokenized], kv: Any, m: int, keep_cache: bool = False):
    """One pass: the uncached rest of each context and every candidate after it, in one row.

    Used behind a cached prefix, where the computed context is short: one pass
    copies the cached KV once instead of twice, and the masked-away attention is small."""
    from transformers import DynamicCache

    decoder, head, post = model_parts(model)
    use_bool, dtype = mask_format(model)
    device = next(model.parameters()).device
    rows, positions, layouts = [], [], []
    for item in items:
        ctx = list(item.context[m:])
        c = len(item.context)
        ids, pos, spans = list(ctx), list(range(m, c)), []
        for action in item.actions:
            spans.append((len(ids), len(action)))
            ids.extend(action)
            pos.extend(range(c, c + len(action)))
        rows.append(ids)
        positions.append(pos)
        layouts.append((len(ctx), spans))
    batch, length = len(rows), max(len(r) for r in rows)
    input_ids = torch.tensor([r + [0] * (length - len(r)) for r in rows], dtype=torch.long, device=device)
    position_ids = torch.tensor([q + [0] * (length - len(q)) for q in positions], dtype=torch.long, device=device)
    # Built on the host and copied once: a device write per span and padding position would be thousands of tiny
    # copies for a batch of Kea observations (32 candidates each, rows padded by hundreds of positions).
    allowed = torch.zeros(batch, 1, length, m + length, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for b, (ids, (n_ctx, spans)) in enumerate(zip(rows, layouts)):
        allowed[b, 0, :, :m] = True  # everything sees the cached prefix
        allowed[b, 0, :n_ctx, m : m + n_ctx] = causal[:n_ctx, :n_ctx]
        for start, size in spans:
            allowed[b, 0, start : start + size, m : m + n_ctx] = True
            allowed[b, 0, start : start + size, m + start : m + start + size] = causal[:size, :size]
        _pad_to_itself(allowed[b, 0], len(ids), m)
    mask = as_attention_mask(allowed.to(device), use_bool, dtype)
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in kv]) if kv is not None else None
    out = decoder(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        **cache_kwargs(decoder, cache, use_cache=keep_cache or cache is not None),
    )
    hidden = out.last_hidden_state
    # Gather the scored positions of the whole batch and apply the LM head once.
    row_idx: list[int] = []
    col_idx: list[int] = []
    targets: list[int] = []
    for b, (item, (n_ctx, spans)) in enumerate(zip(items, layouts)):
        for (start, size), action in zip(spans, item.actions):
            row_idx.extend([b] * size)
            col_idx.extend([n_ctx - 1, *range(start, start + size - 1)])
            targets.extend(action)
    if any(n_ctx == 0 for n_ctx, _ in layouts):
        raise ScoringError("a cached prefix must leave at least one context token to compute")
    logp = token_logprobs(
        head, post, hidden[torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device)], torch.tensor(targets, device=device)
    )
    results = _sum_per_candidate(items, logp)
    return results, (returned_cache(out) if keep_cache else None)


def _packed_forward(model: Any, items: Sequence[Tokenized], kv: Any, m: int, keep_cache: bool = False):
    """Two passes over the batch: every context once (causal), then every candidate packed behind it.

    Pass 1 runs the contexts alone, so the attention kernel only does the causal
    half of context x context. Pass 2 runs all candidates of an item in one row
    over pass 1's KV: a 4D mask lets each candidate see its context and its own
    earlier tokens, position ids restart at len(context) for each candidate, and
    only a candidate's tokens but the last go in (the last predicts nothing we
    score). A single pass of context + candidates would compute attention for
    the whole (context + candidates)^2 square, most of it masked away.
    """
    from transformers import DynamicCache

    decoder, head, post = model_parts(model)
    use_bool, dtype = mask_format(model)
    device = next(model.parameters()).device
    batch = len(items)
    n_ctx = [len(item.context) - m for item in items]
    if min(n_ctx) <= 0:
        raise ScoringError("a cached prefix must leave at least one context token to compute")

    # Pass 1: the contexts.
    width = max(n_ctx)
    ctx_ids = torch.zeros(batch, width, dtype=torch.long, device=device)
    ctx_mask = torch.zeros(batch, m + width, dtype=torch.long, device=device)
    ctx_mask[:, :m] = 1
    for b, item in enumerate(items):
        ctx_ids[b, : n_ctx[b]] = torch.tensor(item.context[m:], device=device)
        ctx_mask[b, m : m + n_ctx[b]] = 1
    ctx_pos = (m + torch.arange(width, device=device)).expand(batch, width)
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in kv]) if kv is not None else DynamicCache()
    out = decoder(input_ids=ctx_ids, attention_mask=ctx_mask, position_ids=ctx_pos, **cache_kwargs(decoder, cache))
    last_ctx = out.last_hidden_state[torch.arange(batch, device=device), torch.tensor(n_ctx, device=device) - 1]

    # Pass 2: the candidates, each after its own context.
    rows, positions, layouts = [], [], []
    for item in items:
        c = len(item.context)
        ids: list[int] = []
        pos: list[int] = []
        spans: list[tuple[int, int]] = []
        for action in item.actions:
            spans.append((len(ids), len(action) - 1))
            ids.extend(action[:-1])
            pos.extend(range(c, c + len(action) - 1))
        rows.append(ids)
        positions.append(pos)
        layouts.append(spans)
    length = max(len(r) for r in rows)
    hidden = None
    if length:
        past = m + width
        cand_ids = torch.tensor([r + [0] * (length - len(r)) for r in rows], dtype=torch.long, device=device)
        cand_pos = torch.tensor([q + [0] * (length - len(q)) for q in positions], dtype=torch.long, device=device)
        allowed = torch.zeros(batch, 1, length, past + length, dtype=torch.bool)  # on the host, copied once
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        for b, (ids, spans) in enumerate(zip(rows, layouts)):
            allowed[b, 0, :, : m + n_ctx[b]] = True  # the item's own context, not the padding after it
            for start, size in spans:
                allowed[b, 0, start : start + size, past + start : past + start + size] = causal[:size, :size]
            _pad_to_itself(allowed[b, 0], len(ids), past)
        mask = as_attention_mask(allowed.to(device), use_bool, dtype)
        hidden = decoder(input_ids=cand_ids, attention_mask=mask, position_ids=cand_pos, **cache_kwargs(decoder, cache)).last_hidden_state

    # Gather the hidden state before every scored token and apply the LM head once.
    states: list[torch.Tensor] = []
    targets: list[int] = []
    for b, (item, spans) in enumerate(zip(items, layouts)):
        for (start, size), action in zip(spans, item.actions):
            states.append(last_ctx[b : b + 1])
            if size:
                assert hidden is not None  # a candidate of more than one token made `length` positive
                states.append(hidden[b, start : start + size])
            targets.extend(action)
    logp = token_logprobs(head, post, torch.cat(states), torch.tensor(targets, device=device))
    results = _sum_per_candidate(items, logp)
    return results, (cache if keep_cache else None)


def score_kv_batch(model: Any, items: Sequence[Tokenized]) -> list[torch.Tensor]:
    """Context KV once per item, then all its candidates in one batched pass over that cache."""
    from transformers import DynamicCache

    decoder, head, post = model_parts(model)
    device = next(model.parameters()).device
    results = []
    for item in items:
        c, k = len(item.context), len(item.actions)
        out = decoder(input_ids=torch.tensor([item.context], device=device), use_cache=True)
        first = torch.tensor([a[0] for a in item.actions], device=device)
        first_lp = token_logprobs(head, post, out.last_hidden_state[0, -1].expand(k, -1), first)
        longest = max(len(a) for a in item.actions)
        if longest == 1:
            results.append(first_lp)
            continue
        layers = [(layer.keys.repeat_interleave(k, 0), layer.values.repeat_interleave(k, 0)) for layer in returned_cache(out).layers]
        cache = DynamicCache(ddp_cache_data=layers)
        n = longest - 1  # the last token of each candidate predicts nothing we score
        ids = torch.zeros(k, n, dtype=torch.long, device=device)
        attn = torch.zeros(k, c + n, dtype=torch.long, device=device)
        attn[:, :c] = 1
        for j, a in enumerate(item.actions):
            ids[j, : len(a) - 1] = torch.tensor(a[:-1], device=device)
            attn[j, c : c + len(a) - 1] = 1
        pos = (c + torch.arange(n, device=device)).expand(k, n)
        hidden = decoder(input_ids=ids, attention_mask=attn, position_ids=pos, **cache_kwargs(decoder, cache)).last_hidden_state
        sums = first_lp.clone()
        for j, a in enumerate(item.actions):
            if len(a) > 1:
                sums[j] = sums[j] + token_logprobs(head, post, hidden[j, : len(a) - 1], torch.tensor(a[1:], device=device)).sum()
        results.append(sums)
    return results


def score_per_candidate(model: Any, items: Sequence[Tokenized]) -> list[torch.Tensor]:
    """The reference: one unpadded forward of context + candidate per candidate."""
    decoder, head, post = model_parts(model)
    device = next(model.parameters()).device
    results = []
    for item in items:
        c = len(item.context)
        sums = []
        for a in item.actions:
            ids = torch.tensor([list(item.context) + list(a)], device=device)
            hidden = decoder(input_ids=ids).last_hidden_state[0, c - 1 : c - 1 + len(a)]
            sums.append(token_logprobs(head, post, hidden, torch.tensor(a, device=device)).sum())
        results.append(torch.stack(sums))
    return results


def score_packed_one_pass(model: Any, items: Sequence[Tokenized]) -> list[torch.Tensor]:
    """As score_packed, each context and its candidates in one row of one pass with no KV cache: what a forward
    that recomputes its layers in the backward pass (gradient checkpointing) can run, where a cache written in the
    forward would be written a second time by the recompute. Its attention covers the whole (context + candidates)
    square, most of it masked away: the price of keeping one layer's activations at a time."""
    return _packed_single_pass(model, items, None, 0)[0]


SCORERS = {"packed": score_packed, "kv_batch": score_kv_batch, "per_candidate": score_per_candidate}
# A forward that keeps no KV cache between passes, by the path chosen at start-up: `packed`'s one-pass form (the path
# check holds it to the model's numbers with `packed`, models/scoring/path_check.py), and `per_candidate` for a model
# whose 4D masks `packed` failed on (a sliding window, FlashAttention, hybrid attention): `kv_batch` needs its cache.
WITHOUT_CACHE = {"packed": score_packed_one_pass, "kv_batch": score_per_candidate, "per_candidate": score_per_candidate}


def score(model: Any, items: Sequence[Tokenized], path: str = "packed", cache: bool = True) -> list[torch.Tensor]:
    """Summed log-probabilities of every candidate of every item, by the given path; `cache=False`: by a path that
    keeps no KV cache between passes (`WITHOUT_CACHE`: under gradient checkpointing)."""
    return (SCORERS if cache else WITHOUT_CACHE)[path](model, items)
