"""Candidate-action scoring: the one function the actor samples from and the learner trains.

score(a | s) = sum over the action's tokens of log p(token | prompt + question +
the action's earlier tokens). The first action token is predicted from the last
context position. Log-probabilities come from a log-softmax over the whole
vocabulary, in float32.

Three ways to compute the same numbers (`PATHS`):

- `packed`: the whole batch in two passes: every context once, then every
  candidate packed behind its context in one row. A 4D attention mask lets
  each candidate see the context and its own earlier tokens only; position ids
  restart after the context for every candidate. The LM head runs only at the
  scored positions. Memory grows with context + candidates, not context x candidates.
- `kv_batch`: the context's KV once, then all candidates of the observation in
  one batched pass over that cache (for models that take no 4D mask).
- `per_candidate`: one full forward of context + candidate per candidate (the
  reference; also the last resort).

`select_path` checks the paths against the model's own `model(input_ids).logits`
on the loaded model and takes the first that matches (actor and learner alike). Nothing here switches autograd on or off: the
actor calls these under `torch.inference_mode()`, the learner with gradients.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import BadInput
from common.options import NORMALISATIONS
from common.options import SCORING_PATHS as PATHS
from models.kv_cache import cache_kwargs, returned_cache

log = logging.getLogger(__name__)


class ScoringError(BadInput):
    """An observation that cannot be scored (for example a candidate with no tokens)."""


@dataclass(frozen=True)
class Tokenized:
    """An observation as token ids: the context (prompt + question) and each candidate."""

    context: tuple[int, ...]
    actions: tuple[tuple[int, ...], ...]
    words: tuple[int, ...]  # word count of each candidate string, for `word` normalisation

    @property
    def n_tokens(self) -> int:
        return len(self.context) + sum(len(a) for a in self.actions)


# How much of the context's end is re-tokenized with each candidate to find the candidate's tokens
# as they fall in the joined text. Pre-tokenizers split at whitespace and punctuation, so the
# tokens at the join depend on a few characters before it; 32 is well past any merge.
BOUNDARY_CHARS = 32


def tokenize_observation(tokenizer: Any, prompt: str, question: str, actions: Sequence[str]) -> Tokenized:
    """The single place where text becomes tokens, for actor and learner alike.

    The model is scored on the text it would read: `prompt + question + candidate`.
    The context's trailing whitespace belongs to the candidate (lm-evaluation-harness's
    rule): a byte-level BPE writes " click" as one token, not " " + "click", and a
    SentencePiece tokenizer must not add its word-start marker to a candidate that
    continues a word. Each candidate's tokens are those that follow the context's end
    when the context's last `BOUNDARY_CHARS` characters and the candidate are tokenized
    together; the context itself (with BOS) is tokenized once and shared by all candidates.
    """
    if not actions:
        raise ScoringError("an observation needs at least one candidate action")
    for i, action in enumerate(actions):
        if not action:
            raise ScoringError(f"candidate {i} is empty")
    text = prompt + question
    kept = text.rstrip()
    trailing = text[len(kept) :]
    context = tuple(tokenizer(kept, add_special_tokens=True)["input_ids"])
    if not context:
        raise ScoringError("prompt + question tokenize to nothing and the tokenizer adds no BOS: nothing to condition on")
    tail = kept[-BOUNDARY_CHARS:]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    joined = tokenizer([tail + trailing + a for a in actions], add_special_tokens=False)["input_ids"]
    encoded = []
    for i, ids in enumerate(joined):
        if ids[: len(tail_ids)] == tail_ids:
            ids = ids[len(tail_ids) :]
        else:  # the candidate merged into the context's last token: score it as written after the context
            ids = tokenizer(trailing + actions[i], add_special_tokens=False)["input_ids"]
        if not ids:
            raise ScoringError(f"candidate {i} ({actions[i]!r}) has no tokens")
        encoded.append(tuple(ids))
    words = tuple(max(1, len(a.split())) for a in actions)
    return Tokenized(context, tuple(encoded), words)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of `tokenizer` stands for, from its vocabulary's spellings, when that bounds
    them (the actor's prompt bound, the reward model's text cut): a BPE whose every byte has a token (byte-level,
    as GPT-2's, Llama 3's and Qwen's) or that falls back to bytes (SentencePiece's byte_fallback, as Llama 2's).
    A spelling is then never shorter than the text it covers. None otherwise: a word-level or WordPiece tokenizer
    turns a whole unknown word of any length into one unknown token, and a BPE without byte fallback drops
    characters it has no token for."""
    try:
        backend = tokenizer.backend_tokenizer.model
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    if type(backend).__name__ != "BPE":
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    if not getattr(backend, "byte_fallback", False) and not all(c in vocab for c in ByteLevel.alphabet()):
        return None
    return max((len(token) for token in vocab), default=1) or 1


