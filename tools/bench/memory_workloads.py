"""The workloads `ppoz bench memory` measures (tools/bench/memory.py, tools/bench/memory_sharded.py): Kea rollouts and
generated responses of the issue's shapes, texts of exact token counts for a word-level tokenizer over the whole
vocabulary, and the learner's configuration as the bench runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tools.bench.train_tasks import CACHE, REAL_SHAPE_VOCAB

GB = 1e9
LORA_RANK = 8  # [policy] lora_rank's default


@dataclass(frozen=True)
class Measured:
    """A part's peak on the device, and (start-up parts) what it holds after."""

    peak: int
    steady: int | None = None


def words_tokenizer() -> Any:
    """A word-level tokenizer over the whole vocabulary (`w0` ... one token per word), so a workload's token counts
    are exactly its word counts."""
    from transformers import AutoTokenizer

    from models.tiny_models import SPECIAL_TOKENS, build_words_tokenizer

    path = CACHE / "bench-memory-words"
    if not (path / "tokenizer.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        build_words_tokenizer(path, tuple(f"w{i}" for i in range(REAL_SHAPE_VOCAB - len(SPECIAL_TOKENS) - 1)))
    return AutoTokenizer.from_pretrained(str(path))


class Text:
    """Texts of exact token counts for `words_tokenizer`, from a seeded generator."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def words(self, n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(10, REAL_SHAPE_VOCAB - 100, (n,), generator=self.generator))

    def ids(self, n: int) -> list[int]:
        return torch.randint(10, REAL_SHAPE_VOCAB - 100, (n,), generator=self.generator).tolist()

    def between(self, low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=self.generator))


def learner_config(lora_rank: int, checkpointing: str = "on") -> Any:
    from common.config import load
    from learner_node.config import LearnerConfig

    overrides = {
        "policy.model": "bench",
        "policy.lora_rank": lora_rank,
        "store.redis_url": "redis://bench",
        "gradient_checkpointing": checkpointing,
        "checkpoint_dir": "",  # nothing written: the paths resolve against no folder
        "tensorboard_dir": "",
    }
    return load(LearnerConfig, None, overrides)


def kea_segments(n: int = 64, prompt: int = 1024, candidates: int = 32, low: int = 40, high: int = 60, seed: int = 0) -> list[Any]:
    """`n` Kea transitions, eight to a segment (each closed by `done`)."""
    from common.segments import CandidateObservation, Segment, Transition

    text = Text(seed)
    transitions = []
    for i in range(n):
        actions = [text.words(text.between(low, high)) for _ in range(candidates)]
        obs = CandidateObservation.from_wire({"prompt": text.words(prompt), "question": " w5 ", "action": actions})
        p = 1.0 / candidates
        transitions.append(Transition(obs, i % candidates, -3.4657, [p] * candidates, 0, "step", float(i % 3 - 1), False, False))
    segments = []
    for s in range(0, n, 8):
        chunk = transitions[s : s + 8]
        chunk[-1].done = True
        segments.append(Segment(f"k{s}:0", f"k{s}", 0, "done", True, False, None, chunk))
    return segments


def generated_segments(n: int = 64, prompt: int = 256, low: int = 64, high: int = 1024, seed: int = 0) -> list[Any]:
    """`n` generated responses of `low` to `high` tokens after `prompt`-token prompts, each a finished episode."""
    from common.segments import GeneratedResponse, GenerateObservation, Segment, Transition

    text = Text(seed)
    segments = []
    for i in range(n):
        response = text.ids(text.between(low, high))
        generation = GeneratedResponse(response, [-1.0] * len(response), "length", 1.0, top_p=1.0)
        obs = GenerateObservation(text.ids(prompt), {"max_new_tokens": high})
        t = Transition(obs, 0, 0.0, [], 0, "generate", float(i % 2), True, False, generation=generation)
        segments.append(Segment(f"g{i}:0", f"g{i}", 0, "done", True, False, None, [t]))
    return segments
