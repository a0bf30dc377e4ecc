"""A full snapshot crosses hosts: a learner's host serves it (SnapshotServer), an actor's host fetches it through
its host cache, across a bridge between two network namespaces (`ppoz bench weights`' leg; needs root)."""

from __future__ import annotations

import pytest

from tools.bench.weights_hosts import run_hosts
from tools.reliability.farm_network import namespaces_unavailable

WHY_NOT = namespaces_unavailable()


@pytest.mark.timeout(600)
@pytest.mark.skipif(WHY_NOT is not None, reason=f"two hosts cannot be made here: {WHY_NOT}")
def test_a_full_snapshot_moves_from_the_learners_host_to_an_actors(tiny_models) -> None:
    result = run_hosts(tiny_models["qwen2"], chunk_mb=1, threads=2, repeats=1, deadline_s=300)
    assert result["moved"], "the actor's host got other weights than the learner's"
    assert result["hosts"]["learner"] != result["hosts"]["actor"]
    assert result["snapshot_gb"] > 0 and len(result["runs"]["snapshot"]) == 1
    assert result["tcp_gb_per_s"] > 0 and result["snapshot_gb_per_s"] > 0
