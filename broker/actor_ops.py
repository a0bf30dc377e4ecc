"""The broker's back end: what actors say (ready, heartbeat, result, disconnect), and dispatch.

Every op but `ready` must come from a registered actor. Results are checked
against the job they answer before anything of them is recorded; `dispatch`
hands queued jobs to the least loaded actors within their credits, taking the
step queue's turns between clients (broker/scheduling.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import zmq

from broker.actors import MAX_ATTEMPTS, Job
from broker.backpressure import hold_over
from broker.sessions import PendingStep, now_ms
from broker.state import BrokerState
from common import protocol as p
from common.shared_settings import PolicyStamp
from common.zmqio import bound, send_frames

log = logging.getLogger(__name__)


class ActorOps(BrokerState):
    """The actor operations, one handler per op, and the dispatch of queued jobs."""

    @functools.cached_property
    def actor_handlers(self) -> dict[str, Callable[[bytes, dict[str, Any]], None]]:
        # every op but `ready` comes from a registered actor (see on_actor_frames)
        return {
            p.OP_READY: self.on_actor_ready,
            p.OP_HEARTBEAT: self.on_actor_heartbeat,
            p.OP_RESULT: self.on_actor_results,
            p.OP_DISCONNECT: self.on_actor_disconnect,
        }

    def on_actor_frames(self, frames: list[bytes]) -> None:
        """Messages from actors (ready, heartbeat, result, disconnect): decode, check, hand to the op's handler.

        Every op but `ready` must come from a registered actor; an unknown one (say, after a
        broker restart) is told `disconnect`, which makes it announce itself again."""
        if len(frames) != 2:
            self.metrics["dropped/malformed_actor_frames"] += 1
            return
        identity, body = frames
        try:
            msg = p.decode(body)
            if msg.get("proto") != p.PROTOCOL_ID or msg.get("v") != p.PROTOCOL_VERSION:
                raise p.ProtocolError(p.E_UNSUPPORTED_VERSION, f"actor speaks proto={msg.get('proto')!r} v={msg.get('v')!r}")
            op = msg.get("op")
            handler = self.actor_handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise p.ProtocolError(p.E_UNKNOWN_OP, f"unknown actor op {op!r}")
            if op != p.OP_READY:
                actor = self.registry.get(identity)
                if actor is None:
                    self._send_actor(identity, p.header(p.OP_DISCONNECT))
                    return
                actor.last_heard = self.now
            handler(identity, msg)
        except p.ProtocolError as e:
            self.metrics["dropped/bad_actor_messages"] += 1
            log.warning("bad message from actor %r: %s", identity, e)

    def on_actor_heartbeat(self, identity: bytes, msg: dict[str, Any]) -> None:
        """heartbeat: the actor is alive (on_actor_frames noted it), says which policy version it serves and, with
        `progress`, a count that grows while it computes (a busy actor is not hung: ActorRegistry.stuck)."""
        actor = self.registry.actors[identity]
        version = msg.get("policy_version")
        if isinstance(version, int) and not isinstance(version, bool):
            actor.policy_version = version
        progress = msg.get("progress")
        if isinstance(progress, int) and not isinstance(progress, bool):
            actor.progressed(self.now, progress)

    def on_actor_results(self, identity: bytes, msg: dict[str, Any]) -> None:
        """result: the outcome of some of the actor's jobs, each handled on its own."""
        for result in p.require(msg, "results", list, "an array of result maps"):
            if isinstance(result, dict):
                self.on_job_result(identity, result)
            else:
                self.metrics["dropped/bad_actor_messages"] += 1

    def on_actor_disconnect(self, identity: bytes, msg: dict[str, Any]) -> None:
        """disconnect: the actor leaves; the jobs it held go back to the front of the queue."""
        log.info("actor %s disconnected", self.registry.actors[identity].name)
        self._requeue(self.registry.remove(identity))

    def on_actor_ready(self, identity: bytes, msg: dict[str, Any]) -> None:
        credits = p.require(msg, "credits", int, "a positive int")
        if credits <= 0:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`credits` must be positive, got {credits}")
        name = str(msg.get("name") or identity.hex())
        version = msg.get("policy_version")
        # Heartbeat intervals may differ between broker and actor configs: judge the
        # actor by the slower of the two, or a slow-beating actor would flap.
        beat = msg.get("heartbeat_ms")
        beat_s = max(self.cfg.heartbeat_ms, beat if isinstance(beat, int) and beat > 0 else 0) / 1000
        orphans = self.registry.register(identity, name, credits, version if isinstance(version, int) else -1, self.now, beat_s)
        self._requeue(orphans)
        log.info("actor %s ready with %d credits (policy version %s)", name, credits, version)

    def on_job_result(self, identity: bytes, msg: dict[str, Any]) -> None:
        """One job's result: record the pending step and answer the client once it is in Redis.

        The result of a job already answered (timeout, superseded, detached: `abandoned`) or
        unknown is dropped (jobs/late_results): nothing of it is recorded."""
        actor = self.registry.get(identity)
        job_id = msg.get("job")
        job = actor.inflight.pop(job_id, None) if actor is not None and isinstance(job_id, int) else None
        if actor is None or job is None:
            self.metrics["jobs/late_results"] += 1
            return
        actor.served += 1
        actor.answered(job, self.now)
        self.jobs.pop(job.job_id, None)
        if self.task_jobs.get(job.task_id) is job:
            del self.task_jobs[job.task_id]
        if job.abandoned:
            self.metrics["jobs/late_results"] += 1
            return
        if "error" in msg:
            error = msg["error"] if isinstance(msg["error"], dict) else {}
            code = error["code"] if error.get("code") in p.ERROR_CODES else p.E_INTERNAL
            extra = {"retry_after_ms": self.cfg.retry_after_ms} if code == p.E_OVERLOADED else {}  # `overloaded` always says when
            self._answer_job(job, p.error_body(job.rid, job.mode, code, f"actor {actor.name}: {error.get('message', 'failed')}", **extra))
            return
        try:
            step = self._checked_result(job, msg)
        except p.ProtocolError as e:
            log.error("actor %s sent an invalid result: %s", actor.name, e.message)
            self.metrics["errors/bad_actor_result"] += 1
            self._answer_job(job, p.error_body(job.rid, job.mode, p.E_INTERNAL, f"actor {actor.name} returned an invalid result"))
            return
        if not self.storage_ok:
            self._answer_job(
                job, p.error_body(job.rid, job.mode, p.E_OVERLOADED, "storage (Redis) unavailable", retry_after_ms=self.cfg.retry_after_ms)
            )
            return
        session = self.sessions.get(job.task_id)
        if session is None:
            self._answer_job(job, p.error_body(job.rid, job.mode, p.E_UNKNOWN_TASK, f"task {job.task_id!r} went away while scored"))
            return
        closes, orphaned = session.record_step(step, self.cfg.segment_max_versions)
        for close in closes:
            self.store.stage_close(self.outbox.batch, session, close)
        self.store.stage_pending(self.outbox.batch, session, session.remember(step.rid, step.reply))
        self.metrics["broker/steps"] += 1
        self.metrics["broker/orphan_steps"] += orphaned
        # what it serves now: a busy actor's heartbeats give way to its results (actor_node/link.py), which say it too
        actor.policy_version = max(actor.policy_version, step.policy_version)
        self._count_closed(closes)
        # Broker time of a step: its wait for an actor, plus the time since the result came back.
        since = self.now - (job.dispatched_at - job.created)
        for envelope in job.waiters:
            self.reply(envelope, step.reply, durable=True, since=since)

    def _checked_result(self, job: Job, msg: dict[str, Any]) -> PendingStep:
        stamp = None
        if msg.get("policy") is not None:
            try:
                stamp = PolicyStamp.from_wire(p.require(msg, "policy", dict, "a map (the policy stamp)")).to_wire()
            except ValueError as e:
                raise p.ProtocolError(p.E_BAD_REQUEST, str(e)) from None
        if job.mode == p.OP_GENERATE:
            return self._checked_generation(job, msg, stamp)
        n = len(job.obs["action"])
        action = p.require(msg, "action", int, "an int")
        if not 0 <= action < n:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"action {action} out of range for {n} candidates")
        logprob = float(p.require(msg, "logprob", (int, float), "a number"))
        probs = p.require(msg, "probs", list, "an array of numbers")
        if len(probs) != n or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in probs):
            raise p.ProtocolError(p.E_BAD_REQUEST, f"probs must be {n} numbers")
        version = p.require(msg, "policy_version", int, "an int")
        body = p.header(job.mode, job.rid)
        body.update(
            task_id=job.task_id, status="ok", action=action, logprob=logprob, probs=[float(x) for x in probs], policy_version=version
        )
        obs, context = job.obs, ""
        if job.mode == p.OP_RAG_STEP:  # the actor scored the client's prompt + `context`; that is what the learner must see
            context = p.optional(msg, "context", str, "a str (the text appended to the prompt)", "")
            if len(context) > self.cfg.rag_max_context_chars:
                raise p.ProtocolError(
                    p.E_TOO_LARGE, f"`context` has {len(context)} characters, the limit is {self.cfg.rag_max_context_chars}"
                )
            retrieved = p.optional(msg, "retrieved", list, "an array of str", [])
            if not all(isinstance(x, str) for x in retrieved):
                raise p.ProtocolError(p.E_BAD_REQUEST, "`retrieved` must be an array of strings")
            if context:
                obs = dict(job.obs, prompt=job.obs["prompt"] + context)
            body["retrieved"] = retrieved
        elif "context" in msg:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"a retrieval `context` came back for a {job.mode} job")
        return PendingStep(job.rid, job.mode, obs, action, logprob, body["probs"], version, now_ms(), p.encode(body), len(context), stamp)

    def _checked_generation(self, job: Job, msg: dict[str, Any], stamp: dict[str, Any] | None) -> PendingStep:
        """A generate job's result: the response, its tokens and their log-probabilities, checked against the request."""
        text = p.require(msg, "text", str, "a str")
        prompt_ids = _token_ids(msg, "prompt_ids")
        response_ids = _token_ids(msg, "response_ids")
        budget = job.obs["sampling"]["max_new_tokens"]
        if len(response_ids) > budget:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"{len(response_ids)} response tokens for a budget of {budget}")
        logprobs = p.require(msg, "logprobs", list, "an array of numbers")
        if len(logprobs) != len(response_ids) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 and x > -float("inf") for x in logprobs
        ):
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`logprobs` must be {len(response_ids)} finite numbers <= 0, one per response token")
        finish = p.require(msg, "finish_reason", str, "eos, stop or length")
        if finish not in p.FINISH_REASONS:
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`finish_reason` must be one of {', '.join(p.FINISH_REASONS)}, got {finish!r}")
        version = p.require(msg, "policy_version", int, "an int")
        token_versions = _token_versions(msg, version, len(response_ids))
        sampling = job.obs["sampling"]
        logprob = float(sum(logprobs))
        body = p.header(job.mode, job.rid)
        body.update(
            task_id=job.task_id,
            status="ok",
            text=text,
            n_tokens=len(response_ids),
            finish_reason=finish,
            logprob=logprob,
            policy_version=version,
        )
        generation = {
            "response_ids": response_ids,
            "logprobs": [float(x) for x in logprobs],
            "finish_reason": finish,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "token_versions": token_versions,
        }
        obs = {"prompt_ids": prompt_ids, "sampling": sampling}
        return PendingStep(job.rid, job.mode, obs, 0, logprob, [], version, now_ms(), p.encode(body), 0, stamp, generation)

    def _send_actor(self, identity: bytes, body: dict[str, Any]) -> bool:
        try:
            send_frames(bound(self.backend, "the actor back end"), (identity, p.encode(body)))
        except zmq.ZMQError:
            self.metrics["dropped/unroutable_actor_messages"] += 1
            return False
        actor = self.registry.get(identity)
        if actor is not None:
            actor.last_sent = self.now
        return True

    # --- dispatch and liveness ---------------------------------------------------------------
    def dispatch(self) -> None:
        """Hand queued jobs to the least loaded actors, within their credits, one message per actor."""
        batches: dict[bytes, list[dict[str, Any]]] = {}
        held = self.over_backlog and self.cfg.step_hold_share > 0  # jobs wait for the learner (broker/backpressure.py)
        while self.queue:
            actor = self.registry.pick()
            if actor is None:
                break
            job = self.queue.popleft_due(lambda j: hold_over(j, self.now, self.cfg.step_hold_share)) if held else self.queue.popleft()
            if job is None:
                break
            if job.abandoned:
                continue
            if held:
                self.metrics["broker/steps_held_out"] += 1
            job.actor, job.dispatched_at = actor.identity, self.now
            actor.inflight[job.job_id] = job
            message = {
                "job": job.job_id,
                "task_id": job.task_id,
                "mode": job.mode,
                "obs": job.obs,
                "deadline_ms": max(1, int((job.deadline - self.now) * 1000)),
            }
            if job.mode == p.OP_RAG_STEP:  # the task's own history travels with the job: any actor can serve any task
                session = self.sessions.get(job.task_id)
                message["history"] = session.history if session is not None else []
            batches.setdefault(actor.identity, []).append(message)
        for identity, jobs in batches.items():
            body = p.header(p.OP_SCORE)
            body["jobs"] = jobs
            if not self._send_actor(identity, body):
                actor = self.registry.get(identity)
                log.warning("actor %s is unreachable; dropping it", actor.name if actor else identity)
                self._requeue(self.registry.remove(identity))
        self.holding_steps = held and bool(self.queue)

    def _requeue(self, jobs: list[Job]) -> None:
        """Put the jobs of a lost actor at the front of the queue (oldest first)."""
        for job in sorted(jobs, key=lambda j: j.created, reverse=True):
            job.attempts += 1
            job.actor = None
            if job.attempts >= MAX_ATTEMPTS:
                self._answer_job(job, p.error_body(job.rid, job.mode, p.E_INTERNAL, f"{job.attempts} actors failed on this observation"))
                continue
            self.metrics["jobs/requeued"] += 1
            self.queue.appendleft(job)

    def check_actors(self) -> None:
        """Dead actors (silent) and hung ones (holding a job past its time) lose their jobs to others; the quiet get a heartbeat."""
        now = self.now
        for actor in self.registry.silent(now, self.cfg.heartbeat_liveness):
            log.warning(
                "actor %s silent for %.1f s: taken as dead, %d jobs requeued", actor.name, now - actor.last_heard, len(actor.inflight)
            )
            self.metrics["actors/dead"] += 1
            self._requeue(self.registry.remove(actor.identity))
        for actor, job in self.registry.stuck(now, self.cfg.actor_job_timeout_ms / 1000):
            if job.mode == p.OP_GENERATE:
                why = f"a generate job {now - job.deadline:.1f} s past its deadline"
            else:
                why = f"a {job.mode} job for {now - job.dispatched_at:.1f} s, {now - actor.progress_at:.1f} s of it without progress"
            log.warning("actor %s held %s: taken as hung, %d jobs requeued", actor.name, why, len(actor.inflight))
            self.metrics["actors/hung"] += 1
            self._send_actor(actor.identity, p.header(p.OP_DISCONNECT))
            self._requeue(self.registry.remove(actor.identity))
        heartbeat = self.cfg.heartbeat_ms / 1000
        for actor in list(self.registry.actors.values()):
            if now - actor.last_sent >= heartbeat:
                self._send_actor(actor.identity, p.header(p.OP_HEARTBEAT) | {"heartbeat_ms": self.cfg.heartbeat_ms})


def _token_versions(msg: dict[str, Any], version: int, tokens: int) -> list[int]:
    """The policy version of each response token: new weights may arrive while a response is generated, so
    its versions never decrease, and the first is the result's `policy_version` (its oldest). Absent: every
    token's is `policy_version`."""
    versions = p.optional(msg, "token_versions", list, "an array of ints, one per response token", None)
    if versions is None:
        return [version] * tokens
    if (
        len(versions) != tokens
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in versions)
        or (versions and versions[0] != version)
        or any(b < a for a, b in zip(versions, versions[1:]))
    ):
        raise p.ProtocolError(
            p.E_BAD_REQUEST,
            f"`token_versions` must be {tokens} ints, one per response token, never decreasing, the first equal to"
            f" `policy_version` ({version})",
        )
    return versions


def _token_ids(msg: dict[str, Any], name: str) -> list[int]:
    ids = p.require(msg, name, list, "a non-empty array of token ids")
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise p.ProtocolError(p.E_BAD_REQUEST, f"`{name}` must be a non-empty array of token ids (ints >= 0)")
    return ids
