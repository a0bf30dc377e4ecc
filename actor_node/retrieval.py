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

Nothing here touches sockets or Redis; the actor wires it in.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch

from common import scoring

log = logging.getLogger(__name__)

CONTEXT_HEADER = "Retrieved context (most relevant first):\n"
SNIPPET_LINE = "[{kind} {label}] {text}\n"
HISTORY_TEXT = "{prompt}\nAction: {action}\nReward: {reward:g}"
MIN_SNIPPET_TOKENS = 16  # a cut snippet shorter than this is more noise than context
CORPUS_SUFFIXES = (".md", ".txt")
SCORE_DECIMALS = 6


@dataclass(frozen=True)
class RetrievalConfig:
    corpus_dir: str = ""
    """Folder of .md/.txt documents to retrieve from (searched recursively); empty: history only."""
    chunk_tokens: int = 128
    """Length of one corpus chunk, in tokens of the policy's tokenizer."""
    chunk_overlap: int = 32
    """Tokens shared by consecutive chunks, so a passage cut by one boundary is whole in the next chunk."""
    top_k: int = 4
    """Most snippets (documents and history together) put into the prompt."""
    max_context_tokens: int = 256
    """Most tokens the whole added block (header and snippets) may take."""
    history_len: int = 16
    """Recent steps the broker keeps per task and retrieval considers (0: no history)."""
    embed_batch: int = 16
    """Texts per embedding forward."""
    query_chars: int = 2000
    """What is embedded: the last `query_chars` characters of the current prompt, and of each history entry's
    prompt. Equal to the broker's `rag_history_chars`, a history entry is embedded with exactly the text the
    query of its own step was, so the embedding cache already holds it: one new embedding per step, not two."""

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"`chunk_tokens` must be positive, got {self.chunk_tokens}")
        if not 0 <= self.chunk_overlap < self.chunk_tokens:
            raise ValueError(f"`chunk_overlap` must be at least 0 and less than `chunk_tokens` ({self.chunk_tokens}), "
                             f"got {self.chunk_overlap}")  # fmt: skip
        if self.top_k < 1:
            raise ValueError(f"`top_k` must be at least 1, got {self.top_k}")
        if self.max_context_tokens <= 0:
            raise ValueError(f"`max_context_tokens` must be positive, got {self.max_context_tokens}")
        if self.history_len < 0:
            raise ValueError(f"`history_len` must be 0 or more, got {self.history_len}")
        if self.embed_batch <= 0:
            raise ValueError(f"`embed_batch` must be positive, got {self.embed_batch}")
        if self.query_chars <= 0:
            raise ValueError(f"`query_chars` must be positive, got {self.query_chars}")


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
    files = sorted((p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES),
                   key=lambda p: p.relative_to(root).as_posix())  # fmt: skip
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
    log.info("corpus %s: %d files, %d chunks of %d tokens (overlap %d)", root, len(files), len(chunks), chunk_tokens,
             overlap)  # fmt: skip
    return chunks


# --- embedders ------------------------------------------------------------------------------


class Embedder(Protocol):
    def __call__(self, texts: list[str]) -> torch.Tensor:
        """(len(texts), d) float32 on CPU, rows of unit L2 norm (zero for an empty text)."""
        ...


def _pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), padded at the end. Right padding keeps every text's tokens at positions
    0..n-1 whatever the batch, so a causal model gives each text the same states alone or batched."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the states of real (mask 1) tokens, in float32 (a bf16 sum over hundreds of tokens loses digits)."""
    m = mask.to(hidden.device, torch.float32).unsqueeze(-1)
    summed = (hidden.float() * m).sum(1)
    return summed / m.sum(1).clamp(min=1.0)


def _normalise(vectors: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vectors.float(), dim=-1).cpu()


def _hidden_size(model: Any) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    return int(size) if size else int(model.get_input_embeddings().embedding_dim)


