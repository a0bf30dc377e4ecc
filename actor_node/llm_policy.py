"""The LLM policy an actor serves: tokenize, score (models.scoring), sample, swap weights.

`choose_batch` takes the jobs of one broker message batch and answers each with
(action, logprob, probs) or an error. It runs in the actor's compute thread,
under `torch.inference_mode()`, so weight swaps (between batches) and scoring
never overlap: every result of a batch carries the same policy version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from actor_node.generation_engine import GenerationEngine
from actor_node.policies import Choice
from actor_node.prefix_cache import PrefixCache
from common.shared_settings import PolicyStamp
from models import scoring
from models.policy_model import load_policy_state_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the actor turns candidate scores into a choice, and how much it scores at once: the settings of the
    same names in [policy] and [actor] (common/shared_settings.py, actor_node/config.py say what each means), as
    actor_node/main.py passes them; the defaults are theirs, for a policy built without a config (tests)."""

    normalisation: str = "token"
    temperature: float = 1.0
    greedy: bool = False
    max_batch_tokens: int = 32768
    seed: int = 0
    max_generate_rows: int = 16
    max_generate_positions: int = 4096
    prefill_tokens: int = 2048
    fold_lora: bool = True
    capture_decode: bool = True
    stage_weights: bool = True


class LLMPolicy:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingConfig,
        path: str = "auto",
        prefix_cache_mb: float = 0.0,
        policy_version: int = 0,
    ) -> None:
        self.model = model.requires_grad_(False)  # it serves, never trains: a frozen head keeps its float32 copy (scoring.head_logits)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.path = scoring.select_path(model, path)
        self.position_limit = scoring.position_limit(model)
        self.cache = PrefixCache(prefix_cache_mb if self.path == "packed" else 0.0)
        if prefix_cache_mb and self.path != "packed":
            log.warning("prefix cache off: it needs the packed scoring path, this model runs %s", self.path)
        self.policy_version = policy_version
        self.policy_run = ""
        self.prefix_cache_mb = prefix_cache_mb
        self.engine: GenerationEngine | None = None  # made on first use (generation_engine)
        self._staging: dict[str, torch.Tensor] | None = None  # a full snapshot is fetched here (`staging`)
        self._no_staging = False  # a staging copy did not fit
        self.generator = torch.Generator().manual_seed(sampling.seed)
        self.forwards = 0
        self.scored = 0
        self.busy_s = 0.0
        # Decoder layers run, scoring and generating alike: the progress the link's heartbeats carry, so the broker
        # tells a busy actor (a 1,024-token prompt and 32 candidates on a slow device) from a hung one. A hook per
        # layer, not per forward: one forward of a long batch can outlast the broker's patience alone.
        self.layers_run = 0
        for layer in scoring.model_parts(model)[0].modules():
            if isinstance(layer, GradientCheckpointingLayer):
                layer.register_forward_hook(self._layer_ran)

    def _layer_ran(self, *_: Any) -> None:
        self.layers_run += 1  # one thread computes; the link's I/O thread only reads it

    @property
    def progress(self) -> int:
        """Decoder layers run and decode steps taken (a captured step runs no hook)."""
        return self.layers_run + (self.engine.steps if self.engine is not None else 0)

    # --- weights ------------------------------------------------------------------------
    def staging(self, kind: str) -> dict[str, torch.Tensor] | None:
        """Where a snapshot of `kind` is fetched: a second copy of every weight, beside the serving one, for a full
        snapshot (made on first use and kept; tied weights share one tensor), so that applying it is a swap between
        two steps, not a copy; None (new CPU tensors, copied in) for an adapter or with `stage_weights` off."""
        if kind != "full" or not self.sampling.stage_weights or self._no_staging or hasattr(self.model, "peft_config"):
            return None
        if self._staging is None:
            live = self.model.state_dict(keep_vars=True)
            made: dict[int, torch.Tensor] = {}
            try:
                for t in live.values():
                    if id(t) not in made:
                        made[id(t)] = torch.empty_like(t.data)
            except torch.OutOfMemoryError:  # no room for a second copy: snapshots are copied in, between two steps
                log.warning("no memory for a staging copy of the weights: new ones are copied in, pausing generation")
                self._no_staging = True
                return None
            self._staging = {name: made[id(t)] for name, t in live.items()}
        return self._staging

    def set_weights(self, state: dict[str, torch.Tensor], version: int, run: str) -> None:
        """Swap to new weights (between batches, or between two decode steps of running responses: the engine
        computes their KV again under the new weights). Cached KV is stale after this, so it is dropped."""

        def load() -> None:
            staged = self._staging or {}
            if any(staged.get(name) is tensor for name, tensor in state.items()):
                self._swap_staged(state, staged)
            else:
                # each tensor copied into its parameter from where it is (the fetcher's CPU buffers): moving the whole
                # snapshot to the GPU first held a second copy of every swapped weight there, a model's worth in a full swap
                load_policy_state_dict(self.model, state)

        try:
            if self.engine is not None:
                self.engine.swap(load, version)
            else:
                load()
        finally:  # even a load that failed part-way may have changed weights: no cached KV of the old ones is kept
            self.cache.clear()
        if run != self.policy_run:
            log.info("following learner run %s (was %s)", run or "-", self.policy_run or "the base weights")
        self.policy_version = version
        self.policy_run = run
        log.info("now serving policy version %d", version)

    def _swap_staged(self, state: dict[str, torch.Tensor], staged: dict[str, torch.Tensor]) -> None:
        """Put the staged tensors in place of the serving ones; the old ones become the next staging copy. On a GPU
        the staged bytes are copied instead (device to device), so a captured decode step keeps reading the
        addresses it was captured with."""
        live = self.model.state_dict(keep_vars=True)
        unexpected = [name for name in state if name not in live]
        if unexpected:
            raise ValueError(f"weight snapshot has keys this model lacks, e.g. {unexpected[:3]}")
        # fetched apart: a tensor under a second name of one the model ties (weights.fetch fills one tensor once)
        others = {name: tensor for name, tensor in state.items() if staged.get(name) is not tensor}
        names: dict[int, list[str]] = {}  # every name of a staged tensor (tied weights: several)
        for name, tensor in staged.items():
            names.setdefault(id(tensor), []).append(name)
        copied_on: set[torch.device] = set()
        with torch.no_grad():
            for name, tensor in state.items():
                target = live[name]
                if name in others:
                    continue
                if target.device.type != "cpu":
                    target.copy_(tensor)  # on the parameter, not .data: its version moves, and a kept float32 head with it
                    copied_on.add(target.device)
                    continue
                old = target.data
                target.data = tensor
                for other in names[id(tensor)]:
                    staged[other] = old
            if others:
                self.model.load_state_dict(others, strict=False)
        for device in copied_on:
            # The copies above read the staging buffers on the serving stream, asynchronously; the next fetch writes
            # them on a stream of its own (common/weights.py) once this returns: it must find them read.
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()

    def stamp(self) -> PolicyStamp:
        peft_config = getattr(self.model, "peft_config", None)
        return PolicyStamp(
            run=self.policy_run,
            normalisation=self.sampling.normalisation,
            temperature=self.sampling.temperature,
            lora_rank=int(peft_config["default"].r) if peft_config else 0,
            greedy=self.sampling.greedy,
            path=self.path,
        )

    def stats(self) -> str:
        generated = f"; {self.engine.stats()}" if self.engine is not None else ""
        return f"{self.scored} scored in {self.forwards} forwards; prefix cache {self.cache.stats()}{generated}"

    def generation_engine(self) -> GenerationEngine:
        """The batch of running responses (actor_node/generation_engine.py), sharing this policy's model and weights."""
        if self.engine is None:
            self.engine = GenerationEngine(
                self.model,
                self.tokenizer,
                max_rows=self.sampling.max_generate_rows,
                prefix_cache_mb=self.prefix_cache_mb,
                seed=self.sampling.seed,
                max_positions=self.sampling.max_generate_positions,
                prefill_tokens=self.sampling.prefill_tokens,
                fold_lora=self.sampling.fold_lora,
                capture_decode=self.sampling.capture_decode,
                version=self.policy_version,
            )
        return self.engine

    # --- scoring --------------------------------------------------------------------------
    def choose_batch(self, jobs: list[dict[str, Any]]) -> list[Choice | Exception]:
        """One answer per job, in order: a Choice, or the exception that job raised."""
        started = time.perf_counter()
        out: list[Choice | Exception] = [ValueError("not scored")] * len(jobs)
        items: list[tuple[int, str, scoring.Tokenized]] = []
        for i, job in enumerate(jobs):
            obs = job["obs"]
            try:
                item = scoring.tokenize_observation(self.tokenizer, obs["prompt"], obs.get("question", ""), obs["action"])
                scoring.check_length(item, self.position_limit)  # an over-long item fails alone, never its batch
                items.append((i, str(job.get("task_id", "")), item))
            except scoring.ScoringError as e:
                out[i] = e
        with torch.inference_mode():
            for chunk in self._chunks(items):
                sums = self._score(chunk)
                for (i, _, item), total in zip(chunk, sums):
                    out[i] = self._sample(item, total)
        self.scored += len(items)
        self.busy_s += time.perf_counter() - started
        return out

    def _chunks(self, items: list[tuple[int, str, scoring.Tokenized]]) -> list[list[tuple[int, str, scoring.Tokenized]]]:
        """Split a batch so each forward holds at most max_batch_tokens (an over-long item goes alone)."""
        chunks: list[list[Any]] = []
        current: list[Any] = []
        tokens = 0
        for entry in items:
            n = entry[2].n_tokens
            if current and tokens + n > self.sampling.max_batch_tokens:
                chunks.append(current)
                current, tokens = [], 0
            current.append(entry)
            tokens += n
        if current:
            chunks.append(current)
        return chunks

    def _score(self, chunk: list[tuple[int, str, scoring.Tokenized]]) -> list[torch.Tensor]:
        items = [item for _, _, item in chunk]
        self.forwards += 1
        if self.path != "packed" or not self.cache.enabled:
            return scoring.score(self.model, items, self.path)
        past = [self.cache.lookup(item.context) for item in items]
        sums, kvs = scoring.score_packed_kv(self.model, items, past)
        for (_, task, item), kv in zip(chunk, kvs):
            self.cache.insert(task or f"anon-{id(item)}", item.context, kv)
        return sums

    def _sample(self, item: scoring.Tokenized, sums: torch.Tensor) -> Choice:
        logp = scoring.policy_logprobs(scoring.normalise(sums.float().cpu(), item, self.sampling.normalisation), self.sampling.temperature)
        probs = logp.exp()
        if self.sampling.greedy:
            action = int(torch.argmax(logp))
        else:
            action = int(torch.multinomial(probs, 1, generator=self.generator))
        return Choice(action, float(logp[action]), probs.tolist())
