"""A local reward model: any `AutoModelForSequenceClassification` scoring (prompt, response) pairs.

Two ways to show it a pair, as reward models are trained:
- `pair`: the tokenizer's text pair, `tokenizer(prompt, response)` (an encoder such as OpenAssistant's
  DeBERTa reward models reads `[CLS] prompt [SEP] response [SEP]`);
- `chat`: the tokenizer's chat template over `[user: prompt, assistant: response]` (decoder reward
  models such as Skywork's, which pool the last token).
`auto` picks `chat` when the tokenizer has a chat template, else `pair`.

The reward is the model's logit for `label_index` (0, the only one, for a one-label reward head).
Pairs are scored in batches on the model's own device; a batch is padded, and an item's score does
not depend on the others in its batch (tested against one-at-a-time scoring). A pair longer than the
model's limit is cut, counted in `truncated`: a text pair by the tokenizer's longest-first rule, the
longer text losing its start (a response keeps its end, where its answer is), a chat by shortening
the prompt's text until the whole fits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rewards.functions import RewardError

log = logging.getLogger(__name__)

FORMATS = ("auto", "pair", "chat")
UNBOUNDED_LENGTH = 1_000_000  # tokenizers without a limit say 1e30; the model's positions bound it then


@dataclass(frozen=True)
class RewardModelConfig:
    path: str
    device: str = "cpu"
    batch_size: int = 8
    format: str = "auto"
    label_index: int = 0
    max_length: int = 0  # 0: the model's own limit
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("a reward model needs a path (a directory from save_pretrained)")
        if self.batch_size < 1:
            raise ValueError(f"reward model `batch_size` must be >= 1, got {self.batch_size}")
        if self.format not in FORMATS:
            raise ValueError(f"reward model `format` must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.label_index < 0 or self.max_length < 0:
            raise ValueError("reward model `label_index` and `max_length` must be >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward model `dtype` must be float32, bfloat16 or float16, got {self.dtype!r}")


class RewardModel:
    """Loads the model once; `score(pairs)` returns one float per (prompt, response)."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
            self.model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=getattr(torch, cfg.dtype))
        except (OSError, ValueError) as e:
            raise RewardError(f"reward model {cfg.path!r} cannot be loaded as a sequence classifier: {e}") from e
        self.model.to(cfg.device).eval()
        labels = int(self.model.config.num_labels)
        if cfg.label_index >= labels:
            raise RewardError(f"reward model {cfg.path!r} has {labels} labels; `label_index` {cfg.label_index} is not one")
        if self.tokenizer.pad_token_id is None:  # a decoder reward model pools the last non-pad token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # a cut text loses its start: a response keeps its end, where the answer is
        self.format = cfg.format
        if self.format == "auto":
            self.format = "chat" if getattr(self.tokenizer, "chat_template", None) else "pair"
        if self.format == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise RewardError(f"reward model {cfg.path!r}: format `chat` needs a tokenizer with a chat template; it has none")
        self.max_length = cfg.max_length or self._model_limit()
        self.truncated = 0

    def _model_limit(self) -> int:
        limits = [int(self.tokenizer.model_max_length)]
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions:
            limits.append(int(positions))
        return min(min(limits), UNBOUNDED_LENGTH)

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(pairs), self.cfg.batch_size):
            out += self._score_batch(pairs[start : start + self.cfg.batch_size])
        return out

    def _score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        rows = [self._encode(prompt, response) for prompt, response in pairs]
        width = max(len(r) for r in rows)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.cfg.device), attention_mask=mask.to(self.cfg.device)).logits
        return [float(x) for x in logits[:, self.cfg.label_index].float().cpu()]

    def _encode(self, prompt: str, response: str) -> list[int]:
        if self.format == "chat":
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            ids: Any = self.tokenizer.apply_chat_template(messages, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = list(self.tokenizer(prompt, response)["input_ids"])
        if len(ids) <= self.max_length:
            return ids
        self.truncated += 1
        return self._truncated(prompt, response)

    def _truncated(self, prompt: str, response: str) -> list[int]:
        """Over the limit: as much of the prompt's start as fits beside the response's end."""
        if self.format == "chat":  # the template's frame must stay whole: cut the prompt text until it fits
            keep = len(prompt)
            while keep > 0:
                keep //= 2
                messages = [{"role": "user", "content": prompt[:keep]}, {"role": "assistant", "content": response}]
                ids: Any = self.tokenizer.apply_chat_template(messages, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                if len(ids) <= self.max_length:
                    return ids
            raise RewardError(f"a response alone is longer than the reward model's limit of {self.max_length} tokens")
        encoded = self.tokenizer(prompt, response, truncation="longest_first", max_length=self.max_length)
        return list(encoded["input_ids"])
