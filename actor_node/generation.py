"""Batched generation for `generate` jobs: a decode loop over a KV cache that requests join and leave between steps.

The engine keeps one batch of running responses ("rows"), left-padded in one KV
cache. Each `step()` feeds every row its last sampled token and samples the next;
a row that finishes (end-of-sequence token, a stop string, its token budget, its
deadline) leaves the batch at once and is answered, and requests that arrived
meanwhile join the batch with `add()` (continuous batching): a long response
never holds a short one back, and a new request waits at most one decode step
for a free row (`max_rows`); the actor loop answers one that waited past its
deadline `timeout`.

Prefill: each new prompt runs through the model on its own; a prompt whose
leading tokens the prefix cache holds (the previous turn of a multi-turn task,
or another sample of the same prompt) computes only the rest; several requests
with the same prompt in one `add()` share one prefill. The prompt's KV then joins the batch's cache, left-padded to its length.

What is sampled, and logged (docs/design.md, "Generation: the behaviour policy"):
the logits come from the decoder's last hidden state through the LM head in
float32 (the function the learner recomputes, common.scoring.head_logits);
temperature T divides them; top-p keeps the smallest set of most likely tokens
whose probability reaches p and renormalises over it. The token's log-probability
under that distribution is what the result carries for each token. T = 0 is greedy
decoding: the argmax, logged with log-probability 0 (probability 1) and marked
greedy in the policy stamp.

Weights change only while no row is running (the actor loop drains the batch
first), so every token of a response comes from one policy version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from actor_node.prefix_cache import PrefixCache
from common import scoring
from common.errors import BadInput
from common.kv_cache import cache_kwargs, returned_cache

log = logging.getLogger(__name__)

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

    @classmethod
    def of(cls, sampling: dict[str, Any]) -> SamplingParams:
        return cls(
            max_new_tokens=int(sampling["max_new_tokens"]),
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            stop=tuple(sampling.get("stop", ())),
            seed=sampling.get("seed"),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class _Row:
    job: dict[str, Any]
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    deadline: float  # time.monotonic()
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    length: int = 0  # real tokens in this row's KV (prompt + response fed so far)


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


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """(token, its log-probability under the distribution sampled from): temperature, then top-p renormalised."""
    if params.greedy:
        return int(torch.argmax(logits)), 0.0
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # mass of the tokens above each one
        keep = before < params.top_p  # the most likely token always stays
        kept = torch.full_like(logp, float("-inf"))
        kept[order[keep]] = logp[order[keep]]
        logp = kept - torch.logsumexp(kept, dim=-1)
    probs = logp.exp().cpu()
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise GenerationError(f"the distribution at temperature {params.temperature:g} cannot be sampled (not finite)")
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])


class GenerationEngine:
    """The running batch of one actor: `add` requests, `step` until none runs. Not thread-safe: one compute thread."""

    def __init__(self, model: Any, tokenizer: Any, max_rows: int = 16, prefix_cache_mb: float = 0.0, seed: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.decoder, self.head, self.post = scoring.model_parts(model)
        self.device = next(model.parameters()).device
        self.position_limit = scoring.position_limit(model)
        self.end_ids = end_tokens(model, tokenizer)
        self.cache = PrefixCache(prefix_cache_mb)
        self.seeds = torch.Generator().manual_seed(seed)  # seeds the requests that bring none
        self.rows: list[_Row] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer [rows, heads, width, head_dim], left-padded
        self.width = 0  # KV positions per row (the longest row's length)
        self.tokens_out = 0
        self.steps = 0

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return max(0, self.max_rows - len(self.rows))

    def reset(self) -> None:
        """Drop every running row (after a failure; the caller answers their requests)."""
        self.rows, self.kv, self.width = [], [], 0

    def clear_cache(self) -> None:
        """Forget cached prompt KV (the weights changed)."""
        self.cache.clear()

    # --- joining ---------------------------------------------------------------------------
    def add(self, jobs: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], Generated | Exception]]:
        """Prefill these requests and put them in the batch; what is answered at once (bad input, a
        one-token budget) comes back. Call with at most `free` jobs."""
        answered: list[tuple[dict[str, Any], Generated | Exception]] = []
        new: list[_Row] = []
        now = time.monotonic()
        for job in jobs:
            try:
                row = self._row(job, now)
            except GenerationError as e:
                answered.append((job, e))
                continue
            new.append(row)
        if not new:
            return answered
        with torch.inference_mode():
            first_logits = self._prefill(new)
            for row, logits in zip(new, first_logits):
                try:
                    done: Generated | Exception | None = self._take(row, logits)
                except GenerationError as e:
                    done = e
                if done is not None:
                    answered.append((row.job, done))
                    row.length = -1  # finished at once: never joins
            self._join([r for r in new if r.length >= 0])
        return answered

    def _row(self, job: dict[str, Any], now: float) -> _Row:
        obs = job["obs"]
        params = SamplingParams.of(obs["sampling"])
        prompt_ids = render_prompt(self.tokenizer, obs)
        if self.position_limit is not None and len(prompt_ids) + params.max_new_tokens > self.position_limit:
            raise GenerationError(
                f"the prompt's {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} = "
                f"{len(prompt_ids) + params.max_new_tokens} positions, over the model's limit of {self.position_limit}"
            )
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.seeds))
        # the actor loop stamps when the job arrived (`deadline_at`); without it, from now
        deadline = job.get("deadline_at") or now + max(1, int(job.get("deadline_ms", 60_000))) / 1000
        return _Row(job, prompt_ids, params, torch.Generator().manual_seed(seed), deadline)

    def _prefill(self, rows: list[_Row]) -> list[torch.Tensor]:
        """Each new row's prompt KV (kept on the row as `_kv`) and the logits after its last prompt token."""
        groups: dict[tuple[int, ...], list[_Row]] = {}
        for row in rows:
            groups.setdefault(tuple(row.prompt_ids), []).append(row)
        logits: dict[int, torch.Tensor] = {}
        for ids, members in groups.items():
            hit = self.cache.lookup(ids)
            kv, m = hit if hit is not None else (None, 0)
            hidden, full_kv = self._forward_prompt(ids, kv, m)
            last = self.post(scoring.head_logits(self.head, hidden))
            self.cache.insert(str(members[0].job.get("task_id", "")) or f"anon-{id(members[0])}", ids, full_kv)
            for row in members:
                row._kv = full_kv  # type: ignore[attr-defined]
                row.length = len(ids)
                logits[id(row)] = last
        return [logits[id(row)] for row in rows]

    def _forward_prompt(self, ids: tuple[int, ...], kv: Any, m: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run ids[m:] after the cached KV of ids[:m]; the last hidden state [width] and the whole prompt's KV."""
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in kv]) if kv is not None else DynamicCache()
        rest = torch.tensor([ids[m:]], device=self.device)
        positions = torch.arange(m, len(ids), device=self.device).unsqueeze(0)
        out = self.decoder(input_ids=rest, position_ids=positions, **cache_kwargs(self.decoder, cache))
        layers = [(layer.keys, layer.values) for layer in returned_cache(out).layers]
        return out.last_hidden_state[0, -1], layers

    def _join(self, rows: list[_Row]) -> None:
        """Put prefilled rows into the batch's cache, everything left-padded to the longest row."""
        if not rows:
            return
        width = max([self.width, *(r.length for r in rows)])
        pieces: list[list[torch.Tensor]] = [[], []]
        new_kv = []
        for layer in range(len(rows[0]._kv)):  # type: ignore[attr-defined]
            keys, values = [], []
            if self.rows:
                k, v = self.kv[layer]
                keys.append(_left_pad(k, width))
                values.append(_left_pad(v, width))
            for row in rows:
                k, v = row._kv[layer]  # type: ignore[attr-defined]
                keys.append(_left_pad(k, width))
                values.append(_left_pad(v, width))
            new_kv.append((torch.cat(keys), torch.cat(values)))
        del pieces
        for row in rows:
            del row._kv  # type: ignore[attr-defined]
        self.kv, self.width = new_kv, width
        self.rows.extend(rows)

    # --- decoding --------------------------------------------------------------------------
    def step(self) -> list[tuple[dict[str, Any], Generated | Exception]]:
        """One decode step for every row: feed its last token, sample the next; the rows that finished, answered."""
        from transformers import DynamicCache

        if not self.rows:
            return []
        now = time.monotonic()
        answered: list[tuple[dict[str, Any], Generated | Exception]] = []
        late = [i for i, row in enumerate(self.rows) if now > row.deadline]
        for i in late:
            row = self.rows[i]
            answered.append((row.job, DeadlineExceeded(f"the deadline passed after {len(row.response_ids)} tokens")))
        if late:
            self._keep([i for i in range(len(self.rows)) if i not in set(late)])
            if not self.rows:
                return answered
        with torch.inference_mode():
            n = len(self.rows)
            width = self.width + 1
            mask = torch.zeros(n, width, dtype=torch.long, device=self.device)
            for b, row in enumerate(self.rows):
                mask[b, width - row.length - 1 :] = 1
            tokens = torch.tensor([[row.response_ids[-1]] for row in self.rows], device=self.device)
            positions = torch.tensor([[row.length] for row in self.rows], device=self.device)
            cache = DynamicCache(ddp_cache_data=self.kv)
            out = self.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions, **cache_kwargs(self.decoder, cache))
            self.kv = [(layer.keys, layer.values) for layer in returned_cache(out).layers]
            self.width = width
            logits = self.post(scoring.head_logits(self.head, out.last_hidden_state[:, -1]))
            self.steps += 1
            keep = []
            for b, row in enumerate(self.rows):
                row.length += 1
                try:
                    done: Generated | Exception | None = self._take(row, logits[b])
                except GenerationError as e:  # this row's distribution cannot be sampled: it fails alone
                    done = e
                if done is None:
                    keep.append(b)
                else:
                    answered.append((row.job, done))
            if len(keep) < n:
                self._keep(keep)
        return answered

    def _take(self, row: _Row, logits: torch.Tensor) -> Generated | None:
        """Sample the row's next token; the finished response if this token ends it."""
        token, logprob = sample_token(logits, row.params, row.generator)
        row.response_ids.append(token)
        row.logprobs.append(logprob)
        self.tokens_out += 1
        if token in self.end_ids:
            return self._finish(row, FINISH_EOS)
        if row.params.stop and self._stop_in_tail(row):
            text = self._text(row)
            found = [at for stop in row.params.stop if (at := text.find(stop)) >= 0]
            if found:
                return self._finish(row, FINISH_STOP, text[: min(found)])
        if len(row.response_ids) >= row.params.max_new_tokens:
            return self._finish(row, FINISH_LENGTH)
        return None

    def _stop_in_tail(self, row: _Row) -> bool:
        """Whether a stop string may have just appeared, read from the newest tokens only: decoding the whole
        response at every token would cost O(n^2) over a long response. A hit is confirmed on the whole text."""
        tail = self.tokenizer.decode(row.response_ids[-row.params.stop_window :], skip_special_tokens=True)
        return any(stop in tail for stop in row.params.stop)

    def _text(self, row: _Row) -> str:
        return self.tokenizer.decode(row.response_ids, skip_special_tokens=True)

    def _finish(self, row: _Row, reason: str, text: str | None = None) -> Generated:
        return Generated(
            text=self._text(row) if text is None else text,
            prompt_ids=row.prompt_ids,
            response_ids=row.response_ids,
            logprobs=row.logprobs,
            finish_reason=reason,
            temperature=row.params.temperature,
            top_p=row.params.top_p,
        )

    def _keep(self, indices: list[int]) -> None:
        """Keep these rows only, and trim the cache's left padding the remaining rows no longer need."""
        self.rows = [self.rows[i] for i in indices]
        if not self.rows:
            self.kv, self.width = [], 0
            return
        width = max(row.length for row in self.rows)
        index = torch.tensor(indices, device=self.device)
        self.kv = [(k.index_select(0, index)[:, :, -width:], v.index_select(0, index)[:, :, -width:]) for k, v in self.kv]
        self.width = width

    def stats(self) -> str:
        return f"{self.tokens_out} tokens generated in {self.steps} decode steps; prompt cache {self.cache.stats()}"


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, n, dim] -> [rows, heads, width, dim], zeros before (masked out by the attention mask)."""
    missing = width - t.shape[2]
    if missing == 0:
        return t
    pad = torch.zeros(t.shape[0], t.shape[1], missing, t.shape[3], dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=2)
