"""Which snapshot an actor is told to load: newer versions of its run, any version of a new run, and a
refused snapshot only once its bytes change (a real redis-server holds the snapshots)."""

from __future__ import annotations

import torch

from actor_node.weight_follower import WeightFollower
from common import weights


def snapshot(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), value)}


def test_newer_versions_new_runs_and_a_refused_snapshot_not_offered_again(redis_client, key_prefix) -> None:
    follower = WeightFollower(redis_client, key_prefix, poll_s=0.0)
    assert follower.newest(0.0, current=0, current_run="") is None  # nothing stored yet
    weights.store_snapshot(redis_client, key_prefix, 3, snapshot(1.0), "lora", run="run-a")
    found = follower.newest(1.0, current=0, current_run="")
    assert found is not None and (found.run, found.version) == ("run-a", 3)
    assert follower.newest(2.0, current=0, current_run="") == found  # kept as waiting until taken
    follower.take(found)
    assert follower.newest(3.0, current=3, current_run="run-a") is None  # the one it serves
    # A new run at a lower version is followed (a learner restarted without --resume).
    weights.store_snapshot(redis_client, key_prefix, 1, snapshot(2.0), "lora", run="run-b")
    found = follower.newest(4.0, current=3, current_run="run-a")
    assert found is not None and (found.run, found.version) == ("run-b", 1)
    # The actor could not load it (another model's adapter, say): the same bytes are not offered again, at any poll.
    follower.take(found, loaded=False)
    for now in (5.0, 6.0, 7.0):
        assert follower.newest(now, current=3, current_run="run-a") is None
    # Its repair (the same run and version, other bytes) and a later version are offered.
    weights.store_snapshot(redis_client, key_prefix, 1, snapshot(3.0), "lora", run="run-b")
    repaired = follower.newest(8.0, current=3, current_run="run-a")
    assert repaired is not None and repaired.version == 1 and repaired.checksum != found.checksum
    follower.take(repaired, loaded=False)
    weights.store_snapshot(redis_client, key_prefix, 2, snapshot(3.0), "lora", run="run-b")
    later = follower.newest(9.0, current=3, current_run="run-a")
    assert later is not None and later.version == 2
