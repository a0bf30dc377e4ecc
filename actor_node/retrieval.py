"""Retrieval for `rag_step`: rank documentation chunks and a task's own recent steps, put the best into the prompt.

Before an observation is scored, the actor adds context to its prompt:

1. the task's recent history (`HistoryEntry`: an earlier prompt, the action
   taken, the reward it got), kept by the broker, at most `history_len` entries;
2. a corpus of documents (`*.md`, `*.txt` under `corpus_dir`), cut into windows
   of `chunk_tokens` tokens that overlap by `chunk_overlap` tokens, so a passage
   cut by one window boundary is whole in the neighbouring window.

Both kinds are ranked together by cosine similarity of their embedding to the
embedding of the observation's prompt; the `top_k` best go into the prompt.

The augmented observation is what the policy scores *and* what is recorded for
training, so the learner sees exactly the context the actor saw. That is why
everything here is a deterministic function of (obs, history, corpus,
embedder): the corpus is read in sorted path order, similarities are rounded
to 6 decimals before ranking (so float noise between differently batched
embeddings of one text cannot reorder them), and ties are broken by
(kind, source, position).

The template (`CONTEXT_HEADER`, `SNIPPET_LINE`), appended after the original
prompt, which stays an exact prefix of the new one::

    <original prompt>
    <blank line>
    Retrieved context (most relevant first):
    [doc guide.md#2] <chunk text>
    [history step -3] <earlier prompt>
    Action: <action taken>
    Reward: <reward>

A blank line separates prompt and block: one newline is added if the prompt
already ends with one, two otherwise. `[doc SOURCE#I]` is chunk I (from 0) of
the file SOURCE (path relative to `corpus_dir`); `[history step -N]` is the
task's N-th most recent step. The block (separator, header and lines) is kept
within `max_context_tokens` tokens of the policy's tokenizer: snippets go in
by rank; the first one that does not fit is cut to the room left if at least
`MIN_SNIPPET_TOKENS` tokens remain (a document keeps its head, a history entry
its tail, where the action and reward are), and the rest are left out.

Nothing here touches sockets, Redis or a model: the embedders that run a model are in
actor_node/embedders.py, and actor_node/rag.py wires both to jobs. The settings are
`RetrievalConfig` (common/shared_settings.py), the [retrieval] table the broker reads too.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from common.shared_settings import RetrievalConfig

log = logging.getLogger(__name__)

CONTEXT_HEADER = "Retrieved context (most relevant first):\n"
SNIPPET_LINE = "[{kind} {label}] {text}\n"
HISTORY_TEXT = "{prompt}\nAction: {action}\nReward: {reward:g}"
MIN_SNIPPET_TOKENS = 16  # a cut snippet shorter than this is more noise than context
CORPUS_SUFFIXES = (".md", ".txt")
SCORE_DECIMALS = 6


# --- corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    source: str  # path relative to the corpus folder, with forward slashes
    index: int  # position of the chunk in its file, from 0
    text: str


def chunk_text(text: str, tokenizer: Any, chunk_tokens: int, overlap: int) -> list[str]:
    """Windows of `chunk_tokens` tokens, each starting `chunk_tokens - overlap` after the previous one,
    decoded back to text. Together they cover every token; the last window ends at the last token."""
    if chunk_tokens <= 0 or not 0 <= overlap < chunk_tokens:
        raise ValueError(f"need 0 <= overlap < chunk_tokens, got overlap={overlap}, chunk_tokens={chunk_tokens}")
    if not text:
        return []
    ids = tokenizer.encode(text, add_special_tokens=False)
    stride = chunk_tokens - overlap
    # A window starting at or past len(ids) - overlap would hold only tokens the previous one already has.
    return [tokenizer.decode(ids[start : start + chunk_tokens]) for start in range(0, max(len(ids) - overlap, 1), stride)]


def load_corpus(folder: str | Path, tokenizer: Any, chunk_tokens: int, overlap: int) -> list[Chunk]:
    """Every .md and .txt file under `folder` (recursively), chunked, in sorted relative-path order.

    Sorted, because chunk order decides ties and so the augmented prompts; a corpus
    that is missing or empty is a configuration mistake, reported at start-up.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"corpus folder {str(root)!r} does not exist or is not a folder")
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES), key=lambda p: p.relative_to(root).as_posix()
    )
    chunks: list[Chunk] = []
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"corpus file {str(path)!r} is not UTF-8 text: {e}") from e
        if not text.strip():
            log.warning("corpus file %s is empty; skipped", path)
            continue
        source = path.relative_to(root).as_posix()
        chunks += [Chunk(source, i, t) for i, t in enumerate(chunk_text(text, tokenizer, chunk_tokens, overlap))]
    if not chunks:
        raise ValueError(f"corpus folder {str(root)!r} holds no non-empty {' or '.join(CORPUS_SUFFIXES)} files")
    log.info("corpus %s: %d files, %d chunks of %d tokens (overlap %d)", root, len(files), len(chunks), chunk_tokens, overlap)
    return chunks


