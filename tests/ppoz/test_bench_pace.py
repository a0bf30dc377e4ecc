"""Clients that never ask, faster than the learner trains, against a real `ppoz up` stack (`ppoz bench pace`): half
of them through the gateway's PPOAPI routes with `requests` as the Kea fork calls them, half with the protocol's own
`step`; none asks, none sends `done`. The broker holds them to the learner's pace: at most 5% of what the learner
stores is dropped as older than its lag bound, and every step is answered within its deadline.

The stack is small so that staleness shows within a few updates: rollouts of 16, a lag bound of 4 and 8-transition
segments. Without the broker's hold and age closes (`--legs before`, the broker as before issue 55), the same run
drops most of what it stores (docs/benchmarks.md, "Clients that never ask")."""

from __future__ import annotations

import json

import pytest

from tests.processes import ppoz


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_clients_that_never_ask_lose_at_most_5_percent_to_staleness_and_are_answered_in_time(tmp_path):
    flags = ["--clients", "4", "--legs", "after", "--updates", "8", "--rollout-batch", "16", "--max-policy-lag", "4", "--segment-len", "8"]
    # the stack's start (15-25 s alone) and eight updates of 16 (2-4 s each): under 60 s alone; x12
    run = ppoz("bench", "pace", *flags, "--json", timeout=720, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (leg,) = json.loads(run.stdout.strip().splitlines()[-1])["legs"]
    assert leg["updates"] >= 8 and leg["errors"] == 0, leg
    assert leg["steps_held"] > 0, f"the clients never outran the learner: nothing to hold them back from ({leg})"
    assert leg["stored"] >= 8 * 16 and leg["stale_share"] <= 0.05, leg
    assert leg["step_s_max"] < leg["deadline_s"], leg
