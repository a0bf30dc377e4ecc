"""Batched generation for `generate` jobs: continuous batching over a KV cache allocated once.

The engine keeps one batch of responses ("rows"). Row i owns slot i of a
preallocated KV cache (actor_node/kv_slots.py): each forward writes every row's new
keys and values in place at the row's own positions, and a row that finishes frees
its slot at once (the last row moves into a freed slot, copying only its own KV, so
the running rows stay in slots 0..n-1). A long response never holds a short one
back, and a request waits at most one step for a free row (`max_rows`).

Each `step()` is at most one prefill forward, then one decode forward:
- prefill: the prompts of joining rows, oldest first, several in one forward
  (right-padded, each at its own positions), at most `prefill_tokens` padded tokens
  per step; a longer prompt is cut into chunks over several steps, so rows that are
  decoding wait at most one chunk for a newcomer (chunked prefill, as Sarathi and
  vLLM). Rows with the same prompt (`rollout_n` > 1, a GRPO group) prefill it once:
  the others copy its KV into their slots, and so does a request whose prompt a
  running row already holds. A prompt whose leading tokens the prefix cache holds
  (the previous turn of a multi-turn task) computes only the rest.
- decode: every decoding row feeds its last sampled token; rows still prefilling
  ride along as masked placeholders (their outputs are dropped).
Then the next token of every row is sampled at once (actor_node/sampling.py).

What is sampled, and logged (docs/design.md, "Generation: the behaviour policy"):
the logits come from the decoder's last hidden state through the LM head in
float32 (the function the learner recomputes, models.scoring.head_logits);
temperature T divides them; top-k and top-p keep the most likely tokens, renormalised.
The token's log-probability under that distribution is what the result carries for
each token. T = 0 is greedy decoding: the argmax, logged with log-probability 0
(probability 1) and marked greedy in the policy stamp.

New weights of the same learner run are applied between two steps, with rows
running (`swap`, docs/design.md "New weights mid-flight"): each running row's KV,
computed by the old weights, is computed again from its context (the prompt and the
response so far) by a prefill under the new ones, and the row decodes on. So each
token is sampled from exactly one version's distribution given everything before
it, and each response records its tokens' versions (`Generated.token_versions`).

Its parts elsewhere: whether a request's prompt fits a row (actor_node/prompt_fit.py), the inputs of one prefill
forward (actor_node/prefill_batch.py), and what a sampled token does to its row (actor_node/next_tokens.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from actor_node import lora_merge
from actor_node.decode_step import INPUTS, AttentionMasks, DecodeStep, run_decoder
from actor_node.kv_slots import SlotCache
from actor_node.lora_merge import FoldedLoRA
from actor_node.next_tokens import sample_next, sampling_settings, take_token
from actor_node.prefill_batch import PrefillBatch
from actor_node.prefix_cache import PrefixCache
from actor_node.prompt_fit import PromptFit
from actor_node.responses import (
    DECODE,
    PREFILL,
    WAITING,
    DeadlineExceeded,
    Generated,
    GenerationError,
    Row,
    SamplingParams,
    end_tokens,
)
from models import scoring

log = logging.getLogger(__name__)

Answer = tuple[dict[str, Any], "Generated | Exception"]


class GenerationEngine:
    """The running batch of one actor: `add` requests, `step` until none runs. Not thread-safe: one compute thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_rows: int = 16,
        prefix_cache_mb: float = 0.0,
        seed: int = 0,
        max_positions: int = 4096,
        prefill_tokens: int = 2048,
        fold_lora: bool = True,
        capture_decode: bool = True,
        version: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        self.decoder, self.head, self.post = scoring.model_parts(model)
        self.device = next(model.parameters()).device
        self.fit = PromptFit.of(model, tokenizer, max_positions)  # what a request's prompt must fit (actor_node/prompt_fit.py)
        self.capacity = self.fit.capacity
        self.end_ids = end_tokens(model, tokenizer)
        self.cache = PrefixCache(prefix_cache_mb)
        self.kv = SlotCache(max_rows, self.capacity, self.device)
        try:
            self.masks: AttentionMasks | None = AttentionMasks(model)
            self.unservable = ""
        except ValueError as e:  # the actor still scores; every generate request is answered with this
            self.masks, self.unservable = None, str(e)
        # the decode forward at bucketed shapes, captured per bucket on a GPU (actor_node/decode_step.py)
        self.decode_step = DecodeStep(self, capture=capture_decode) if self.masks is not None else None
        self.seeds = torch.Generator().manual_seed(seed)  # seeds the requests that bring none
        # the adapter folded into the base weights while rows run (actor_node/lora_merge.py)
        self.folded = FoldedLoRA(model) if fold_lora and lora_merge.applies(model) else None
        self.version = version  # of the weights in the model: each sampled token records it
        self.rows: list[Row] = []  # rows[i] owns slot i
        self.answered: list[Answer] = []  # answers of rows already removed in the running step (kept if the step fails)
        self.arrivals = 0
        self.tokens_out = 0
        self.steps = 0
        self.prefilled_tokens = 0
        self.shared_prompts = 0
        self.swaps = 0
        self.recomputed_tokens = 0  # KV positions computed again under new weights (swap)

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return max(0, self.max_rows - len(self.rows))

    def reset(self) -> list[Answer]:
        """Drop every running row (after a failure; the caller answers their requests); the answers of rows the
        failed step had already finished (a deadline), which the caller sends as they are."""
        self.rows = []
        self._drained()
        if self.decode_step is not None:  # a step that failed part-way may have left a capture unfinished
            self.decode_step.forget()
        answered, self.answered = self.answered, []
        return answered

    def _drained(self) -> None:
        """No row runs: the model goes back to its plain weights (new weights load only now)."""
        if self.folded is not None and not self.rows:
            self.folded.restore()

    @torch.inference_mode()
    def cancel(self, jobs: set[int]) -> int:
        """Drop the rows of these job ids (their clients gave up) unanswered; how many were dropped."""
        gone = {r for r in self.rows if r.job.get("job") in jobs}
        if gone:
            self._remove(gone)
        self._drained()
        return len(gone)

    def clear_cache(self) -> None:
        """Forget cached prompt KV (the weights changed)."""
        self.cache.clear()

    def swap(self, load: Callable[[], None], version: int) -> None:
        """New weights between two steps: `load()` copies them into the plain model (the LoRA fold is undone
        first; the next step folds the new adapter). Every row whose KV the old weights computed prefills its
        context again (under the new ones) before it decodes on; its later tokens record `version`."""
        if self.folded is not None:
            self.folded.restore()
        try:
            load()
            self.version = version
        finally:  # a load that failed part-way may have changed some weights: no KV of the old ones is kept either way
            self._recompute()
        self.swaps += 1

    def _recompute(self) -> None:
        """Every row whose KV is in its slot prefills it again; cached prompts are forgotten."""
        self.cache.clear()
        for row in self.rows:
            if row.state == WAITING:  # its leader computes the prompt again; it copies it then
                continue
            self.recomputed_tokens += row.filled
            row.state, row.filled, row.first_logits = PREFILL, 0, None

    # --- joining ---------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, jobs: Sequence[dict[str, Any]]) -> list[Answer]:
        """Give these requests rows; they prefill in the next steps. What is answered at once (bad input)
        comes back. Call with at most `free` jobs."""
        answered: list[Answer] = []
        now = time.monotonic()
        for job in jobs:
            if len(self.rows) >= self.max_rows:
                raise RuntimeError(f"add() got more requests than the {self.max_rows} rows hold")
            try:
                row = self._row(job, now)
            except GenerationError as e:
                answered.append((job, e))
                continue
            if self.folded is not None:
                self.folded.fold()
            row.slot = len(self.rows)
            self.rows.append(row)
            self._share_or_reuse(row)
        return answered

    def _row(self, job: dict[str, Any], now: float) -> Row:
        if self.unservable:
            raise GenerationError(self.unservable)
        obs = job["obs"]
        params = SamplingParams.of(obs["sampling"])
        prompt_ids = self.fit.prompt_ids(self.tokenizer, obs, params.max_new_tokens)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self.seeds))
        # the actor loop stamps when the job arrived (`deadline_at`); without it, from now
        deadline = job.get("deadline_at") or now + max(1, int(job.get("deadline_ms", 60_000))) / 1000
        self.arrivals += 1
        return Row(job, prompt_ids, params, seed, deadline, self.arrivals)

    def _share_or_reuse(self, row: Row) -> None:
        """A prompt another row holds or computes is not computed again; a cached prefix is copied in."""
        for other in self.rows:
            if other is row or other.prompt_ids != row.prompt_ids:
                continue
            if other.first_logits is not None:  # its prompt's KV is in its slot: copy it now
                self._copy_prompt(other, row)
                return
            if other.state == PREFILL and not other.response_ids:  # (one with a response computes more than the prompt)
                row.state, row.leader = WAITING, other
                return
        hit = self.cache.lookup(row.prompt_ids)
        if hit is not None:
            kv, m = hit
            self.kv.write(row.slot, kv, m)
            row.filled = m

    def _copy_prompt(self, source: Row, row: Row) -> None:
        self.kv.copy(source.slot, row.slot, len(row.prompt_ids))
        row.filled = len(row.prompt_ids)
        row.first_logits = source.first_logits
        row.state, row.leader = DECODE, None
        self.shared_prompts += 1

    # --- stepping --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Answer]:
        """One step: a prefill chunk for joining rows, then one decode step for the decoding ones; the rows that finished, answered."""
        if not self.rows:
            return []
        if self.folded is not None:
            self.folded.fold()  # (again, if a scoring job between two steps unmerged a layer)
        answered = self.answered
        finished: set[Row] = set()
        now = time.monotonic()
        for row in self.rows:
            if now > row.deadline:
                answered.append((row.job, DeadlineExceeded(f"the deadline passed after {len(row.response_ids)} tokens")))
                finished.add(row)
        if finished:
            self._remove(finished)
            finished = set()
        self._prefill()
        fresh = [r for r in self.rows if r.state == DECODE and not r.response_ids]
        if fresh:  # the first token of every row whose prompt's KV is complete
            logits = torch.stack([r.first_logits for r in fresh])  # type: ignore[misc]
            self._sample(fresh, logits, sampling_settings(fresh), [r.params.filters for r in fresh], answered, finished)
        decoding = [r for r in self.rows if r.state == DECODE and r not in finished]
        if decoding:
            self._decode(decoding, answered, finished)
        if finished:
            self._remove(finished)
        self._drained()
        self.steps += 1
        self.answered = []
        return answered

    def _prefill(self) -> None:
        """One forward over the next chunks of the oldest prompts; the rows whose prompts it completes,
        and the rows waiting for them (their KV copied in), go on to decode."""
        queue = sorted((r for r in self.rows if r.state == PREFILL), key=lambda r: r.arrival)
        if not queue:
            return
        contexts = {row: row.context for row in queue}
        batch = PrefillBatch.plan(queue, contexts, self.prefill_tokens)
        hidden = self._forward([r.slot for r, _ in batch.chosen], batch.ids, batch.positions, batch.real, batch.width)
        self.prefilled_tokens += batch.tokens
        for b, (row, take) in enumerate(batch.chosen):
            row.filled += take
            if row.filled == len(contexts[row]):
                row.state = DECODE
                if row.response_ids:  # its KV computed again after new weights: the next step feeds its last token
                    continue
                row.first_logits = self.post(scoring.head_logits(self.head, hidden[b, take - 1]))
                if self.cache.enabled:
                    key = str(row.job.get("task_id", "")) or f"anon-{row.arrival}"
                    self.cache.insert(key, row.prompt_ids, self.kv.read(row.slot, row.filled))
        for row in list(self.rows):
            if row.state == WAITING and row.leader is not None and row.leader.state == DECODE:
                self._copy_prompt(row.leader, row)

    def _decode(self, decoding: list[Row], answered: list[Answer], finished: set[Row]) -> None:
        """Feed every decoding row its last token (the others, and the bucket's padding, ride as placeholders),
        then sample each one's next token: one copy of the inputs to the device, one of the results back."""
        inputs = torch.zeros(len(self.rows), len(INPUTS), dtype=torch.float64)  # row i is slot i (rows[i] owns it)
        slots = [r.slot for r in decoding]
        inputs[slots, :3] = torch.tensor([[r.response_ids[-1], r.filled, 1.0] for r in decoding], dtype=torch.float64)
        inputs[slots, 3:7] = sampling_settings(decoding).T
        inputs[: len(slots), 7] = torch.tensor(slots, dtype=torch.float64)
        width = max(r.filled for r in decoding) + 1
        assert self.decode_step is not None  # rows exist only where the masks do (_row)
        logits, on_device = self.decode_step.run(inputs, width)
        for r in decoding:
            r.filled += 1
        picked = on_device["picked"][: len(slots)].long()  # the decoding rows only: placeholders are not sampled
        settings = torch.stack([on_device[name] for name in INPUTS[3:7]])[:, picked]
        self._sample(decoding, logits[picked], settings, [r.params.filters for r in decoding], answered, finished)

    def _forward(self, slots: list[int], ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, width: int) -> torch.Tensor:
        """The decoder's last hidden states [B, q] for tokens `ids` at `positions` of these slots, writing their KV in place."""
        writes = torch.where(real, positions, torch.full_like(positions, self.capacity))  # padding goes to the sink column
        self.kv.plan(slots, writes, width)
        assert self.masks is not None  # rows exist only where the masks do (_row)
        device = self.device
        return run_decoder(self.decoder, self.kv, self.masks, ids.to(device), positions.to(device), real.to(device), width)

    def _sample(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        settings: torch.Tensor,
        filters: list[bool],
        answered: list[Answer],
        finished: set[Row],
    ) -> None:
        """The next token of each of these rows, sampled at once from their `logits` and `settings` ([4, rows]:
        temperature, top_p, top_k, uniform); finished rows answered and marked."""
        for row, (token_, logprob, bad) in zip(rows, sample_next(logits, settings, filters)):
            token = int(token_)
            if bad:  # named by all its settings: the temperature alone blamed it when a top_p was what the client had set
                named = f"temperature {row.params.temperature:g}, top_p {row.params.top_p:g}, top_k {row.params.top_k}"
                answered.append((row.job, GenerationError(f"the distribution at {named} cannot be sampled (not finite)")))
                finished.add(row)
                self.kv.clear(row.slot)  # its KV may hold NaN: the next row in this slot reads past its own length
                continue
            self.tokens_out += 1
            done = take_token(row, token, logprob, self.version, self.end_ids, self.tokenizer)
            if done is not None:
                answered.append((row.job, done))
                finished.add(row)

    # --- leaving ---------------------------------------------------------------------------
    def _remove(self, gone: set[Row]) -> None:
        """Free the slots of these rows; the highest surviving rows move into the freed slots, so
        slots 0..n-1 stay the running rows. A row waiting for a removed leader's prompt computes it itself."""
        survivors = [r for r in self.rows if r not in gone]
        promoted: dict[Row, Row] = {}  # a removed leader -> the follower that computes the prompt instead
        for row in survivors:
            if row.state == WAITING and row.leader is not None and row.leader in gone:
                if row.leader in promoted:
                    row.leader = promoted[row.leader]
                else:
                    promoted[row.leader] = row
                    row.state, row.leader = PREFILL, None
        holes = sorted(r.slot for r in self.rows if r in gone and r.slot < len(survivors))
        movers = [r for r in survivors if r.slot >= len(survivors)]
        for row, hole in zip(movers, holes):
            if row.filled:
                self.kv.copy(row.slot, hole, row.filled)
            row.slot = hole
        self.rows = sorted(survivors, key=lambda r: r.slot)

    def stats(self) -> str:
        return (
            f"{self.tokens_out} tokens generated in {self.steps} steps, {self.prefilled_tokens} prompt tokens prefilled, "
            f"{self.shared_prompts} prompts shared, {self.swaps} weight swaps mid-flight ({self.recomputed_tokens} KV positions "
            f"computed again); KV slots {self.kv.nbytes / 2**20:.0f} MiB; prompt cache {self.cache.stats()}"
        )
