"""What an actor serves: the `Policy` protocol the actor loop drives, and the policies needing no model.

A policy answers `choose_batch(jobs)` with one `Choice` (or the exception that
job raised) per job, in order, and carries the `policy_version` of its weights.
The actor loop (actor_node/worker.py) swaps weights with `set_weights` between
batches only. `uniform` picks every candidate with equal probability: the
stand-in the broker tests and `ppoz bench broker` use (an actor that answers at
once), and a baseline for a learned policy. The LLM policy is
actor_node/llm_policy.py. This module imports no torch, so a uniform actor starts
in a fraction of a second.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common.shared_settings import PolicyStamp

if TYPE_CHECKING:  # no torch at import: the uniform actor starts without it
    import torch

    from actor_node.generation_engine import GenerationEngine


@dataclass
class Choice:
    """A policy's answer to one job: the chosen candidate, its log-probability, every candidate's probability."""

    action: int
    logprob: float
    probs: list[float]


class Policy(Protocol):
    """What the actor loop and its wiring (actor_node/main.py) need of a policy."""

    policy_version: int
    policy_run: str  # the learner run whose weights it serves ("" before any snapshot)

    @property
    def progress(self) -> int:
        """A count that grows while it computes, read by the link's I/O thread for its heartbeats (a busy actor is
        not hung: broker/actors.py)."""
        ...

    def choose_batch(self, jobs: list[dict[str, Any]]) -> list[Choice | Exception]:
        """One answer per job, in order: a Choice, or the exception that job alone raised."""
        ...

    def staging(self, kind: str) -> dict[str, torch.Tensor] | None:
        """Tensors beside the serving weights that a snapshot of `kind` is fetched into (None: new CPU tensors)."""
        ...

    def set_weights(self, state: dict[str, Any], version: int, run: str) -> None:
        """Serve these weights (version `version` of learner run `run`) from now on (called between batches)."""
        ...

    def stamp(self) -> PolicyStamp | None:
        """What its choices are scored with, sent with every result (None: a policy without weights)."""
        ...

    def stats(self) -> str:
        """A one-line summary of the work done, for the log at exit ('' if nothing to say)."""
        ...

    def generation_engine(self) -> GenerationEngine | None:
        """What serves `generate` jobs with this policy's model and weights (None: a policy without a model)."""
        ...


class UniformPolicy:
    """Samples a candidate uniformly at random; it has no weights, so its policy version stays 0."""

    policy_version = 0
    policy_run = ""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.progress = 0  # jobs taken

    def choose(self, obs: dict[str, Any]) -> tuple[int, float, list[float]]:
        n = len(obs["action"])
        return self.rng.randrange(n), -math.log(n), [1.0 / n] * n

    def choose_batch(self, jobs: list[dict[str, Any]]) -> list[Choice | Exception]:
        out: list[Choice | Exception] = []
        self.progress += len(jobs)
        for job in jobs:
            try:
                out.append(Choice(*self.choose(job["obs"])))
            except Exception as e:  # a malformed observation fails its own job only
                out.append(e)
        return out

    def staging(self, kind: str) -> dict[str, torch.Tensor] | None:
        return None

    def set_weights(self, state: dict[str, Any], version: int, run: str) -> None:
        raise TypeError("the uniform policy has no weights to follow; serve a model (--model) to follow the learner")

    def stamp(self) -> PolicyStamp | None:
        return None  # uniform over the candidates whatever the settings: its logged probs are exact

    def stats(self) -> str:
        return ""

    def generation_engine(self) -> GenerationEngine | None:
        return None  # no model to generate with
