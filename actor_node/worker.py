"""The actor process: take jobs from the broker link, score them, send results."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from actor_node.link import BrokerLink
from common import protocol as p

log = logging.getLogger(__name__)


class Policy(Protocol):
    policy_version: int

    def choose(self, obs: dict[str, Any]) -> tuple[int, float, list[float]]: ...


def serve(link: BrokerLink, policy: Policy, stop: threading.Event, max_batch: int = 8) -> int:
    """Answer jobs until `stop` is set; return how many were answered."""
    served = 0
    while not stop.is_set():
        link.policy_version = policy.policy_version
        jobs = link.get_jobs(max_batch, timeout=0.1)
        if not jobs:
            continue
        results = []
        for job in jobs:
            try:
                action, logprob, probs = policy.choose(job["obs"])
            except Exception as e:  # one bad observation must not stop the actor
                log.exception("scoring job %s failed", job.get("job"))
                results.append(link.error(job["job"], p.E_INTERNAL, f"{type(e).__name__}: {e}"))
                continue
            results.append(link.result(job["job"], action, logprob, probs, policy.policy_version))
        link.send_results(results)
        served += len(jobs)
    return served
