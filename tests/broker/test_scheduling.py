"""The step queue's turns and admission (broker/scheduling.py), on hand-written sequences."""

from __future__ import annotations

import pytest

from broker.actors import Job
from broker.scheduling import FairQueue


def job(client: bytes, n: int) -> Job:
    return Job(n, f"task-{client.decode()}{n}", "step", f"r{n}", {}, [], deadline=1e9, created=0.0, client=client)  # never due


def names(jobs: list[Job]) -> list[str]:
    return [j.task_id.removeprefix("task-") for j in jobs]


def drain(queue: FairQueue) -> list[Job]:
    return [queue.popleft() for _ in range(len(queue))]


def test_clients_take_turns_one_job_each_in_order_of_arrival():
    queue = FairQueue()
    for n in range(5):
        queue.append(job(b"A", n))
    queue.append(job(b"B", 0))
    queue.append(job(b"B", 1))
    queue.append(job(b"C", 0))
    assert len(queue) == 8 and queue.clients() == 3 and queue.queued(b"A") == 5
    assert names(drain(queue)) == ["A0", "B0", "C0", "A1", "B1", "A2", "A3", "A4"]
    assert not queue and queue.clients() == 0 and queue.queued(b"A") == 0


def test_a_client_arriving_later_is_served_within_one_turn_of_the_others():
    queue = FairQueue()
    for n in range(100):
        queue.append(job(b"F", n))  # a flood
    assert names([queue.popleft(), queue.popleft()]) == ["F0", "F1"]
    queue.append(job(b"P", 0))  # a polite client's one request
    assert names([queue.popleft(), queue.popleft()]) == ["F2", "P0"]  # the flood's turn came first: it was due
    queue.append(job(b"P", 1))
    assert names([queue.popleft(), queue.popleft()]) == ["F3", "P1"]  # P, new to the turns again, waits one F job


def test_a_job_put_back_goes_first_and_its_client_first_in_turn():
    queue = FairQueue()
    for client in (b"A", b"B"):
        for n in range(2):
            queue.append(job(client, n))
    first = queue.popleft()  # A0
    assert names([first]) == ["A0"]
    second = queue.popleft()  # B0
    queue.appendleft(second)  # its actor was lost
    assert names(drain(queue)) == ["B0", "A1", "B1"]
    queue.appendleft(first)  # into an empty queue
    assert names(drain(queue)) == ["A0"]


def test_admission_past_the_limit_only_below_a_fair_share_and_never_past_twice_the_limit():
    queue, limit = FairQueue(), 4
    for n in range(4):
        assert queue.admits(b"F", limit)
        queue.append(job(b"F", n))
    assert not queue.admits(b"F", limit)  # the flood holds the whole queue
    assert queue.admits(b"P", limit)  # a newcomer's share is 4 // 2
    queue.append(job(b"P", 0))
    queue.append(job(b"P", 1))
    assert not queue.admits(b"P", limit)  # at its share
    assert queue.admits(b"Q", limit)  # share 4 // 3 = 1
    queue.append(job(b"Q", 0))
    assert not queue.admits(b"Q", limit)
    queue.append(job(b"R", 0))  # 8 = twice the limit, whatever the shares
    assert len(queue) == 8 and not queue.admits(b"S", limit)


@pytest.mark.parametrize("clients", [1, 3, 50])
def test_every_job_comes_out_once_and_each_client_keeps_its_own_order(clients):
    queue = FairQueue()
    pushed = [job(bytes([65 + c % 26]) * (1 + c // 26), n) for n in range(7) for c in range(clients)]
    for j in pushed:
        queue.append(j)
    out = drain(queue)
    assert sorted(id(j) for j in out) == sorted(id(j) for j in pushed)
    for c in {j.client for j in pushed}:
        assert [j.job_id for j in out if j.client == c] == list(range(7))
    # round-robin: in the first `clients` jobs out, every client once
    assert len({j.client for j in out[:clients]}) == clients


def test_popleft_due_takes_the_first_due_job_in_turn_order_and_sends_its_client_to_the_back():
    """Held steps (broker/backpressure.py) go on when due: the turn order decides among due ones, and a line's later
    jobs wait behind its first, however due they are."""
    queue = FairQueue()
    for client, n, created in ((b"A", 0, 5.0), (b"A", 1, 0.0), (b"B", 0, 1.0), (b"C", 0, 2.0)):
        queue.append(Job(n, f"task-{client.decode()}{n}", "step", f"r{n}", {}, [], deadline=1e9, created=created, client=client))

    def due(j: Job) -> bool:
        return j.created <= 2.0

    assert names([queue.popleft_due(due)]) == ["B0"]  # A's first is not due; A1 behind it waits
    assert names([queue.popleft_due(due)]) == ["C0"]
    assert queue.popleft_due(due) is None and len(queue) == 2
    assert names(drain(queue)) == ["A0", "A1"]
    queue.append(job(b"D", 0))
    queue.append(job(b"E", 0))
    assert names([queue.popleft_due(lambda j: True), queue.popleft()]) == ["D0", "E0"]
