"""Dataset drivers: clients that turn a prompt dataset into generate turns with rewards.

`drive` runs `workers` threads against a broker, each with its own client and task. A worker takes
the next position of the order of work (dataset_driver/data.py `PromptOrder`), asks for a response with
`generate`, has it scored, and sends the reward with `feedback(done=True)`: one turn is one
episode. Rewards are computed here, in the driver, never in the learner: the workers hand their
responses to one scorer (dataset_driver/scorer.py) that scores them in batches (a reward model batches, a judge runs
its requests concurrently), so a slow judge holds back the drivers that wait for it and, through
the broker's back-pressure (`wait_turn`), nothing else.

A response that gets no reward (its reward function refused it, the judge could not be read) is
not trained on: the worker detaches its task, which drops the step without a transition (the
broker's rule for a pending step at detach), counts it in `unrewarded`, and attaches anew.

Each feedback names its sample (`<run>:<position>`, dataset_driver/resume.py), which the broker stores once, with
the transition; a resumed run is given the positions stored before and skips them, so no sample is trained
twice and none is lost (docs/train.md, "Resume"). `DriverProgress` (dataset_driver/progress.py) keeps the positions
done; `resume_from`, the first position not yet done, is where a resumed run starts looking.

On `stop` the workers take no new position, and a turn not yet fed back is abandoned (its task detached, its
step dropped): it is not stored, so a resumed run plays it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from client import BadRequest, Client, Overloaded, PPOZError, RequestTimeout, TooLarge, UnknownTask
from client.retry import generate_fields
from common import protocol as p
from common.daemon_pool import DaemonPool
from dataset_driver.data import PromptOrder, PromptRecord
from dataset_driver.group_advantage import GroupAdvantage
from dataset_driver.progress import DriverProgress
from dataset_driver.resume import Samples
from dataset_driver.scorer import BATCHES_IN_FLIGHT, BatchingScorer
from rewards.composite import CompositeReward, Item, Scored, prompt_text

# The drivers' whole interface, the scorer and the progress they take included (dataset_driver/run.py, the benches).
__all__ = [
    "BATCHES_IN_FLIGHT",
    "BatchingScorer",
    "DriverProgress",
    "RECORD_ERRORS",
    "Sampling",
    "ValidationError",
    "drive",
    "generate",
    "item_for",
    "request_problem",
    "validate",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    chat_template: bool = False  # a plain-text prompt goes as one user message, through the model's chat template


def _prompt(record: PromptRecord, sampling: Sampling) -> tuple[str | None, list[dict[str, str]] | None]:
    """What `generate` sends: the text, or chat messages (a text prompt under `chat_template` becomes one user message)."""
    if isinstance(record.prompt, str):
        return (None, [{"role": "user", "content": record.prompt}]) if sampling.chat_template else (record.prompt, None)
    return None, list(record.prompt)


def request_problem(record: PromptRecord, sampling: Sampling, limits: p.Limits) -> str:
    """Why the broker would refuse `record`'s generate request ("" if it would not): the request built as `generate`
    builds it, with the longest task id and rid, checked by the broker's own rules and against its message size
    (a request far over it is dropped by ZeroMQ unanswered, and would show only as a timeout)."""
    text, messages = _prompt(record, sampling)
    stop = list(sampling.stop) or None
    fields = generate_fields("t" * 128, text, messages, sampling.max_new_tokens, sampling.temperature, sampling.top_p, stop, 0, 1.0)
    body = {**p.header(p.OP_GENERATE, "r" * p.MAX_RID_BYTES), **fields}
    try:
        p.check_generate(body, limits)
    except p.ProtocolError as e:
        return f"over the broker's limits: {e.message}"
    size = len(p.encode(body))
    if size > limits.max_message_bytes:
        return f"its generate request is {size} bytes, over the broker's max_message_bytes ({limits.max_message_bytes})"
    return ""


def generate(client: Client, task: str, record: PromptRecord, sampling: Sampling, seed: int | None = None) -> dict[str, Any]:
    """The policy's response to `record`'s prompt (text, or chat messages for the actor's chat template)."""
    text, messages = _prompt(record, sampling)
    return client.generate(
        task,
        text,
        messages=messages,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop=list(sampling.stop) or None,
        seed=seed,
    )


def item_for(record: PromptRecord, response: str) -> Item:
    return Item(prompt_text(record.prompt), response, record.ground_truth, record.data_source, record.extra_info, record.where)


def drive(
    frontend: str,
    records: Sequence[PromptRecord],
    order: PromptOrder,
    scorer: BatchingScorer,
    sampling: Sampling,
    workers: int = 4,
    start: int = 0,
    stop: threading.Event | None = None,
    limit: int | None = None,
    deadline_s: float = 300.0,
    progress: DriverProgress | None = None,
    seed: int = 0,
    make_client: Callable[..., Client] = Client,
    reward_timeout_s: float = 600.0,
    grouping: GroupAdvantage | None = None,
    samples: Samples | None = None,
) -> DriverProgress:
    """Drive `records` in `order` from position `start` until the order ends, `limit` positions were
    taken (with `grouping`, the group that reaches it is finished) or `stop` is set; the progress. A
    record the broker or actor refuses (a prompt over the model's context, messages its chat template
    refuses), whose response or turn missed its deadline, or whose session went away is counted
    unrewarded with the reason, and the worker goes on with a fresh task; any other error stops the
    worker that met them (its positions counted unrewarded, the reason in `progress.stopped_workers`),
    and the others go on.

    With `grouping` (GRPO), a worker takes the order's samples of one prompt together (one task each),
    and sends each response's group-relative advantage over the group's rewards instead of its reward;
    a group with fewer than two rewarded responses is not trained on (counted in `progress.lone`).

    With `samples`, each feedback carries its sample id, and the positions `samples.stored` (by an earlier
    run) are skipped; a group some of whose members were stored plays the others, their advantages taken
    over the group's rewards with the stored members' raw scores (`samples.scores`) among them."""
    stop = stop or threading.Event()
    stored = samples.stored if samples is not None else {}
    progress = progress or DriverProgress(start=start)
    positions = order.positions(start)
    taken = [0]
    take_lock = threading.Lock()
    held: list[tuple[int, int, int, int]] = []  # a position read past the end of a group, for the next one

    def next_group() -> tuple[list[tuple[int, PromptRecord]], list[float]]:
        """The next position to play, or with `grouping` the next positions of one prompt, less those an earlier
        run stored (counted done), with the raw scores of those stored members; ([], []) at the end."""
        with take_lock:
            while group := take():
                todo = [(position, record) for position, record in group if position not in stored]
                for position, _ in group:
                    if position in stored:
                        progress.skip(position)
                if todo:
                    scores = samples.scores if samples is not None else {}
                    return todo, [scores[position] for position, _ in group if position in stored and position in scores]
            return [], []

    def take() -> list[tuple[int, PromptRecord]]:
        """The next position, or with `grouping` the next positions of one prompt; [] at the end (under take_lock)."""
        group: list[tuple[int, PromptRecord]] = []
        prompt: tuple[int, int] | None = None  # (epoch, record index) of the group's prompt
        while group or (not stop.is_set() and (limit is None or taken[0] < limit)):  # a group is taken whole
            following = held.pop() if held else next(positions, None)
            if following is None:
                break
            position, epoch, index, _sample = following
            if group and (grouping is None or (epoch, index) != prompt):
                held.append(following)
                break
            prompt = (epoch, index)
            taken[0] += 1
            group.append((position, records[index]))
            if grouping is None:
                break
        return group

    def respond(client: Client, task: str, position: int, record: PromptRecord) -> tuple[str, dict[str, Any] | None]:
        """The policy's response to one position (None if the record's turn failed, counted); the task to go on with."""
        try:
            client.wait_turn(task)
            return task, generate(client, task, record, sampling, seed=seed * 1_000_003 + position)  # a run samples alike again
        except RECORD_ERRORS as e:  # this record's turn fails alone: counted, named, and the worker goes on
            progress.record(position, Scored(None, {}, error=f"{record.where}: {type(e).__name__}: {e}"), 0)
            return _reattach(client, task), None  # the session may be gone, or hold a pending step: start afresh

    def reward_of(record: PromptRecord, future: Future[Scored]) -> Scored:
        try:
            return future.result(timeout=reward_timeout_s)
        except FutureTimeout:
            return Scored(None, {}, error=f"{record.where}: no reward within {reward_timeout_s:g} s")
        except CancelledError:  # the run was interrupted before this response was scored (BatchingScorer.abandon)
            return Scored(None, {}, error=f"{record.where}: not scored, the run was stopping")

    def play(
        clients: list[Client],
        each: Callable[[Callable[[int], Any], list[int]], list[Any]],
        tasks: list[str],
        group: list[tuple[int, PromptRecord]],
        pending: set[int],
        known: list[float],
    ) -> None:
        """One group's turns (one position without `grouping`): responses, their rewards (all asked for
        before any is awaited, so a reward model batches them and a judge runs them at once), the feedback;
        the members' requests travel together (`each`, a client per member), so the actor takes a group's
        rows into one batch and computes their shared prompt once, and the broker writes their feedback at once;
        a turn with no reward (or alone in its group) is dropped without a transition, never trained on a
        made-up reward. `known`: raw scores of the group's members an earlier run stored, which count in
        the group's statistics. Positions leave `pending` as they are counted; on `stop`, turns not yet
        fed back are abandoned (left pending, never stored)."""
        if stop.is_set():
            return

        def ask(k: int) -> dict[str, Any] | None:
            tasks[k], reply = respond(clients[k], tasks[k], *group[k])
            return reply

        replies: dict[int, dict[str, Any]] = {}  # by member, those that got a response
        for k, reply in enumerate(each(ask, list(range(len(group))))):
            if reply is None:
                pending.discard(group[k][0])
            else:
                replies[k] = reply
        futures = {k: scorer.submit(item_for(group[k][1], reply["text"])) for k, reply in replies.items()}
        scored = {k: reward_of(group[k][1], future) for k, future in futures.items()}
        if stop.is_set():
            return
        rewards = {k: s.reward for k, s in scored.items() if s.reward is not None}
        sent = rewards
        if grouping is not None:
            pool = [*known, *rewards.values()]
            sent = dict(zip(rewards, grouping(pool)[len(known) :])) if rewards and len(pool) >= 2 else {}
            progress.count_group(pool)
            if sent and samples is not None:  # durable before any feedback: a group cut by a kill is completed with them
                samples.record_scores({group[k][0]: rewards[k] for k in sent})

        def send(k: int) -> None:
            position, record = group[k]
            client = clients[k]
            try:
                if k in sent:
                    client.feedback(tasks[k], sent[k], done=True, sample=samples.id(position) if samples is not None else None)
                else:  # the step is dropped without a transition
                    tasks[k] = _reattach(client, tasks[k])
                progress.record(position, scored[k], int(replies[k].get("n_tokens", 0)))
            except RECORD_ERRORS as e:
                progress.record(position, Scored(None, {}, error=f"{record.where}: {type(e).__name__}: {e}"), 0)
                tasks[k] = _reattach(client, tasks[k])
            pending.discard(position)

        each(send, list(replies))

    def work(worker: int) -> None:
        client = make_client(frontend, deadline=deadline_s)
        clients = [client]  # one per member of a group (a blocking client has one request out at a time)
        members: DaemonPool | None = None  # runs a group's requests at once

        def each(call: Callable[[int], Any], ks: list[int]) -> list[Any]:
            if len(ks) < 2 or members is None:
                return [call(k) for k in ks]
            return list(members.map(call, ks))  # an error other than the record's own raises here, as it would alone

        tasks: list[str] = []
        pending: set[int] = set()  # positions taken and not yet counted
        try:
            while True:
                group, known = next_group()
                if not group:
                    break
                pending = {position for position, _ in group}
                while len(tasks) < len(group):  # one task per response of a group: each holds one step
                    tasks.append(client.attach())
                while len(clients) < len(group):
                    clients.append(make_client(frontend, deadline=deadline_s))
                if len(group) > 1 and members is None:
                    members = DaemonPool(len(clients), f"driver-{worker}-member")
                play(clients, each, tasks, group, pending, known)
                if stop.is_set():
                    pending.clear()  # abandoned, not done: a resumed run plays them
                    break
        except PPOZError as e:
            log.error("driver worker %d stopped: %s", worker, e)
            for position in sorted(pending):  # taken but not done: counted, so the resume point moves past them
                progress.record(position, Scored(None, {}, error=f"worker {worker} stopped: {type(e).__name__}: {e}"), 0)
            with progress.lock:
                progress.stopped_workers.append(f"worker {worker}: {type(e).__name__}: {e}")
        finally:
            if members is not None:
                members.shutdown()
            for task in tasks:
                try:
                    client.detach(task)
                except PPOZError:
                    pass
            for each_client in clients:
                each_client.close()

    threads = [threading.Thread(target=work, args=(i,), name=f"driver-{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return progress


# Errors that concern one record's turn (the broker or actor refused it, its deadline passed, its
# session is gone, the broker is briefly full): the turn fails alone and the worker goes on.
RECORD_ERRORS = (BadRequest, TooLarge, RequestTimeout, UnknownTask, Overloaded)


def _reattach(client: Client, task: str) -> str:
    """Detach `task` (a pending step is dropped, never stored) and attach a fresh one."""
    _detach_quietly(client, task)
    return client.attach()


def validate(
    frontend: str,
    records: Sequence[PromptRecord],
    reward: CompositeReward,
    max_new_tokens: int,
    chat_template: bool = False,
    workers: int = 4,
    deadline_s: float = 300.0,
    make_client: Callable[..., Client] = Client,
) -> dict[str, Any]:
    """Greedy responses to every record, scored, and never trained on (each task is detached with its
    step pending, which the broker drops); the mean reward and how many could not be scored, with
    the first reasons. A record the actor refuses is not scored; an error no record causes raises
    ValidationError."""
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()
    indices = iter(range(len(records)))
    errors: list[str] = []  # errors that stopped a validation worker
    failed: list[str] = []  # records that could not be answered

    def work() -> None:
        client = make_client(frontend, deadline=deadline_s)
        try:
            while True:
                with lock:
                    i = next(indices, None)
                if i is None:
                    return
                record = records[i]
                task = client.attach()
                try:
                    greedy = Sampling(max_new_tokens=max_new_tokens, temperature=0.0, chat_template=chat_template)
                    reply = generate(client, task, record, greedy)
                except RECORD_ERRORS as e:  # this record is not scored; the others are
                    with lock:
                        failed.append(f"{record.where}: {type(e).__name__}: {e}")
                    continue
                finally:
                    _detach_quietly(client, task)
                with lock:
                    answers.append((i, reply["text"]))
        except PPOZError as e:
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
        finally:
            client.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise ValidationError(f"validation stopped: {errors[0]}")
    answers.sort()
    items = [item_for(records[i], text) for i, text in answers]
    scored = reward.score(items, raw=True)
    rewards = [s.reward for s in scored if s.reward is not None]
    return {
        "mean_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
        "scored": len(rewards),
        "unscored": len(scored) - len(rewards) + len(failed),
        "unscored_reasons": (failed + [s.error for s in scored if s.reward is None])[:5],
        "responses": [text for _, text in answers[:5]],
    }


class ValidationError(RuntimeError):
    """A validation pass that could not go on (the broker unreachable, say)."""


def _detach_quietly(client: Client, task: str) -> None:
    """Detach `task`; one already gone (expired) is fine."""
    try:
        client.detach(task)
    except UnknownTask:
        pass
