"""The actor process loop: jobs from the broker link -> policy -> results; weights between batches."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from actor_node.link import BrokerLink
from actor_node.policies import Policy
from actor_node.weight_follower import WeightFollower
from common import protocol as p
from common import weights
from common.errors import BadInput

if TYPE_CHECKING:
    from actor_node.generation import Generated, GenerationEngine
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
        state = weights.fetch(follower.client, follower.prefix, ann, follower.store)
        policy.set_weights(state, ann.version, ann.run)
    except Exception as e:  # a missing or corrupt snapshot, or one of another model: keep serving the current weights
        log.warning("cannot load policy version %d: %s; keeping version %d", ann.version, e, policy.policy_version)
        follower.take(loaded=False)
        return False
    follower.take()
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
    carry one policy version; while responses are being generated, new weights
    wait until the running ones are finished (and new generate jobs wait with
    them), so every token of a response comes from one version. Scoring jobs are
    answered between decode steps. `tick(served)` is called once per turn of the
    loop (the systemd watchdog: a hung forward stops it). With a `retriever`,
    rag_step jobs are augmented first, and their results carry the observation scored."""
    served = 0
    engine = policy.generation_engine()
    waiting: list[dict[str, Any]] = []  # generate jobs not in the running batch yet, oldest first
    while not stop.is_set():
        if tick is not None:
            tick(served)
        generating = engine is not None and engine.active > 0
        if follower is not None:  # kept as follower.waiting until loaded
            follower.newest(time.monotonic(), policy.policy_version, policy.policy_run)
        if not generating:
            catch_up(policy, follower)
        link.policy_version = policy.policy_version
        jobs = link.get_jobs(max_batch, timeout=0.0 if generating or waiting else 0.1)
        scoring_jobs = [job for job in jobs if job.get("mode") != p.OP_GENERATE]
        now = time.monotonic()
        for job in jobs:
            if job.get("mode") == p.OP_GENERATE:  # its deadline counts from now, however long it waits for a row
                job["deadline_at"] = now + max(1, int(job.get("deadline_ms", 60_000))) / 1000
                waiting.append(job)
        results = _score(link, policy, scoring_jobs, retriever) if scoring_jobs else []
        if waiting and engine is None:
            no_model = "this actor serves no model: generate needs one (--model)"
            results += [link.error(job["job"], p.E_BAD_REQUEST, no_model) for job in waiting]
            waiting = []
        if engine is not None:
            late = [job for job in waiting if job["deadline_at"] <= now]
            waiting = [job for job in waiting if job["deadline_at"] > now]
            results += [link.error(job["job"], p.E_TIMEOUT, "the deadline passed before a row was free") for job in late]
            swap_waiting = follower is not None and follower.waiting is not None
            if waiting and not swap_waiting and engine.free:  # join the running batch (none joins while new weights wait)
                joining, waiting = waiting[: engine.free], waiting[engine.free :]
                results += [_generated(link, policy, job, answer) for job, answer in _guarded(engine, engine.add, joining)]
            if engine.active:
                results += [_generated(link, policy, job, answer) for job, answer in _guarded(engine, engine.step)]
        if results:
            link.send_results(results)
            served += len(results)
    return served


def _guarded(engine: GenerationEngine, call: Callable[..., list], *args: Any) -> list[tuple[dict[str, Any], Any]]:
    """An engine call whose failure (out of memory, a bug) fails the requests it touched, never the actor:
    the running rows and the joining ones are answered `internal`, what the failed step had already
    finished (a deadline) is answered as it was, and the batch starts afresh."""
    try:
        return call(*args)
    except Exception as e:  # noqa: BLE001 - every job gets an answer; the actor serves on
        log.exception("generation failed; answering its %d requests", engine.active + (len(args[0]) if args else 0))
        touched = list({id(job): job for job in [row.job for row in engine.rows] + (list(args[0]) if args else [])}.values())
        finished = engine.reset()
        done = {id(job) for job, _ in finished}
        return finished + [(job, RuntimeError(f"generation failed: {type(e).__name__}: {e}")) for job in touched if id(job) not in done]


def _score(link: BrokerLink, policy: Policy, jobs: list[dict[str, Any]], retriever: Retriever | None) -> list[dict[str, Any]]:
    """Choose an action for each scoring job (step, rag_step): their results, errors included."""
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
            results.append(link.error(job["job"], _error_code(answer), f"{type(answer).__name__}: {answer}"))
        else:
            result = link.result(job["job"], answer.action, answer.logprob, answer.probs, policy.policy_version, stamp)
            if "context" in job:  # rag_step: the broker records the client's prompt + this context, as scored
                result.update(context=job["context"], retrieved=job["retrieved"])
            results.append(result)
    return results


def _generated(link: BrokerLink, policy: Policy, job: dict[str, Any], answer: Generated | Exception) -> dict[str, Any]:
    """The result message of one generate job."""
    if isinstance(answer, Exception):
        return link.error(job["job"], _error_code(answer), f"{type(answer).__name__}: {answer}")
    stamp = policy.stamp()
    if stamp is not None:  # the behaviour policy of a response: its own temperature, and greedy when that is 0
        stamp = dataclasses.replace(stamp, temperature=answer.temperature, greedy=answer.temperature == 0, path=p.OP_GENERATE)
    return link.generated(job["job"], answer, policy.policy_version, stamp)


def _error_code(e: Exception) -> str:
    from actor_node.generation import DeadlineExceeded

    if isinstance(e, DeadlineExceeded):
        return p.E_TIMEOUT
    return p.E_BAD_REQUEST if isinstance(e, BadInput) else p.E_INTERNAL
