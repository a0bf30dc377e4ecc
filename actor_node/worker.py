"""The actor process loop: jobs from the broker link -> policy -> results; weights between batches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from actor_node.link import BrokerLink
from actor_node.policies import Policy
from actor_node.weight_follower import WeightFollower
from common import protocol as p
from common import weights
from common.errors import BadInput

if TYPE_CHECKING:
    from actor_node.rag import Retriever

log = logging.getLogger(__name__)


def catch_up(policy: Policy, follower: WeightFollower | None) -> bool:
    """Load the newest snapshot the learner announced or stored, if newer than what the policy has."""
    if follower is None:
        return False
    ann = follower.newest(time.monotonic(), policy.policy_version, policy.policy_run)
    if ann is None:
        return False
    try:
        state = weights.fetch(follower.client, follower.prefix, ann)
    except Exception as e:  # a missing or corrupt snapshot: keep serving the current weights
        log.warning("cannot load policy version %d: %s; keeping version %d", ann.version, e, policy.policy_version)
        return False
    policy.set_weights(state, ann.version, ann.run)
    return True


def serve(
    link: BrokerLink,
    policy: Policy,
    stop: threading.Event,
    max_batch: int = 8,
    follower: WeightFollower | None = None,
    tick: Callable[[int], None] | None = None,
    retriever: Retriever | None = None,
) -> int:
    """Answer jobs until `stop` is set; return how many were answered.

    Weights change only here, between two batches, so all results of a batch
    carry one policy version. `tick(served)` is called once per turn of the loop
    (the systemd watchdog: a hung forward stops it). With a `retriever`, rag_step
    jobs are augmented first, and their results carry the observation scored."""
    served = 0
    while not stop.is_set():
        if tick is not None:
            tick(served)
        catch_up(policy, follower)
        link.policy_version = policy.policy_version
        jobs = link.get_jobs(max_batch, timeout=0.1)
        if not jobs:
            continue
        failed = retriever.augment_batch(jobs) if retriever is not None else {}
        scored = [job for i, job in enumerate(jobs) if i not in failed]
        try:
            chosen = list(policy.choose_batch(scored)) if scored else []
            if len(chosen) != len(scored):
                raise RuntimeError(f"the policy answered {len(chosen)} of {len(scored)} jobs")
        except Exception as e:  # the whole batch failed (out of memory, say): answer every job
            log.exception("scoring a batch of %d failed", len(jobs))
            chosen = [e] * len(scored)
        answers = iter(chosen)
        stamp = policy.stamp()  # one per batch: weights change only between batches
        results = []
        for i, job in enumerate(jobs):
            answer = failed[i] if i in failed else next(answers)
            if isinstance(answer, Exception):
                code = p.E_BAD_REQUEST if isinstance(answer, BadInput) else p.E_INTERNAL
                results.append(link.error(job["job"], code, f"{type(answer).__name__}: {answer}"))
            else:
                result = link.result(job["job"], answer.action, answer.logprob, answer.probs, policy.policy_version, stamp)
                if "context" in job:  # rag_step: the broker records the client's prompt + this context, as scored
                    result.update(context=job["context"], retrieved=job["retrieved"])
                results.append(result)
        link.send_results(results)
        served += len(jobs)
    return served
