"""Sampling the next token of every row at once: temperature, top-k, top-p, and a seeded draw per row.

For each row the distribution sampled from is: logits / T, log-softmax; top-k keeps the
k most likely tokens (0: all); top-p then keeps the smallest set of the most likely of
those whose probability, renormalised over them, reaches p (the most likely always
stays), as transformers and vLLM apply the two; the kept tokens are renormalised.
The token is drawn by inverting that distribution's cumulative sum, in vocabulary
order, at one uniform number u (so a row's draw never depends on what other rows
ask), and its log-probability under the renormalised distribution is what the
engine logs. T = 0 is greedy: the argmax, logged with log-probability 0.

The uniform number of a row's t-th response token is splitmix64(seed, t)
(`row_uniforms`): a pure function of the request's seed and the token's index, the
same on any device and whatever else is in the batch. So a seeded request draws the
same numbers alone or in a batch; its text is the same whenever its logits are
(docs/protocol.md says when they may differ in the last bits). Everything is
computed for the whole batch with tensor operations: no per-row Python on this path.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (Steele, Lea and Flood 2014), in wrapping int64 arithmetic."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def row_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform number in [0, 1) per row: the counters[b]-th output of splitmix64 started from
    a state derived from seeds[b] (int64 tensors of one shape), as float64."""
    state = _mix(seeds + _GAMMA)
    z = _mix(state + (counters + 1) * _GAMMA)
    return _shift_right(z, 11).double() / float(1 << 53)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    any_filtered: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [n], their log-probabilities [n], rows that could not be sampled [n] bool) for logits
    [n, vocab] (float32) and per-row settings [n]: temperature (0: greedy), top_p in (0, 1], top_k (0: off),
    uniforms in [0, 1). The settings may be on the host: whether any row filters is then decided there, with
    no wait for the device, and they are copied over. Settings already on the device come with `any_filtered`
    decided by the caller from its host copy (a wrong False skips top-k and top-p: the caller's promise)."""
    vocab = logits.shape[-1]
    filtered = (top_p < 1) | ((top_k > 0) & (top_k < vocab))
    if any_filtered is None:
        any_filtered = bool(filtered.any())
    device = logits.device
    temperature, top_p, top_k, filtered = (t.to(device, non_blocking=True) for t in (temperature, top_p, top_k, filtered))
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).to(logits.dtype)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if any_filtered:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        in_top_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        # top-p over the top-k tokens renormalised: transformers' and vLLM's order (top-k, then top-p)
        mass = sorted_logp.exp() * in_top_k
        mass = mass / mass.sum(dim=-1, keepdim=True)
        before = torch.cumsum(mass, dim=-1) - mass  # the mass of the tokens above each one
        # top_p 1 keeps everything: a float32 cumulative sum reaches 1 before the tail ends
        nucleus = (top_p[:, None] >= 1) | (before < top_p[:, None].to(mass.dtype))
        keep_sorted = in_top_k & nucleus
        keep_sorted[:, 0] = True  # the most likely token always stays
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)  # back in vocabulary order
        kept = logp.masked_fill(~keep, float("-inf"))
        # rows without top-k or top-p keep their log-softmax bit for bit, whatever their neighbours ask
        logp = torch.where(filtered[:, None], kept - torch.logsumexp(kept, dim=-1, keepdim=True), logp)
    probs = logp.exp()
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[:, -1]
    broken = torch.isnan(logits).any(dim=-1) | torch.isinf(logits.max(dim=-1).values)  # greedy or not
    failed = broken | ~torch.isfinite(total) | (total <= 0)
    target = (uniforms.to(cdf.device) * torch.where(failed, 1.0, total))[:, None]
    last = vocab - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1, keepdim=True)  # the last token u can land on
    index = torch.minimum(torch.searchsorted(cdf, target, right=True), last)
    tokens = index.squeeze(1)
    logprobs = logp.gather(1, index).squeeze(1)
    best = torch.argmax(logits, dim=-1)
    tokens = torch.where(greedy, best, tokens)
    logprobs = torch.where(greedy, torch.zeros_like(logprobs), logprobs)
    return tokens, logprobs, broken | (failed & ~greedy)
