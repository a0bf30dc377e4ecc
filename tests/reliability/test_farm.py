"""The farm across hosts (`ppoz bench farm`): six network namespaces, links cut, Redis killed; needs root."""

from __future__ import annotations

import json

import pytest

from tests.processes import ppoz
from tools.reliability.farm_network import Network, namespaces_unavailable
from tools.reliability.farm_processes import learner_updates
from tools.reliability.farm_report import RECOVERIES, Phase, Report, format_report

WHY_NOT = namespaces_unavailable()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 3 minutes on a quiet 2-core machine; the suite runs beside it
@pytest.mark.skipif(WHY_NOT is not None, reason=f"the multi-host farm cannot run here: {WHY_NOT}")
def test_a_farm_on_six_hosts_heals_from_cut_links_and_a_killed_redis(tmp_path):
    """Redis+broker, two actors, a learner of two ranks on two hosts (torchrun --nnodes 2) and the clients,
    each in its own namespace. actor-a's link is cut for 30 s, learn-1's during an update, Redis is SIGKILLed."""
    farm = ["bench", "farm", "--phase-s", "10", "--learner-cut-s", "15", "--deadline-s", "1200", "--json", "--keep", str(tmp_path)]
    run = ppoz(*farm, timeout=1500)  # the bench ends itself (cleaning up) at its deadline, before this
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["failures"] == []
    # Every host was a namespace of its own, on one subnet.
    assert sorted(report["hosts"]) == sorted(["store", "actor-a", "actor-b", "learn-0", "learn-1", "clients"])
    assert len(set(report["hosts"].values())) == 6
    phases = {phase["name"]: phase for phase in report["phases"]}
    assert list(phases) == ["steady", "actor-a cut off", "actor-a back", "learn-1 cut off", "learn-1 back", "redis down", "redis back"]
    # While actor-a was cut off, actor-b served the clients alone; afterwards both served again.
    cut = phases["actor-a cut off"]
    assert cut["seconds"] >= 30
    assert report["actor_a_served_cut_off"] == 0 and cut["served"]["actor-b"] > 0 and cut["client_steps"] > 0
    assert phases["learn-1 back"]["served"]["actor-a"] > 0 and phases["learn-1 back"]["served"]["actor-b"] > 0
    # learn-1 went away in the middle of an update (its start logged, its end not yet): no version came until it was back.
    assert report["cut_update"] > 0 and report["learner_held_during_cut"]
    # Clients saw no failure, only what the protocol documents: asks answered `wait` while the learner or
    # Redis was away (and resends on `overloaded`, `internal` or a lost reply, counted in `retries`).
    assert report["error_count"] == 0 and report["ask_waits"] > 0
    assert report["steps"] > 0 and report["acknowledged"] == report["steps"]
    assert report["ledger_balanced"], report["ledger"]
    assert report["final_version"] > 0 and report["actor_versions"] == {
        "actor-a": report["final_version"],
        "actor-b": report["final_version"],
    }
    for name in ("broker", "redis", "actor-a", "actor-b", "learn-0", "learn-1"):
        assert (tmp_path / f"{name}.log").exists()
    assert "silent" in (tmp_path / "actor-a.log").read_text()  # it noticed the cut, and reconnected


@pytest.mark.skipif(WHY_NOT is not None, reason=f"the multi-host farm cannot run here: {WHY_NOT}")
def test_a_host_that_cannot_reach_the_store_is_named_before_anything_starts():
    """The check that runs before the stack: every host reaches the store across the bridge, and one whose
    link is down (as bridged traffic a firewall drops) is named, and only that one."""
    net = Network().create()
    try:
        assert net.unreachable("store") == []
        net.cut("actor-a")
        # each probe's connect: ms across the bridge where the link is up (x1000); the cut host's is the one that times out
        assert net.unreachable("store", timeout_s=1.0) == ["actor-a"]
        net.restore("actor-a")
        assert net.unreachable("store") == []
    finally:
        net.destroy()


def test_the_network_names_fit_linux_and_hosts_get_distinct_addresses():
    net = Network()
    assert all(len(name) <= 15 for name in [net.bridge, *net.links.values()])  # IFNAMSIZ - 1
    assert len(set(net.addresses.values())) == len(net.addresses) == 6
    assert all(address.startswith(net.subnet + ".") for address in net.addresses.values())


def passing_report(**changes) -> Report:
    report = Report(
        hosts={"store": "10.0.0.1"},
        clients=2,
        phases=[Phase("steady", 10.0, {"actor-a": 20, "actor-b": 10}, 30, (1, 3), 0.0, 10.0)],
        recovery_s={what: 1.0 for what in RECOVERIES},
        steps=30,
        acknowledged=30,
        ledger="balanced",
        ledger_balanced=True,
        learner_held_during_cut=True,
        cut_update=7,
        actor_a_served_cut_off=0,
        final_version=4,
        actor_versions={"actor-a": 4, "actor-b": 4},
    )
    for key, value in changes.items():
        setattr(report, key, value)
    return report


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({}, None),
        ({"actor_versions": {"actor-a": 4, "actor-b": 3}}, "do not serve the newest version 4"),
        ({"actor_versions": {"actor-a": 4}}, "do not serve the newest version 4"),
        ({"error_count": 1, "errors": ["RequestTimeout: x"]}, "1 client requests failed"),
        ({"ledger_balanced": False, "ledger": "stored 5, trained 4"}, "ledger not balanced"),
        ({"recovery_s": {"actor rejoined": 1.0}}, "never: actor serving again"),
        ({"cut_update": 0}, "not cut off during an update"),
        ({"learner_held_during_cut": False}, "a version was published while learn-1 was cut off"),
        ({"actor_a_served_cut_off": 3}, "actor-a answered 3 jobs"),
        ({"stuck": "the farm did not reach this within 120 s: actor-a to rejoin"}, "stopped early: the farm did not reach"),
    ],
)
def test_the_report_fails_on_each_finding(changes, said):
    report = passing_report(**changes)
    failures = report.failures()
    text = format_report(report)
    if said is None:
        assert failures == [] and text.endswith("PASS")
        assert "2.00     1.00     3.00" in text  # steps per second: actor-a, actor-b, clients
    else:
        assert any(said in f for f in failures), failures
        assert "FAIL: " in text


def test_the_learner_s_updates_are_read_from_its_log_start_and_end():
    log = "\n".join(
        [
            "2026-11-26 21:00:09,415 INFO learner_node.worker: update 21: version 18, 37 transitions, return 0.625",
            "2026-11-26 21:00:09,500 INFO learner_node.worker: update 22: training on 5 transitions from 3 segments (0 older ...)",
            "[rank0]: noise",
            "2026-11-26 21:00:10,810 INFO learner_node.worker: update 22: version 19, 5 transitions, return 2.167",
            "2026-11-26 21:00:11,000 INFO learner_node.worker: update 23: training on 0 transitions from 2 segments (9 older ...)",
        ]
    )
    updates = learner_updates(log)
    assert set(updates) == {21, 22, 23}
    assert updates[22]["transitions"] == 5 and updates[22]["end"] > updates[22]["start"]
    assert "start" not in updates[21] and "end" not in updates[23] and updates[23]["transitions"] == 0
