"""What `ppoz bench broker` (tools/bench/broker.py) reads beside its load: the CPU seconds of its processes,
the broker's own account of the latency it adds, and what writing one turn's batch costs the broker."""

from __future__ import annotations

import os
import time
from typing import Any


def commit_costs(url: str, obs: dict[str, Any], pairs: int = 100, rounds: int = 30) -> dict[str, float]:
    """Broker-side CPU per step+feedback pair of writing a turn's batch, both ways, on one Redis (each step's
    observation `obs`).

    `pipeline`: the same commands through a redis-py MULTI/EXEC pipeline;
    `lua_batch`: the broker's way (broker/store.py: one atomic script call per turn).
    """
    import msgpack

    from broker.sessions import Replied
    from broker.store import Batch, SessionStore
    from common.redis_server import connect
    from common.segments import RedisKeys

    client = connect(url)
    store = SessionStore(client, RedisKeys("bench-commit"), "learners")
    keys = store.keys
    transition = msgpack.packb({"obs": obs, "action": 1, "logprob": -1.6, "probs": [0.2] * 5, "reward": 0.5})
    replied = Replied(1, b"rid", b"r" * 120)  # the kept reply, as the broker writes it with each feedback
    kept = (replied.field, msgpack.packb(replied.to_wire()))

    def pipeline_round() -> None:
        pipe = client.pipeline(transaction=True)
        for i in range(pairs):
            pipe.hset(keys.task(f"t{i}"), "pending", transition)
            pipe.rpush(keys.open_segment(f"t{i}"), transition)
            pipe.hset(keys.task(f"t{i}"), mapping={"pending": b"", kept[0]: kept[1]})
        pipe.execute()

    def lua_round() -> None:
        batch = Batch()
        for i in range(pairs):
            batch.add("HSET", keys.task(f"t{i}"), "pending", transition)
            batch.add("RPUSH", keys.open_segment(f"t{i}"), transition)
            batch.add("HSET", keys.task(f"t{i}"), "pending", b"", *kept)
        store.apply(batch)

    costs = {}
    for name, one_round in (("pipeline", pipeline_round), ("lua_batch", lua_round)) * 2:  # second pass counts
        start = time.process_time()
        for _ in range(rounds):
            one_round()
        costs[name] = round((time.process_time() - start) / (rounds * pairs) * 1e6, 1)
    for key in client.scan_iter("bench-commit:*"):
        client.delete(key)
    client.close()
    return costs


def cpu_seconds(pids: dict[str, Any]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each component's processes, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        total = 0.0
        for one in pid if isinstance(pid, list) else [pid]:
            if one is None:
                continue
            try:
                with open(f"/proc/{one}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except OSError:
                pass
        out[name] = total
    return out


def broker_added_latency(frontend: str, window_s: float) -> dict[str, float]:
    """The broker's own account of the time step and feedback replies spent inside it."""
    from client import Client

    with Client(frontend, deadline=5) as c:
        return c.request("status", window_s=window_s)["added_latency"]
