"""Helpers of the client tests: a policy whose choice names its request, observations, ports, threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from actor_node.llm_policy import Choice
from actor_node.policies import UniformPolicy


class EchoPolicy(UniformPolicy):
    """Chooses the candidate the prompt names ("... pick 7" -> 7), so a reply shows which request it answers.

    Each batch takes `delay` seconds and its size is recorded, so a test can see
    whether requests were in flight together (batches of more than one).
    """

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(0)
        self.delay = delay
        self.batches: list[int] = []

    def choose(self, obs: dict[str, Any]) -> tuple[int, float, list[float]]:
        n = len(obs["action"])
        return int(obs["prompt"].rsplit(" ", 1)[-1]) % n, 0.0, [1.0 / n] * n

    def choose_batch(self, jobs: list[dict[str, Any]]) -> list[Choice | Exception]:
        self.batches.append(len(jobs))
        time.sleep(self.delay)
        return super().choose_batch(jobs)


def pick(i: int, n: int = 32) -> dict[str, Any]:
    """An observation of `n` candidates whose prompt tells EchoPolicy to choose candidate i."""
    return {
        "prompt": f"Screen {i}. History: none. pick {i}",
        "question": "Which action should I choose next? I shall choose No. ",
        "action": [f"{k}: TouchEvent(view={k})" for k in range(n)],
    }


def run_threads(target: Callable[[int], None], n: int, timeout: float = 60.0) -> list[BaseException]:
    """Run target(0..n-1) in n threads; return the exceptions they raised. `timeout`: how long each is waited for (its
    tens of requests to a broker and actor of this process take 1-3 s alone; x20)."""
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors
