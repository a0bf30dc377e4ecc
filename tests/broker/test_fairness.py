"""Fair between clients: one client's flood of steps does not hold back another client's (issue 30, defect 5).

A real broker, a real actor that takes 20 ms a batch and records the order in
which it scores jobs, a flooding client that queues hundreds of steps at once on
one socket, and a polite client stepping one at a time on its own. Measured in
jobs, not seconds: how many of the flood's jobs the actor scored between the
polite client's send and its own job. First come, first served scored the whole
flood first (hundreds); round-robin across clients scores at most the jobs
already on their way (a batch's worth of credits) plus one.
"""

from __future__ import annotations

import threading
import time

import zmq

from actor_node.policies import UniformPolicy
from common import protocol as p
from tests.helpers import OBS, actors_ready, wait_for

CREDITS = 4


class Recording(UniformPolicy):
    """Scores like the uniform policy, 20 ms a batch (a model's forward), noting each job's task in order."""

    def __init__(self) -> None:
        super().__init__(0)
        self.scored: list[str] = []
        self.lock = threading.Lock()

    def choose_batch(self, jobs):
        time.sleep(0.02)
        with self.lock:
            self.scored.extend(job["task_id"] for job in jobs)
        return super().choose_batch(jobs)


def test_a_flooding_client_delays_a_polite_one_by_at_most_a_batch(start_broker, start_actor, make_client, zmq_context):
    broker = start_broker(request_timeout_ms=60_000)  # 401 steps at 20 ms a batch of CREDITS: a few s alone; x10 and more
    policy = Recording()
    start_actor(broker.backend, credits=CREDITS, policy=policy)
    polite = make_client(broker.frontend)
    wait_for(lambda: actors_ready(polite, 1), what="the actor")
    flood_tasks = [polite.attach() for _ in range(400)]
    mine = polite.attach()
    flood = zmq_context.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(broker.frontend)
    for n, task in enumerate(flood_tasks):
        flood.send_multipart([b"", p.encode(p.header("step", f"f{n}") | {"task_id": task, "obs": OBS})])
    wait_for(lambda: polite.status()["queued_jobs"] >= 300, what="the flood queued")
    overtaken = []
    for _ in range(5):
        with policy.lock:
            before = len(policy.scored)
        polite.step(mine, OBS)
        polite.feedback(mine, reward=1.0, done=False)
        with policy.lock:
            scored = policy.scored[before:]
        assert mine in scored, "the polite step was not scored after it was sent"
        overtaken.append(scored.index(mine))
    # jobs already dispatched when the polite step came (up to the credits), then at most one flood job ahead of it
    assert max(overtaken) <= CREDITS + 1, f"flood jobs scored ahead of each polite step: {overtaken}"
    with policy.lock:
        flood_left = len(flood_tasks) - sum(t != mine for t in policy.scored)
    assert flood_left > 100, f"the flood ran dry ({flood_left} left) before the polite client finished: the test proves nothing"
    flood.close(linger=0)
