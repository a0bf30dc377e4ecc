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
model's limit is cut, counted in `truncated`: a text pair by the tokenizer's longest-first rule, each
text losing its start (a response keeps its end, where its answer is; `truncation_side` left), a chat
by halving the prompt's text, which keeps its start, until the whole fits.

A text pair is cut here, each text tokenized alone and cut by the tokenizer's longest-first rule
(`longest_first`), its special tokens put around them as the tokenizer puts them (`pair_frame`): the
same tokens as the tokenizer's own truncation of the pair, which pairs every overflowing piece of one
text with every one of the other's (20,000 and 50,000 characters: 4.7 s at 512 tokens, 86 s at 64).

A text too long to matter is cut before it is tokenized (`text_bound`): no token of a BPE that falls
back to bytes covers more characters than its longest spelling, so a text of more than max_length x
that many characters is over the limit whatever its tokens, and only its part that truncation keeps is
tokenized. A 30 MB prompt took 133 s to score (tokenized whole, twice), every other request of the
reward service waiting, only to be cut to 512 tokens. The part kept gives the same score:
- a text pair: the text's end, from the start of a word (a space after a character other than white
  space, where the split rules of GPT-2, Llama 3 and Qwen always split and SentencePiece pieces never
  reach across, so the tokens from there are the whole text's) that leaves at least the bound, looked
  for within the bound again before it. Two cases are not exact: a text whose last word is longer than
  the bound is cut inside it, and when both texts are past the bound and the room for them is odd, the
  odd token goes to the one with more tokens in its kept part, where the tokenizer gives it to the one
  with more in the whole;
- a chat: the prompt's halvings that are still past the bound are skipped, since none of them can fit
  (the halving goes on from the first that may, as it would have), and a response past the bound is
  refused at once, as it would have been after every halving.
Tokenizers without such a bound (WordPiece, Unigram, word-level: one unknown token may cover a word of
any length) are tokenized whole, as before.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.scoring import longest_token_chars
from rewards.functions import RewardError

log = logging.getLogger(__name__)

FORMATS = ("auto", "pair", "chat")
UNBOUNDED_LENGTH = 1_000_000  # tokenizers without a limit say 1e30; the model's positions bound it then
# Steps that keep every character of a text (a space becomes "▁", a character without a token its bytes):
# with only these, white space counts toward the bound too (else only the other characters do).
KEEPING_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD", "Prepend")
KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Split")
WORD_START = re.compile(r" (?=\S)")  # searched in reversed text: a space after a character other than white space