class PolicyEmbedder:
    """Embeddings from the policy's own base model: mean of the last hidden states, LoRA adapter off.

    The adapter is off so that embeddings do not drift as the policy trains: the
    corpus index is built once, and a query embedded with newer weights would no
    longer be comparable with it. (Without an adapter, lora_rank 0, the learner
    trains the model's own weights, which the actor swaps in: actor_node/rag.py
    then embeds with a frozen copy of the model.) Disabling the adapter changes the model's state
    for the duration of the call, so call this from the thread that scores (the
    actor's compute thread), never beside a running forward.

    A text longer than `max_tokens` keeps its last tokens: prompts grow by
    appending, and the current screen is at their end.
    """

    def __init__(self, model: Any, tokenizer: Any, max_tokens: int = 512, batch: int = 16) -> None:
        if max_tokens < 2:
            raise ValueError(f"`max_tokens` must be at least 2, got {max_tokens}")
        if batch <= 0:
            raise ValueError(f"`batch` must be positive, got {batch}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.batch = batch
        self.dim = _hidden_size(model)
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0  # any id will do: padded positions are masked and come last

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.bos + ids[-(self.max_tokens - len(self.bos)) :]

    def __call__(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros((len(texts), self.dim), dtype=torch.float32)
        rows = [(i, self._ids(t)) for i, t in enumerate(texts)]
        # Longest first: texts of similar length share a batch, so little of it is padding.
        rows = sorted((r for r in rows if r[1]), key=lambda r: -len(r[1]))
        if not rows:
            return out
        device = next(self.model.parameters()).device
        adapter_off = self.model.disable_adapter() if hasattr(self.model, "peft_config") else contextlib.nullcontext()
        decoder = scoring._parts(self.model)[0]
        with adapter_off, torch.inference_mode():
            for b in range(0, len(rows), self.batch):
                part = rows[b : b + self.batch]
                ids, mask = _pad_right([r[1] for r in part], self.pad_id)
                # The decoder alone: its final-normed hidden states, without the LM head's vocabulary-wide logits.
                hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
                pooled = _normalise(_mean_pool(hidden, mask))
                out[[r[0] for r in part]] = pooled
        return out


class EncoderEmbedder:
    """A sentence-transformers-style encoder (e.g. all-MiniLM-L6-v2) from a local folder or hub id, mean pooled.

    Loaded with plain transformers (AutoModel + AutoTokenizer), so there is no
    sentence-transformers dependency; mean pooling and L2 normalisation are what
    those models were trained with. A text longer than `max_tokens` keeps its head
    (the encoder tokenizer's own truncation).
    """

    def __init__(self, path: str, device: str = "cpu", max_tokens: int = 512, batch: int = 16) -> None:
        from transformers import AutoModel, AutoTokenizer

        if batch <= 0:
            raise ValueError(f"`batch` must be positive, got {batch}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:  # padding is needed to batch; padded positions are masked anyway
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.batch = batch
        self.dim = _hidden_size(self.model)
        log.info("encoder embedder %s on %s (%d dimensions)", path, device, self.dim)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros((len(texts), self.dim), dtype=torch.float32)
        rows = [i for i, t in enumerate(texts) if t]
        with torch.inference_mode():
            for b in range(0, len(rows), self.batch):
                part = rows[b : b + self.batch]
                enc = self.tokenizer([texts[i] for i in part], padding=True, truncation=True, max_length=self.max_tokens,
                                     return_tensors="pt")  # fmt: skip
                hidden = self.model(**{k: v.to(self.device) for k, v in enc.items()}).last_hidden_state
                out[part] = _normalise(_mean_pool(hidden, enc["attention_mask"]))
        return out


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
        return [(_quantise(scores[i]), self.chunks[i]) for i in order.tolist()]


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


def retrieve(obs: Mapping[str, Any], history: Sequence[HistoryEntry], index: CorpusIndex | None, embedder: Embedder,
             cfg: RetrievalConfig) -> list[Snippet]:  # fmt: skip
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


def augment_counted(obs: Mapping[str, Any], snippets: Sequence[Snippet], tokenizer: Any,
                    max_context_tokens: int) -> tuple[dict[str, Any], int]:  # fmt: skip
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
            line = SNIPPET_LINE.format(kind=snip.kind, label=snip.label,
                                       text=_cut(tokenizer, text, room, keep_tail=snip.kind == "history"))  # fmt: skip
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
