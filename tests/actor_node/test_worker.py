"""The actor loop over a real link: requests that arrive during a forward are batched into the next one."""

from __future__ import annotations

import threading
import time

from actor_node.policies import UniformPolicy
from tests.helpers import OBS, actors_ready, wait_for


class SlowFirstBatch(UniformPolicy):
    """The uniform policy, with a first batch that takes a while (a long forward)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.batches: list[int] = []

    def choose_batch(self, jobs):
        self.batches.append(len(jobs))
        if len(self.batches) == 1:
            time.sleep(1.0)
        return super().choose_batch(jobs)


def test_requests_waiting_during_a_forward_form_the_next_batch(broker, start_actor, make_client):
    policy = SlowFirstBatch()
    start_actor(broker.backend, credits=16, policy=policy)
    probe = make_client(broker.frontend)
    wait_for(lambda: actors_ready(probe, 1), what="the actor")
    replies = []
    first = make_client(broker.frontend)
    threading.Thread(target=lambda: replies.append(first.step(first.attach(), OBS)), daemon=True).start()
    wait_for(lambda: policy.batches, what="the first forward to start")
    threads = []
    for _ in range(5):
        c = make_client(broker.frontend)
        threads.append(threading.Thread(target=lambda c=c: replies.append(c.step(c.attach(), OBS)), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(15)  # answered after the first batch's 1 s sleep (a timer) and ms of work; x15
    wait_for(lambda: len(replies) == 6, what="all six replies")
    assert policy.batches == [1, 5]
