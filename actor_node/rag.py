"""rag_step at the actor: augment an observation with retrieved context before it is scored.

The math (chunking, embedding, ranking, the prompt template) is in
actor_node/retrieval.py; this module wires it to jobs. The corpus index is built
once, at start; embeddings of history entries and queries are cached by text, so
a task's history, which changes by one entry a step, costs one new embedding per
step. Retrieval runs in the actor's compute thread, between weight swaps and
scoring, because the default embedder briefly disables the LoRA adapter.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from actor_node.embedders import EncoderEmbedder, PolicyEmbedder
from actor_node.retrieval import CorpusIndex, EmbeddingCache, HistoryEntry, augment_counted, load_corpus, query_texts, retrieve
from common import protocol as p
from common.errors import BadInput
from common.shared_settings import RetrievalConfig

log = logging.getLogger(__name__)


class RetrievalError(BadInput):
    """A rag_step job this actor cannot augment (malformed history): the client gets `bad_request`."""


class Retriever:
    """Augments rag_step jobs: the task's history (sent by the broker) and the corpus, within a token budget."""

    def __init__(self, cfg: RetrievalConfig, model: Any, tokenizer: Any, device: str = "cpu") -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._model = model
        self._base: Any = None  # the policy embedder is made on first use: an actor no client sends rag_step to pays nothing
        if cfg.embedder:  # a separate encoder is loaded now, so a bad path stops the actor at start
            self._base = EncoderEmbedder(cfg.embedder, device=device, batch=cfg.embed_batch)
        self.embedder = EmbeddingCache(self._embed)
        self.index: CorpusIndex | None = None
        if cfg.corpus_dir:
            started = time.perf_counter()
            chunks = load_corpus(cfg.corpus_dir, tokenizer, cfg.chunk_tokens, cfg.chunk_overlap)
            self.index = CorpusIndex.build(chunks, self._embed)  # chunks are embedded once, here; not kept in the cache
            log.info(
                "rag corpus %s: %d chunks from %d files indexed in %.1f s",
                cfg.corpus_dir,
                len(chunks),
                len({c.source for c in chunks}),
                time.perf_counter() - started,
            )
        self.jobs = 0
        self.seconds = 0.0

    def _embed(self, texts: list[str]) -> Any:
        if self._base is None:
            if hasattr(self._model, "peft_config"):  # LoRA: the base weights never change, the adapter is switched off
                self._base = PolicyEmbedder(self._model, self.tokenizer, batch=self.cfg.embed_batch)
            else:
                # No adapter: the learner trains every weight and the actor swaps them in, which would move
                # embeddings away from the corpus index built at start. Embed with a frozen copy instead.
                log.info("rag: embedding with a frozen copy of the model (no LoRA adapter to switch off)")
                self._base = PolicyEmbedder(copy.deepcopy(self._model).eval(), self.tokenizer, batch=self.cfg.embed_batch)
        return self._base(texts)

    def augment_job(self, job: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The augmented observation of a rag_step job and the labels of what was put in, best first."""
        started = time.perf_counter()
        raw = job.get("history", [])
        if not isinstance(raw, list):
            raise RetrievalError("`history` must be an array of {prompt, action, reward} maps")
        try:
            history = [HistoryEntry.from_dict(entry) for entry in raw]
        except (ValueError, TypeError, AttributeError) as e:
            raise RetrievalError(f"bad history entry: {e}") from e
        try:
            snippets = retrieve(job["obs"], history, self.index, self.embedder, self.cfg)
            obs, n_used = augment_counted(job["obs"], snippets, self.tokenizer, self.cfg.max_context_tokens)
        except ValueError as e:  # a malformed observation (the broker checks them; another client of the actor may not)
            raise RetrievalError(str(e)) from e
        used = [f"{s.kind} {s.label}" for s in snippets[:n_used]]
        self.jobs += 1
        self.seconds += time.perf_counter() - started
        return obs, used

    def augment_batch(self, jobs: list[dict[str, Any]]) -> dict[int, Exception]:
        """Augment the rag_step jobs of a batch in place (obs replaced; `context`, the text appended to the
        prompt, and `retrieved` added); failures by position."""
        failed: dict[int, Exception] = {}
        rag_jobs = [job for job in jobs if job.get("mode") == p.OP_RAG_STEP]
        queries = [
            query_texts(job["obs"], [], self.cfg)[0]
            for job in rag_jobs
            if isinstance(job.get("obs"), dict) and isinstance(job["obs"].get("prompt"), str)
        ]
        if queries:
            try:
                self.embedder(queries)  # the batch's new prompts in one forward; each job's retrieval then finds them cached
            except Exception:  # noqa: BLE001 - out of memory, say: each job embeds its own query below, failing alone
                log.exception("embedding the queries of %d rag_step jobs together failed", len(queries))
        for i, job in enumerate(jobs):
            if job.get("mode") != p.OP_RAG_STEP:
                continue
            try:
                raw_prompt = job["obs"]["prompt"]
                job["obs"], job["retrieved"] = self.augment_job(job)
                job["context"] = job["obs"]["prompt"][len(raw_prompt) :]
            except Exception as e:  # one bad job fails alone
                failed[i] = e
        return failed

    def stats(self) -> dict[str, float]:
        return {
            "jobs": self.jobs,
            "ms_per_job": 1000 * self.seconds / max(self.jobs, 1),
            "cache_hits": self.embedder.hits,
            "cache_misses": self.embedder.misses,
        }
