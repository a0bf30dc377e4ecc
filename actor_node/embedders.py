"""Embedders for rag_step's retrieval: the policy's own base model, or a separate local encoder.

Both map texts to unit-norm float32 rows on the CPU (the `Embedder` protocol of
actor_node/retrieval.py). They run a model, so they live apart from the pure
ranking and templating; actor_node/rag.py chooses one.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from models import scoring

log = logging.getLogger(__name__)


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
        decoder = scoring.model_parts(self.model)[0]
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
                enc = self.tokenizer(
                    [texts[i] for i in part], padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
                )
                hidden = self.model(**{k: v.to(self.device) for k, v in enc.items()}).last_hidden_state
                out[part] = _normalise(_mean_pool(hidden, enc["attention_mask"]))
        return out