def position_limit(model: Any) -> int | None:
    """The most positions the model was built for (learned position tables fail past it, RoPE degrades)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(limit) if limit else None


def check_length(item: Tokenized, limit: int | None) -> None:
    """Raise ScoringError if context + the longest candidate run past the model's position limit."""
    if limit is None:
        return
    longest = len(item.context) + max(len(a) for a in item.actions)
    if longest > limit:
        raise ScoringError(
            f"observation too long: {len(item.context)} context tokens + {longest - len(item.context)} candidate tokens"
            f" = {longest} positions, over the model's limit of {limit}"
        )


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


# --- model parts ------------------------------------------------------------------------
@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to the LM head's output before its logits come out.

    Known from the config: Cohere multiplies by `logit_scale`, Granite divides by
    `logits_scaling`, Gemma 2/3 soft-cap with `final_logit_softcapping`. `select_path`
    checks every path against the model's own `model(input_ids).logits`, so a model
    that does something else is caught there, not scored wrongly.
    """

    scale: float = 1.0
    cap: float | None = None

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        scaling = getattr(config, "logits_scaling", None)
        if scaling:
            scale /= float(scaling)
        return cls(scale, getattr(config, "final_logit_softcapping", None) or None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def model_parts(model: Any) -> tuple[Any, Any, LogitTransform]:
    """(decoder that returns the final-normed hidden states, LM head, the logits' post-processing)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # unwrap peft
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else inner.base_model
    head = inner.get_output_embeddings()
    return decoder, head, LogitTransform.of(inner.config)


def head_logits(head: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's output in float32, computed in float32: a 16-bit head would round every logit
    to 8 (bfloat16) or 11 (float16) significant bits before the log-softmax, an error of up to
    |logit| / 256 in each log-probability. Only the scored positions come here.

    The float32 copy of a frozen 16-bit head's weight (vocab x width x 4 bytes: 0.9 GB for Qwen2.5-1.5B) is made
    once per version of the weight and kept (`_float32_weight`), not on every call: the actor (whose model is
    frozen, actor_node/llm_policy.py) calls this every decode step. A trainable head is upcast on every call: an
    optimizer step (torch's fused Adam) changes a weight without bumping its version counter, so a kept copy
    could be stale, and its gradient must flow anyway."""
    if hidden.dtype == torch.float32 or not _is_plain_linear(head):
        return head(hidden).float()
    bias = head.bias
    weight = head.weight
    upcast = weight.float() if weight.requires_grad else _float32_weight(weight)
    return torch.nn.functional.linear(hidden.float(), upcast, None if bias is None else bias.float())


FLOAT32_COPY = "_ppoz_float32_copy"  # the attribute of a 16-bit weight that holds ((version, storage), its float32 copy)


def _float32_weight(weight: torch.Tensor) -> torch.Tensor:
    """A frozen `weight` in float32, copied again only when the weight has changed since: an in-place change (new
    weights copied in by `load_state_dict`) bumps a tensor's version counter, and a new tensor put in its place
    (`param.data = ...`) has storage of its own. Where no gradient is recorded (the actor's inference) the copy
    is refreshed in place, so a captured decode step (actor_node/decode_step.py) that read it keeps reading the
    current one; where one is, a new copy is made, so a graph that saved the old one can still run its backward.
    It is made outside inference mode, so a learner may use it in a forward that keeps a graph."""
    in_place = not torch.is_grad_enabled()
    with torch.inference_mode(False):
        state = (weight._version, weight.data_ptr())
        kept = getattr(weight, FLOAT32_COPY, None)  # kept on the weight itself: it goes when the weight goes
        if kept is not None and kept[0] == state:
            return kept[1]
        with torch.no_grad():
            if in_place and kept is not None and kept[1].shape == weight.shape:
                copy = kept[1].copy_(weight)
            else:
                copy = weight.detach().float()
        setattr(weight, FLOAT32_COPY, (state, copy))
        return copy


def refresh_float32_head(head: Any) -> None:
    """Bring a frozen 16-bit head's kept float32 copy up to date with its weight (before replaying a captured
    step, which reads the copy without running `head_logits`' check)."""
    weight = getattr(head, "weight", None) if _is_plain_linear(head) else None
    if isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16) and not weight.requires_grad:
        _float32_weight(weight)


def _is_plain_linear(head: Any) -> bool:
    """A Linear, or peft's ModulesToSaveWrapper around one (its .weight is the active copy's)."""
    if isinstance(head, torch.nn.Linear):
        return True
    return type(head).__name__ == "ModulesToSaveWrapper" and isinstance(head.original_module, torch.nn.Linear)


def token_logprobs(head: Any, post: LogitTransform, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each hidden state: float32 LM head, the model's logit post-processing, log-softmax."""
    logits = post(head_logits(head, hidden))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _attention_mask(allowed: torch.Tensor, use_bool: bool, dtype: torch.dtype) -> torch.Tensor:
    """The boolean 'may attend' mask as the attention implementation needs it: as is for sdpa,
    additive (0 or the dtype's minimum) for eager, where a boolean mask would be silently wrong."""
    if use_bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _sum_per_candidate(items: Sequence[Tokenized], logp: torch.Tensor) -> list[torch.Tensor]:
    """Split a flat vector of token log-probabilities (items, candidates, tokens in order) into per-candidate sums."""
    results, offset = [], 0
    for item in items:
        sizes = torch.tensor([len(a) for a in item.actions], device=logp.device)
        total = int(sizes.sum())
        owner = torch.repeat_interleave(torch.arange(len(sizes), device=logp.device), sizes)
        results.append(torch.zeros(len(sizes), dtype=logp.dtype, device=logp.device).index_add(0, owner, logp[offset : offset + total]))
        offset += total
    return results


def _mask_value(model: Any) -> tuple[bool, torch.dtype]:
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
    use_bool, dtype = _mask_value(model)
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
    input_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    position_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    allowed = torch.zeros(batch, 1, length, m + length, dtype=torch.bool, device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    for b, (ids, pos, (n_ctx, spans)) in enumerate(zip(rows, positions, layouts)):
        input_ids[b, : len(ids)] = torch.tensor(ids, device=device)
        position_ids[b, : len(pos)] = torch.tensor(pos, device=device)
        allowed[b, 0, :, :m] = True  # everything sees the cached prefix
        allowed[b, 0, :n_ctx, m : m + n_ctx] = causal[:n_ctx, :n_ctx]
        for start, size in spans:
            allowed[b, 0, start : start + size, m : m + n_ctx] = True
            allowed[b, 0, start : start + size, m + start : m + start + size] = causal[:size, :size]
        for pad in range(len(ids), length):  # padding rows attend to themselves only, so softmax stays finite
            allowed[b, 0, pad, :] = False
            allowed[b, 0, pad, m + pad] = True
    mask = _attention_mask(allowed, use_bool, dtype)
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
    use_bool, dtype = _mask_value(model)
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
        cand_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        cand_pos = torch.zeros(batch, length, dtype=torch.long, device=device)
        allowed = torch.zeros(batch, 1, length, past + length, dtype=torch.bool, device=device)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        for b, (ids, pos, spans) in enumerate(zip(rows, positions, layouts)):
            if ids:
                cand_ids[b, : len(ids)] = torch.tensor(ids, device=device)
                cand_pos[b, : len(pos)] = torch.tensor(pos, device=device)
            allowed[b, 0, :, : m + n_ctx[b]] = True  # the item's own context, not the padding after it
            for start, size in spans:
                allowed[b, 0, start : start + size, past + start : past + start + size] = causal[:size, :size]
            for pad in range(len(ids), length):  # padding attends to itself only, so softmax stays finite
                allowed[b, 0, pad, :] = False
                allowed[b, 0, pad, past + pad] = True
        mask = _attention_mask(allowed, use_bool, dtype)
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


SCORERS = {"packed": score_packed, "kv_batch": score_kv_batch, "per_candidate": score_per_candidate}


def score(model: Any, items: Sequence[Tokenized], path: str = "packed") -> list[torch.Tensor]:
    """Summed log-probabilities of every candidate of every item, by the given path."""
    return SCORERS[path](model, items)


def reference_scores(model: Any, item: Tokenized) -> tuple[torch.Tensor, float]:
    """Each candidate's summed log-probability from the model's own forward: `model(input_ids).logits`
    over context + candidate, log-softmax in float32; and the largest |logit| seen (the scale of 16-bit
    rounding). Shares nothing with the paths above (no decoder split, no LM head of ours, no logit
    post-processing of ours), so it is the yardstick they are held to."""
    device = next(model.parameters()).device
    c = len(item.context)
    sums = []
    largest = 0.0
    for action in item.actions:
        ids = torch.tensor([list(item.context) + list(action)], device=device)
        keep = len(action) + 1  # the positions from the context's last token on
        try:
            logits = model(input_ids=ids, logits_to_keep=keep).logits[0, :-1]
        except TypeError:  # a model whose forward takes no logits_to_keep
            logits = model(input_ids=ids).logits[0, c - 1 : -1]
        largest = max(largest, float(logits.float().abs().max()))
        logp = torch.log_softmax(logits.float(), dim=-1)
        sums.append(logp.gather(-1, torch.tensor(action, device=device).unsqueeze(-1)).sum())
    return torch.stack(sums), largest


def sliding_window(config: Any) -> int | None:
    """The attention window of a model that attends to only the last W positions in some layers, else None."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None


def probe_items(model: Any) -> list[Tokenized]:
    """Random observations for the path check: multi-token candidates, two items of different
    context lengths in one batch, and a context past the model's sliding window if it has one."""
    config = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    limit = position_limit(model) or 4096
    window = sliding_window(config)
    long_context = 9 if window is None else min(window + 8, limit - 8)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())

    return [
        Tokenized(tokens(long_context), (tokens(1), tokens(4), tokens(2)), (1, 1, 1)),
        Tokenized(tokens(5), (tokens(3),), (1,)),
    ]


@contextlib.contextmanager
def _float32(model: Any) -> Iterator[None]:
    """The model's 16-bit parameters in float32 for the duration (exact both ways: every bfloat16
    and float16 value is a float32 value), other parameters (a float32 adapter) untouched."""
    changed = [(p, p.dtype) for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    for p, _ in changed:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dtype in changed:
            p.data = p.data.to(dtype)


# The path check's bars. In float32 every path must equal the reference to float32 rounding. In the
# model's own 16-bit dtype, paths and reference round differently (different kernels and shapes, and
# the reference rounds its logits to 16 bits where the paths keep float32). Rounding a logit moves it
# by at most half a unit in its last place, eps/2 relative (eps = 2^-7 in bfloat16), and a token's
# log-softmax by at most eps x the largest |logit| (its own logit and the log-sum-exp each eps/2 x it):
# the bar is that bound per token. On a bfloat16 model with logits up to 60, paths and reference
# differ by 0.1 against a bar of 1.9; a path that breaks in 16 bits gives non-finite numbers or nats.
FLOAT32_TOLERANCE = 1e-3
NATIVE_ULPS = 1


def _checked_diff(model: Any, path: str, items: Sequence[Tokenized], reference: Sequence[torch.Tensor]) -> float:
    """The largest difference between a path's scores and the reference; inf if it fails or gives non-finite numbers."""
    try:
        got = SCORERS[path](model, items)
    except Exception as e:  # a model that rejects the inputs of this path
        log.info("scoring path %s unavailable on this model: %s", path, e)
        return math.inf
    if not all(bool(torch.isfinite(g).all()) for g in got):
        return math.inf
    return max(float((g.float() - r).abs().max()) for g, r in zip(got, reference))


def select_path(model: Any, requested: str = "auto") -> str:
    """The fastest path that gives the model's own numbers; logs the choice and the measured differences.

    Each path is checked against `reference_scores` on `probe_items`: in float32 (the model's
    16-bit weights upcast for the check, exact) to within FLOAT32_TOLERANCE, which catches a
    wrong mask, a missed sliding window or logit post-processing; then in the model's own dtype
    to within NATIVE_ULPS units of the dtype's rounding per token, which catches a path that
    breaks only in 16 bits. A model that cannot take a 4D mask (FlashAttention-2, hybrid linear
    attention that leaks state between packed candidates) or attends through a sliding window
    fails the check and falls back to `kv_batch`, then to `per_candidate`. A configured path
    (not auto) is checked the same way and refused if it fails.
    """
    if requested != "auto" and requested not in PATHS:
        raise ValueError(f"scoring path must be auto or one of {PATHS}, got {requested!r}")
    probe = probe_items(model)
    dtype = next(model.parameters()).dtype
    candidates = PATHS if requested == "auto" else (requested,)
    # The dtype switch happens outside inference mode (entered first, left last): parameters changed
    # inside it would become inference tensors, which the learner could no longer train.
    with _float32(model), torch.inference_mode():
        measured = [reference_scores(model, item) for item in probe]
        exact = {path: _checked_diff(model, path, probe, [sums for sums, _ in measured]) for path in candidates}
    native = exact  # a float32 model was just checked in its own dtype
    if dtype != torch.float32:
        with torch.inference_mode():
            measured = [reference_scores(model, item) for item in probe]
            native = {path: _checked_diff(model, path, probe, [sums for sums, _ in measured]) for path in candidates}
    largest_logit = max(largest for _, largest in measured)
    tokens = max(len(a) for item in probe for a in item.actions)
    native_bar = max(FLOAT32_TOLERANCE, NATIVE_ULPS * torch.finfo(dtype).eps * max(1.0, largest_logit) * tokens)
    dtype_name = str(dtype).removeprefix("torch.")
    for path in candidates:
        if exact[path] <= FLOAT32_TOLERANCE and native[path] <= native_bar:
            log.info(
                "scoring path %s (checked against model(input_ids).logits: max diff %.2e in float32, %.2e in %s, bar %.2e)",
                *(path, exact[path], native[path], dtype_name, native_bar),
            )
            return path
        if math.isfinite(exact[path]) or math.isfinite(native[path]):
            log.warning(
                "scoring path %s differs from model(input_ids).logits on this model (%.2e in float32, %.2e in %s); not used",
                *(path, exact[path], native[path], dtype_name),
            )
    if requested != "auto":
        raise ScoringError(f"the configured scoring path {requested} does not compute this model's log-probabilities (see the log)")
    raise ScoringError("no scoring path reproduces this model's log-probabilities (see the log); is it a causal LM?")