def keeps_white_space(tokenizer: Any) -> bool:
    """Whether every character, white space included, reaches the model as part of some token: the tokenizer's
    normalizer and pre-tokenizer are only steps that keep them (a Replace of one character by another, a Split
    that keeps what it splits on). A WhitespaceSplit, or a Replace of runs by one space, would not."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except (AttributeError, ValueError):
        return False

    def steps(node: Any, key: str) -> list[dict[str, Any]]:
        if node is None:
            return []
        return [step for child in node[key] for step in steps(child, key)] if node.get("type") == "Sequence" else [node]

    def keeps(step: dict[str, Any]) -> bool:
        kind = step.get("type")
        if kind == "Replace":
            pattern = step.get("pattern") or {}
            return len(pattern.get("String") or "") == 1 and len(step.get("content") or "") == 1
        if kind == "Split":
            return step.get("behavior") != "Removed"
        return kind in KEEPING_NORMALIZERS or kind in KEEPING_PRE_TOKENIZERS

    return all(keeps(step) for step in steps(spec.get("normalizer"), "normalizers") + steps(spec.get("pre_tokenizer"), "pretokenizers"))


def counted(text: str, white_space: bool) -> int:
    return len(text) if white_space else len("".join(text.split()))


def head_end(text: str, chars: int, white_space: bool) -> int:
    """The length of a prefix of `text` holding more than `chars` counted characters (any longer one holds more
    too); len(text) + 1 when the whole holds no more."""
    size = chars + 1
    while size < len(text) and counted(text[:size], white_space) <= chars:
        size *= 2
    size = min(size, len(text))
    return size if counted(text[:size], white_space) > chars else len(text) + 1


def tail_start(text: str, chars: int, white_space: bool) -> int:
    """Where a tail of `text` holding more than `chars` counted characters starts; 0 when the whole holds no more."""
    return max(0, len(text) - head_end(text if white_space else text[::-1], chars, white_space))


def pair_frame(tokenizer: Any) -> tuple[list[int], list[int], list[int]] | None:
    """The special tokens `tokenizer` puts around a text pair: before the first text, between the two, after the
    second, read off probe pairs. None when a pair's tokens are not its two texts' own tokens so framed."""

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    frames = set()
    for first, second in (("a", "b"), ("Hello there, 12 friends.", " and\n  345 more")):
        try:
            a, b, both = ids(first), ids(second), list(tokenizer(first, second)["input_ids"])
        except Exception:  # noqa: BLE001 - a tokenizer that takes no pairs this way: its own call is used, and says why
            return None
        added = len(both) - len(a) - len(b)
        found = [
            (tuple(both[:i]), tuple(both[i + len(a) : i + len(a) + m]), tuple(both[i + len(a) + m + len(b) :]))
            for i in range(added + 1)
            for m in range(added - i + 1)
            if both[i : i + len(a)] == a and both[i + len(a) + m : i + len(a) + m + len(b)] == b
        ]
        if not found:
            return None
        frames.add(found[0])
    if len(frames) != 1:
        return None
    before, between, after = frames.pop()
    return list(before), list(between), list(after)


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """How many tokens of two texts of n1 and n2 tokens the tokenizers library's `longest_first` keeps in `room`:
    the shorter whole if it leaves the longer room enough, else half each, the longer (the second on a tie) taking
    the odd one."""
    if n1 + n2 <= room:
        return n1, n2
    short, long = sorted((n1, n2))
    long = short if short > room else max(short, room - short)
    if short + long > room:
        short, long = room // 2, room // 2 + room % 2
    return (long, short) if n1 > n2 else (short, long)


def word_start(text: str, start: int, margin: int) -> int:
    """The last word start (a space after a character other than white space) at or before `start` and within
    `margin` of it; `start - margin` (or 0) when there is none there."""
    low = max(0, start - margin)
    found = WORD_START.search(text[low : start + 1][::-1])
    return start - found.start() if found else low


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
        longest = longest_token_chars(self.tokenizer)
        # more counted characters than this cannot fit in max_length tokens: the bound on what is tokenized
        self.text_bound = self.max_length * longest if longest else None
        self.counts_white_space = keeps_white_space(self.tokenizer)
        # a text pair is truncated here, each text tokenized alone (the module's docstring)
        self.frame = pair_frame(self.tokenizer) if self.format == "pair" else None

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
        return self._chat(prompt, response) if self.format == "chat" else self._pair(prompt, response)

    def _pair(self, prompt: str, response: str) -> list[int]:
        """The tokenizer's text pair, each text cut to its last tokens by the longest-first rule when the two are
        over the limit; a text past `text_bound` is first cut to its end that can matter (the module's docstring)."""
        texts, cut = [prompt, response], False
        if self.text_bound is not None:
            for i, text in enumerate(texts):
                start = tail_start(text, self.text_bound, self.counts_white_space)
                if start:
                    texts[i], cut = text[word_start(text, start, self.text_bound) :], True
        if self.frame is None or not texts[1]:  # a frame not read, or no second text (the tokenizer's single text)
            ids = None if cut else list(self.tokenizer(texts[0], texts[1])["input_ids"])
            if ids is not None and len(ids) <= self.max_length:
                return ids
            self.truncated += 1
            return list(self.tokenizer(texts[0], texts[1], truncation="longest_first", max_length=self.max_length)["input_ids"])
        before, between, after = self.frame
        first, second = (list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
        room = max(0, self.max_length - len(before) - len(between) - len(after))
        if len(first) + len(second) > room:
            self.truncated += 1
            keep_first, keep_second = longest_first(len(first), len(second), room)
            first, second = first[len(first) - keep_first :], second[len(second) - keep_second :]
        return before + first + between + second + after

    def _chat(self, prompt: str, response: str) -> list[int]:
        """The chat template's tokens; over the limit, the prompt's text halved until the whole fits (the template's
        frame must stay whole). A response past `text_bound` is refused, and the prompt's halvings still past it
        are skipped, before anything is tokenized (the module's docstring)."""
        cut = False
        if self.text_bound is not None:
            if head_end(response, self.text_bound, self.counts_white_space) <= len(response):
                raise self._response_too_long()
            keep, too_long = len(prompt), head_end(prompt, self.text_bound, self.counts_white_space)
            while keep >= too_long:
                keep //= 2
            prompt, cut = prompt[:keep], keep < len(prompt)
        ids = self._chat_ids(prompt, response)
        if cut or len(ids) > self.max_length:
            self.truncated += 1
        keep = len(prompt)
        while len(ids) > self.max_length:
            if keep == 0:
                raise self._response_too_long()
            keep //= 2
            ids = self._chat_ids(prompt[:keep], response)
        return ids

    def _response_too_long(self) -> RewardError:
        return RewardError(f"a response alone is longer than the reward model's limit of {self.max_length} tokens")

    def _chat_ids(self, prompt: str, response: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        ids: Any = self.tokenizer.apply_chat_template(messages, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
