"""An observation as token ids: the single place where text becomes tokens, for actor and learner alike, and the
length checks against the model's position limit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.errors import BadInput


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
