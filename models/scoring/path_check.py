"""Choosing a scoring path: each path checked against the model's own `model(input_ids).logits` (`select_path`)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from common.options import SCORING_PATHS as PATHS
from models.scoring.observation import ScoringError, Tokenized, position_limit
from models.scoring.paths import SCORERS, WITHOUT_CACHE

log = logging.getLogger(__name__)


def reference_scores(model: Any, item: Tokenized) -> tuple[torch.Tensor, float]:
    """Each candidate's summed log-probability from the model's own forward: `model(input_ids).logits`
    over context + candidate, log-softmax in float32; and the largest |logit| seen (the scale of 16-bit
    rounding). Shares nothing with the paths of paths.py (no decoder split, no LM head of ours, no logit
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


PROBE_VOCAB = 1024  # the architecture probe's vocabulary: the checks' random tokens need no more


@contextlib.contextmanager
def float32_probe(model: Any) -> Iterator[Any]:
    """A float32 model of `model`'s architecture to check the scoring paths' arithmetic on, for the duration: the
    model itself if it is float32, else a probe.

    What the float32 checks catch (a wrong mask, a missed sliding window, logit post-processing, packing the
    attention ignores) is the architecture's code, not its weights: so they run on a small model of the same
    config, on the same device, with random weights: one decoder layer of each kind the model has (a sliding-window
    layer and a full one, or the first layer) and a vocabulary of PROBE_VOCAB tokens. Upcasting the model itself
    held a float32 copy of all its weights at start-up (7B: 30 GB beside its 15 GB in bf16, in every process at
    once on a one-GPU `ppoz up`). A model whose config cannot build such a probe is upcast for the check, as before."""
    if all(p.dtype not in (torch.bfloat16, torch.float16) for p in model.parameters()):
        yield model  # already float32: checked as it is, at no cost
        return
    probe = _architecture_probe(model)
    if probe is None:
        with _float32(model):
            yield model
        return
    try:
        yield probe
    finally:
        del probe


def keep_layers(config: Any, layers: int) -> None:
    """`layers` decoder layers, or one of each kind the model has (sliding-window and global attention, say)
    where it has more kinds than that."""
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds:
        kept = kinds[:layers]
        kept += [kind for kind in dict.fromkeys(kinds) if kind not in kept]  # a global layer after five sliding ones, say
        config.layer_types = kept
        layers = len(kept)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, min(getattr(config, name), layers))


def _architecture_probe(model: Any) -> Any | None:
    import copy

    from transformers import AutoModelForCausalLM

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(inner.config)
    if getattr(config, "auto_map", None):  # remote code: built only as it was loaded
        return None
    keep_layers(config, 1)
    config.vocab_size = min(int(config.vocab_size), PROBE_VOCAB)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = getattr(config, name, None)
        if isinstance(token, int) and token >= config.vocab_size:
            setattr(config, name, None)
    device = next(model.parameters()).device
    try:
        with torch.device(device):
            probe = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=config._attn_implementation)
    except Exception as e:  # noqa: BLE001 - a config from_config cannot build: the model itself is checked
        log.info("no architecture probe for this model (%s): its scoring is checked on its own weights in float32", e)
        return None
    return probe.eval().requires_grad_(False)


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
    """The largest difference between a path's scores and the reference, in both its forms (with the KV cache it
    passes between passes, and the cache-free one a learner with gradient checkpointing trains with, WITHOUT_CACHE);
    inf if either fails or gives non-finite numbers."""
    diffs = []
    for scorer in dict.fromkeys((SCORERS[path], WITHOUT_CACHE[path])):
        try:
            got = scorer(model, items)
        except Exception as e:  # a model that rejects the inputs of this path
            log.info("scoring path %s (%s) unavailable on this model: %s", path, scorer.__name__, e)
            return math.inf
        if not all(bool(torch.isfinite(g).all()) for g in got):
            return math.inf
        diffs.append(max(float((g.float() - r).abs().max()) for g, r in zip(got, reference)))
    return max(diffs)


def select_path(model: Any, requested: str = "auto") -> str:
    """The fastest path that gives the model's own numbers; logs the choice and the measured differences.

    Each path is checked against `reference_scores` on `probe_items`: in float32 (on `float32_probe`, a small
    model of the same architecture) to within FLOAT32_TOLERANCE, which catches a
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
    with float32_probe(model) as float32_model, torch.inference_mode():
        measured = [reference_scores(float32_model, item) for item in probe_items(float32_model)]
        exact = {
            path: _checked_diff(float32_model, path, probe_items(float32_model), [sums for sums, _ in measured]) for path in candidates
        }
    native = exact
    if dtype != torch.float32 or float32_model is not model:  # the model itself, in its own dtype
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