# --- embedders ------------------------------------------------------------------------------


class Embedder(Protocol):
    def __call__(self, texts: list[str]) -> torch.Tensor:
        """(len(texts), d) float32 on CPU, rows of unit L2 norm (zero for an empty text)."""
        ...


class EmbeddingCache:
    """Remembers the vectors of recent texts (keyed by their sha256), least recently used out first.

    A task's history is re-ranked at every step, and so are the same few entries
    again and again; only new texts cost a forward. A text of a call is a hit if
    its vector is cached or appeared earlier in the same call, otherwise a miss;
    all misses of a call are embedded in one call of the wrapped embedder.
    """

    def __init__(self, embedder: Embedder, max_entries: int = 10000) -> None:
        if max_entries <= 0:
            raise ValueError(f"`max_entries` must be positive, got {max_entries}")
        self.embedder = embedder
        self.max_entries = max_entries
        self.entries: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def __call__(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            return self.embedder([])
        keys = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in texts]
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, str] = {}  # key -> text, first appearance order
        for key, text in zip(keys, texts):
            if key in found or key in missing:
                self.hits += 1
            elif key in self.entries:
                self.entries.move_to_end(key)
                found[key] = self.entries[key]
                self.hits += 1
            else:
                missing[key] = text
                self.misses += 1
        if missing:
            vectors = self.embedder(list(missing.values()))
            for key, vec in zip(missing, vectors):
                found[key] = vec.clone()
                self.entries[key] = found[key]
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return torch.stack([found[k] for k in keys])


# --- ranking --------------------------------------------------------------------------------


def _quantise(score: float) -> float:
    """Similarity rounded so that float noise cannot reorder equal texts (see the module docstring)."""
    return round(float(score), SCORE_DECIMALS) + 0.0  # + 0.0 turns -0.0 into 0.0


class CorpusIndex:
    """The corpus chunks and their embeddings, (n, d), built once at start-up and searched per step."""

    def __init__(self, chunks: Sequence[Chunk], matrix: torch.Tensor) -> None:
        if matrix.dim() != 2 or matrix.shape[0] != len(chunks):
            raise ValueError(f"need one embedding row per chunk: {len(chunks)} chunks, matrix {tuple(matrix.shape)}")
        order = sorted(range(len(chunks)), key=lambda i: (chunks[i].source, chunks[i].index))
        # Chunks in (source, index) order, so a stable sort on score breaks ties in that order.
        self.chunks = [chunks[i] for i in order]
        self.matrix = matrix.float().cpu()[order]

    @classmethod
    def build(cls, chunks: Sequence[Chunk], embedder: Embedder) -> CorpusIndex:
        if not chunks:
            raise ValueError("cannot build a corpus index from no chunks")
        return cls(chunks, embedder([c.text for c in chunks]))

    def __len__(self) -> int:
        return len(self.chunks)

    def search(self, query_vec: torch.Tensor, k: int) -> list[tuple[float, Chunk]]:
        """The k chunks most similar to `query_vec` (a unit vector of the index's width), best first."""
        q = query_vec.float().cpu().reshape(-1)
        if q.shape[0] != self.matrix.shape[1]:
            raise ValueError(f"query has {q.shape[0]} dimensions, the index {self.matrix.shape[1]}")
        scores = torch.round(self.matrix @ q, decimals=SCORE_DECIMALS)
        order = torch.sort(scores, descending=True, stable=True).indices[:k]
        return [(_quantise(scores[i].item()), self.chunks[i]) for i in order.tolist()]


