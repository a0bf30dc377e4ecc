"""What one generate request is while the engine runs it, and what it becomes: its sampling settings, its row
(prompt, state, tokens so far and their versions), the finished response, and the prompt's rendering.

The engine (actor_node/generation_engine.py) holds the rows; the actor loop (actor_node/worker.py) and the broker link
(actor_node/link.py) read the finished responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from common.errors import BadInput

FINISH_EOS = "eos"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class GenerationError(BadInput):
    """A generate request this model cannot serve (no chat template, a prompt over its context); answered bad_request."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its response was finished; answered timeout."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, as the broker checked them (common.protocol.check_generate)."""

    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0  # 0: off

    @classmethod
    def of(cls, sampling: dict[str, Any]) -> SamplingParams:
        return cls(
            max_new_tokens=int(sampling["max_new_tokens"]),
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            stop=tuple(sampling.get("stop", ())),
            seed=sampling.get("seed"),
            top_k=int(sampling.get("top_k") or 0),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p may drop tokens (sampling sorts the vocabulary only when a row does)."""
        return self.top_p < 1 or self.top_k > 0

    @property
    def stop_window(self) -> int:
        """Response tokens whose text holds any stop string that ends in the newest token: a token decodes
        to at least one byte and a character is at most 4, plus a margin for the slice's ragged start."""
        return 4 * max((len(stop) for stop in self.stop), default=0) + 4


@dataclass
class Generated:
    """One finished response."""

    text: str  # the response as the client reads it: special tokens and the stop string left out
    prompt_ids: list[int]
    response_ids: list[int]  # every sampled token, the end-of-sequence token and a stop string's tokens included
    logprobs: list[float]  # per response token, under the distribution it was sampled from
    finish_reason: str  # eos, stop or length
    temperature: float
    top_p: float
    token_versions: list[int] = field(default_factory=list)  # per response token: the policy version that sampled it

    @property
    def policy_version(self) -> int | None:
        """The oldest version among its tokens (the first token's): a response is as stale as its oldest token."""
        return self.token_versions[0] if self.token_versions else None

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


PREFILL, WAITING, DECODE = "prefill", "waiting", "decode"


@dataclass(eq=False)  # compared and hashed by identity: rows go in sets
class Row:
    job: dict[str, Any]
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    deadline: float  # time.monotonic()
    arrival: int  # the order rows prefill in
    slot: int = -1
    state: str = PREFILL  # prefill: its prompt is being computed; waiting: another row computes it; decode
    filled: int = 0  # positions of this row's KV written (prompt, then every response token fed back)
    leader: Row | None = None  # waiting: the row whose prompt KV it will copy
    first_logits: torch.Tensor | None = None  # the logits after the prompt's last token (shared with later copies)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """The tokens whose KV the row needs before its next decode step: the prompt, and the response but its
        last token (which that step feeds). A row recomputing its KV under new weights prefills all of it."""
        return self.prompt_ids + self.response_ids[:-1] if self.response_ids else self.prompt_ids


def render_prompt(tokenizer: Any, obs: dict[str, Any]) -> list[int]:
    """The prompt's token ids: chat messages through the tokenizer's chat template, or the plain prompt as the tokenizer encodes it."""
    messages = obs.get("messages")
    if messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise GenerationError("`messages` needs a chat template and this model's tokenizer has none; send `prompt` instead")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template's own rule (roles must alternate, no system role, ...)
            raise GenerationError(f"the model's chat template refused these messages: {type(e).__name__}: {e}") from e
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own special tokens
    else:
        ids = tokenizer(obs["prompt"])["input_ids"]
    if not ids:
        raise GenerationError("the prompt has no tokens")
    return list(ids)


def prompt_texts(obs: dict[str, Any]) -> list[str]:
    """A request's prompt, or its messages' text contents (a chat template only adds to them)."""
    messages = obs.get("messages")
    texts = [obs.get("prompt") or ""] if messages is None else [m["content"] for m in messages if isinstance(m, dict)]
    return [text for text in texts if isinstance(text, str)]


def prompt_chars(obs: dict[str, Any]) -> int:
    """The characters other than white space of a request's prompt or messages. White space is left out: a
    word-level tokenizer drops it, so no token covers it."""
    return sum(len("".join(text.split())) for text in prompt_texts(obs))


def end_tokens(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a response: the generation config's eos ids, else the tokenizer's eos."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    for value in eos if isinstance(eos, (list, tuple)) else [eos]:
        if isinstance(value, int):
            ids.add(value)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
