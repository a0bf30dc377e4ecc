"""The next token of each running row: the rows' sampling settings as one tensor, the tokens sampled at once, and what
a sampled token does to its row (appended with its log-probability and version; the response finished when the token
ends it: an end token, a stop string, or the length budget).

The engine (actor_node/generation_engine.py) calls these for the rows of a step; the sampling itself is
actor_node/sampling.py.
"""

from __future__ import annotations

from typing import Any

import torch

from actor_node import sampling
from actor_node.responses import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Generated, Row


def sampling_settings(rows: list[Row]) -> torch.Tensor:
    """[4, len(rows)] float64 on the host: each row's temperature, top_p, top_k and the uniform number of its
    next token (INPUTS' last four)."""
    uniforms = sampling.row_uniforms(torch.tensor([r.seed for r in rows]), torch.tensor([len(r.response_ids) for r in rows]))
    params = torch.tensor([[r.params.temperature, r.params.top_p, r.params.top_k] for r in rows], dtype=torch.float64)
    return torch.cat([params.T, uniforms[None]])


def sample_next(logits: torch.Tensor, settings: torch.Tensor, filters: list[bool]) -> list[tuple[float, float, float]]:
    """(token, log-probability, failed) of each row, sampled at once from their `logits` and `settings` ([4, rows]:
    temperature, top_p, top_k, uniform), on the host."""
    temperature, top_p, top_k, uniforms = settings
    tokens, logprobs, failed = sampling.sample(logits.float(), temperature, top_p, top_k.long(), uniforms, any_filtered=any(filters))
    # one device-to-host copy for all three (float64 holds every token id and float32 log-prob exactly)
    host = torch.stack([tokens.double(), logprobs.double(), failed.double()]).cpu()
    return list(zip(*host.tolist()))


def take_token(row: Row, token: int, logprob: float, version: int, end_ids: set[int], tokenizer: Any) -> Generated | None:
    """Append the row's next token (sampled by weights of `version`); the finished response if this token ends it."""
    row.response_ids.append(token)
    row.logprobs.append(logprob)
    row.token_versions.append(version)
    if token in end_ids:
        return _finish(row, tokenizer, FINISH_EOS)
    if row.params.stop and _stop_in_tail(row, tokenizer):
        text = _text(row, tokenizer)
        found = [at for stop in row.params.stop if (at := text.find(stop)) >= 0]
        if found:
            return _finish(row, tokenizer, FINISH_STOP, text[: min(found)])
    if len(row.response_ids) >= row.params.max_new_tokens:
        return _finish(row, tokenizer, FINISH_LENGTH)
    return None


def _stop_in_tail(row: Row, tokenizer: Any) -> bool:
    """Whether a stop string may have just appeared, read from the newest tokens only: decoding the whole
    response at every token would cost O(n^2) over a long response. A hit is confirmed on the whole text."""
    tail = tokenizer.decode(row.response_ids[-row.params.stop_window :], skip_special_tokens=True)
    return any(stop in tail for stop in row.params.stop)


def _text(row: Row, tokenizer: Any) -> str:
    return tokenizer.decode(row.response_ids, skip_special_tokens=True)


def _finish(row: Row, tokenizer: Any, reason: str, text: str | None = None) -> Generated:
    return Generated(
        text=_text(row, tokenizer) if text is None else text,
        prompt_ids=row.prompt_ids,
        response_ids=row.response_ids,
        logprobs=row.logprobs,
        finish_reason=reason,
        temperature=row.params.temperature,
        top_p=row.params.top_p,
        token_versions=row.token_versions,
    )