@dataclass
class HistoryEntry:
    """One earlier step of a task: the prompt it saw, the action it took, the reward it got."""

    prompt: str
    action: str
    reward: float

    def text(self) -> str:
        """What is embedded and shown in the prompt (HISTORY_TEXT)."""
        return HISTORY_TEXT.format(prompt=self.prompt, action=self.action, reward=self.reward)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "action": self.action, "reward": float(self.reward)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HistoryEntry:
        """From the wire (msgpack): types are checked, since it comes over the network; unknown keys are ignored."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a history entry must be a map, got {type(d).__name__}")
        for key in ("prompt", "action"):
            if not isinstance(d.get(key), str):
                raise ValueError(f"history entry `{key}` must be a string, got {type(d.get(key)).__name__}")
        reward = d.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"history entry `reward` must be a finite number, got {reward!r}")
        return cls(d["prompt"], d["action"], float(reward))


@dataclass(frozen=True)
class Snippet:
    kind: str  # "doc" or "history"
    label: str  # "guide.md#2" (chunk 2 of guide.md) or "step -3" (third most recent step)
    text: str
    score: float  # cosine similarity to the query, rounded to SCORE_DECIMALS


def query_texts(obs: Mapping[str, Any], history: Sequence[HistoryEntry], cfg: RetrievalConfig) -> list[str]:
    """The texts retrieval embeds for `obs`: its prompt's tail, then each history entry's prompt tail."""
    return [obs["prompt"][-cfg.query_chars :]] + [h.prompt[-cfg.query_chars :] for h in history]


def retrieve(
    obs: Mapping[str, Any], history: Sequence[HistoryEntry], index: CorpusIndex | None, embedder: Embedder, cfg: RetrievalConfig
) -> list[Snippet]:
    """The cfg.top_k snippets (corpus chunks and history entries together) most similar to obs["prompt"], best first.

    Only the last cfg.history_len history entries (oldest first, as kept) count.
    Ties go to documents before history, then to (source, index) for documents and
    to the more recent step for history.
    """
    query = obs.get("prompt") if isinstance(obs, Mapping) else None
    if not isinstance(query, str):
        raise ValueError(f"obs `prompt` must be a string, got {type(query).__name__}")
    recent = list(history)[-cfg.history_len :] if cfg.history_len else []
    # A history entry is ranked by its screen (its prompt), like the query; what it shows adds the action and reward.
    vectors = embedder(query_texts(obs, recent, cfg))  # one call: the cache batches the misses
    q = vectors[0]
    ranked: list[tuple[tuple[float, str, str, int], Snippet]] = []
    if index is not None:
        for score, chunk in index.search(q, cfg.top_k):
            snippet = Snippet("doc", f"{chunk.source}#{chunk.index}", chunk.text, score)
            ranked.append(((-score, "doc", chunk.source, chunk.index), snippet))
    if recent:
        scores = torch.round(vectors[1:].float() @ q.float(), decimals=SCORE_DECIMALS).tolist()
        for i, (entry, score) in enumerate(zip(recent, scores)):
            back = len(recent) - i  # 1: the most recent step
            s = _quantise(score)
            ranked.append(((-s, "history", "", back), Snippet("history", f"step -{back}", entry.text(), s)))
    ranked.sort(key=lambda r: r[0])
    return [snippet for _, snippet in ranked[: cfg.top_k]]


# --- the prompt -----------------------------------------------------------------------------


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _cut(tokenizer: Any, text: str, n_tokens: int, keep_tail: bool) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids[-n_tokens:] if keep_tail else ids[:n_tokens]) if n_tokens > 0 else ""


def augment(obs: Mapping[str, Any], snippets: Sequence[Snippet], tokenizer: Any, max_context_tokens: int) -> dict[str, Any]:
    """A new observation whose prompt is obs["prompt"] followed by the context block (see augment_counted)."""
    return augment_counted(obs, snippets, tokenizer, max_context_tokens)[0]


def augment_counted(
    obs: Mapping[str, Any], snippets: Sequence[Snippet], tokenizer: Any, max_context_tokens: int
) -> tuple[dict[str, Any], int]:
    """A new observation whose prompt is obs["prompt"] followed by the context block (module docstring),
    and how many of `snippets` (the first ones) went into it.

    The block's token count is measured on the block itself, whole, after every
    addition, since a BPE tokenizer may merge tokens across the join of two pieces.
    Every key other than "prompt" is copied unchanged; `obs` itself is not modified.
    """
    out = copy.deepcopy(dict(obs))
    prompt = out.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"obs `prompt` must be a string, got {type(prompt).__name__}")
    block = ("\n" if prompt.endswith("\n") else "\n\n") + CONTEXT_HEADER
    used = 0
    for snip in snippets:
        text = snip.text.strip()
        line = SNIPPET_LINE.format(kind=snip.kind, label=snip.label, text=text)
        if _count(tokenizer, block + line) <= max_context_tokens:
            block += line
            used += 1
            continue
        # Does not fit whole: cut it to the room left, if that room is worth it, and stop there.
        frame = _count(tokenizer, block + SNIPPET_LINE.format(kind=snip.kind, label=snip.label, text=""))
        room = min(max_context_tokens - frame, _count(tokenizer, text))
        while room >= MIN_SNIPPET_TOKENS:
            line = SNIPPET_LINE.format(kind=snip.kind, label=snip.label, text=_cut(tokenizer, text, room, keep_tail=snip.kind == "history"))
            if _count(tokenizer, block + line) <= max_context_tokens:
                block += line
                used += 1
                break
            room -= 1
        break
    if used == 0:
        return out, 0
    out["prompt"] = prompt + block
    return out, used
