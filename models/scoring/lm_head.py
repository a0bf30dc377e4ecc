"""The LM head and what a model's forward does to its output: the decoder and head a path calls directly, the
logits in float32 (the function the actor and the learner both compute them with), and each token's log-probability."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
