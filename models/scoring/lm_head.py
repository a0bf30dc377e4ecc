"""The LM head and what a model's forward does to its output: the decoder and head a path calls directly, the
logits in float32 (the function the actor and the learner both compute them with), and each token's log-probability."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


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

    A 16-bit head and 16-bit hidden states multiply exactly: the product of two 8-bit (bfloat16) or 11-bit
    (float16) significands fits float32's 24 bits, so only the float32 accumulation rounds. On a GPU the
    tensor cores do just that (`torch.mm(..., out_dtype=torch.float32)`: 16-bit inputs, float32 accumulation
    and output, `Float32Product`), at the 16-bit rate and with no float32 copy of the weight; a float32 matmul
    there runs on the SIMT path at ~1/15 of it (H100). Elsewhere (the CPU, whose 16-bit matmul is slow) the
    weight is upcast: a frozen weight's float32 copy (vocab x width x 4 bytes) is made once per version of the
    weight and kept (`_float32_weight`), not on every call, as the actor calls this every decode step; a trainable
    head is upcast on every call: an optimizer step (torch's fused Adam) changes a weight without bumping its
    version counter, so a kept copy could be stale, and its gradient must flow anyway."""
    if hidden.dtype == torch.float32 or not _is_plain_linear(head):
        return head(hidden).float()
    bias = head.bias
    weight = head.weight
    if hidden.device.type in EXACT_PRODUCT_DEVICES and hidden.dtype == weight.dtype:
        logits = Float32Product.apply(hidden, weight)
        return logits if bias is None else logits + bias.float()
    upcast = weight.float() if weight.requires_grad else _float32_weight(weight)
    return torch.nn.functional.linear(hidden.float(), upcast, None if bias is None else bias.float())


# Where torch multiplies 16-bit matrices into a float32 result (`torch.mm`'s out_dtype: cuBLAS); the meta device
# traces the same calls (shapes and dtypes, no data), so the suite runs this path without a GPU.
EXACT_PRODUCT_DEVICES: tuple[str, ...] = ("cuda", "meta")


class Float32Product(torch.autograd.Function):
    """hidden @ weight.T for 16-bit `hidden` [..., width] and `weight` [vocab, width], in float32 from 16-bit inputs
    (tensor cores: exact products, float32 accumulation), with its backward: torch's `mm` with an `out_dtype` has
    none. The gradients are those a 16-bit model's own backward computes: the incoming float32 gradient rounded to
    the weight's dtype once, each product accumulated in float32, the result in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(flat, weight.t(), out_dtype=torch.float32).reshape(*hidden.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        hidden, weight = ctx.saved_tensors
        grad16 = grad.reshape(-1, weight.shape[0]).to(weight.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.mm(grad16, weight, out_dtype=torch.float32).to(hidden.dtype).reshape(hidden.shape)
        if ctx.needs_input_grad[1]:
            flat = hidden.reshape(-1, hidden.shape[-1])
            grad_weight = torch.mm(grad16.t(), flat, out_dtype=torch.float32).to(weight.dtype)
        return grad_hidden, grad_weight


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
    step, which reads the copy without running `head_logits`' check). A head on a GPU keeps none."""
    weight = getattr(head, "weight", None) if _is_plain_linear(head) else None
    if (
        isinstance(weight, torch.Tensor)
        and weight.dtype in (torch.bfloat16, torch.float16)
        and not weight.requires_grad
        and weight.device.type not in EXACT_PRODUCT_DEVICES
    ):
        _float32_weight(weight)


def _is_plain_linear(head: Any) -> bool:
    """A Linear, or peft's ModulesToSaveWrapper around one (its .weight is the active copy's)."""
    if isinstance(head, torch.nn.Linear):
        return True
    return type(head).__name__ == "ModulesToSaveWrapper" and isinstance(head.original_module, torch.nn.Linear)


# At most this many logits (128 MB in float32) are computed at once: the scored positions go through the head in
# chunks, so a 151,936-token vocabulary never holds every position's logits (1,600 candidate tokens of a Kea
# observation would be 1 GB of logits, and as much again of log-softmax).
LOGITS_AT_ONCE = 1 << 25
# Logits of a chunk up to this many values (4 MB in float32) are kept for the backward pass: recomputing them
# saves no memory worth having and costs the checkpoint's machinery on every small forward.
KEEP_LOGITS = 1 << 20


def _vocab(head: Any) -> int:
    return int(head.weight.shape[0] if _is_plain_linear(head) else getattr(head, "out_features", 1))


def positions_at_once(head: Any) -> int:
    """How many positions' logits `in_chunks` computes at once with this head."""
    return max(1, LOGITS_AT_ONCE // max(1, _vocab(head)))


def in_chunks(
    fn: Callable[..., tuple[torch.Tensor, ...]], head: Any, post: LogitTransform, hidden: torch.Tensor, *per_position: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`fn(head, post, hidden, *per_position)` over chunks of positions (`positions_at_once`), the outputs (one value a
    position each) concatenated. With gradients on, a chunk's logits are recomputed in the backward pass instead of
    kept (torch.utils.checkpoint), so a backward holds one chunk's logits at a time, not every position's."""
    step, vocab = positions_at_once(head), _vocab(head)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0], step):
        args = (hidden[start : start + step], *(t[start : start + step] for t in per_position))
        if recompute and args[0].shape[0] * vocab > KEEP_LOGITS:
            parts.append(checkpoint(fn, head, post, *args, use_reentrant=False))
        else:
            parts.append(fn(head, post, *args))
    if not parts:
        return tuple(fn(head, post, hidden, *per_position))
    return tuple(torch.cat(outputs) for outputs in zip(*parts, strict=True))


def _target_logprob(head: Any, post: LogitTransform, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    logits = post(head_logits(head, hidden))
    return (torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1),)


def token_logprobs(head: Any, post: LogitTransform, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each hidden state: float32 LM head, the model's logit post-processing, log-softmax; the
    positions in chunks (`in_chunks`)."""
    return in_chunks(_target_logprob, head, post, hidden, targets)[0]
