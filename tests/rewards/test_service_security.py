"""The reward service on a shared network: loopback unless CURVE is on, CURVE with the broker's keys and tooling,
and a ping that says only what a client needs (issue 30)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.security import ALLOW_ANY, generate_keypair, is_local_endpoint
from dataset_driver.config import TrainConfig
from dataset_driver.run import _service_sources
from rewards.config import RewardServiceConfig
from rewards.service import RewardServiceClient, RewardServiceError
from tests.processes import PPOZ
from tests.rewards.test_service import local_judge, serving
from tools.bench.judge_stand_in import chat_server


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5560", True),
        ("tcp://127.9.8.7:*", True),
        ("tcp://localhost:5560", True),
        ("tcp://[::1]:5560", True),
        ("ipc:///tmp/rewards.sock", True),
        ("tcp://0.0.0.0:5560", False),
        ("tcp://*:5560", False),
        ("tcp://10.0.0.5:5560", False),
        ("tcp://eth0:5560", False),
        ("tcp://127.0.0.1.evil.example:5560", False),
        ("tcp://127.0.0:5560", False),
    ],
)
def test_which_endpoints_only_this_machine_can_reach(endpoint, local) -> None:
    assert is_local_endpoint(endpoint) is local


def test_a_service_reachable_from_other_machines_is_refused_without_curve(tmp_path) -> None:
    for bind in ("tcp://0.0.0.0:5560", "tcp://*:5560", "tcp://10.0.0.5:5560"):
        with pytest.raises(ValueError, match=r"bind = .* is reachable from other machines.*set curve_secret_key"):
            RewardServiceConfig(judge_model="j", bind=bind)
    RewardServiceConfig(judge_model="j")  # the default: loopback
    _, secret = generate_keypair(tmp_path, "rewards")
    RewardServiceConfig(judge_model="j", bind="tcp://0.0.0.0:5560", curve_secret_key=str(secret), curve_allowed_clients=ALLOW_ANY)
    with pytest.raises(ValueError, match="curve_allowed_clients` is required"):
        RewardServiceConfig(judge_model="j", bind="tcp://0.0.0.0:5560", curve_secret_key=str(secret))


def test_the_command_refuses_to_start_on_every_address_without_curve() -> None:
    done = subprocess.run(
        [*PPOZ, "reward-server", "--judge-model", "j", "--bind", "tcp://0.0.0.0:5560"],
        capture_output=True,
        text=True,
        timeout=120,  # refused at start: 2-3 s alone; x40
    )
    assert done.returncode != 0 and "is reachable from other machines" in done.stderr, done.stderr[-2000:]


def test_with_curve_only_drivers_whose_keys_are_allowed_are_answered(tmp_path: Path) -> None:
    _, service_secret = generate_keypair(tmp_path / "service", "rewards")
    allowed = tmp_path / "allowed"
    driver_public, driver_secret = generate_keypair(tmp_path / "drivers", "driver")
    allowed.mkdir()
    (allowed / driver_public.name).write_bytes(driver_public.read_bytes())
    _, stranger_secret = generate_keypair(tmp_path / "others", "stranger")
    service_public = tmp_path / "service" / "rewards.key"
    with chat_server(lambda body, n: "Score: 1") as api:
        settings = dict(curve_secret_key=str(service_secret), curve_allowed_clients=str(allowed))
        with serving(judge=local_judge(api.base_url), **settings) as service:
            cfg = TrainConfig(
                data="d.jsonl",
                reward_service=service.endpoint,
                reward_service_curve_key=str(service_public),
                reward_service_curve_secret_key=str(driver_secret),
                reward_service_retries=0,
            )
            weights, rm, judge = _service_sources(cfg)  # the drivers' own path: the probe, then a client per component
            assert weights == {"judge_score": 1.0} and rm is None
            assert [v.reward for v in judge.judge_many([("p", "r", "1"), ("q", "s", "2")])] == [1.0, 1.0]
            judge.close()

            for who, keys in [
                ("plain", None),
                (
                    "a key not in the allow-list",
                    TrainConfig(
                        data="d",
                        reward_service="x",
                        reward_service_curve_key=str(service_public),
                        reward_service_curve_secret_key=str(stranger_secret),
                    ).reward_service_keys(),
                ),
                (
                    "a fresh pair",
                    TrainConfig(data="d", reward_service="x", reward_service_curve_key=str(service_public)).reward_service_keys(),
                ),
            ]:
                # a look for an answer that must not come (a refused key): 0.5 s, where an allowed one is answered in ms
                client = RewardServiceClient(service.endpoint, timeout_s=0.5, retries=0, curve=keys)
                try:
                    client.request("judge", items=[["p", "r", "1"]])
                    pytest.fail(f"a driver with {who} was answered")
                except RewardServiceError as e:
                    assert "did not answer" in str(e), who
                finally:
                    client.close()
            assert service.counts["answered/judge"] == 1, f"only the allowed driver was judged: {service.counts}"
    assert len(api.requests) == 2


def test_ping_says_what_a_client_needs_and_not_where_the_models_are(tmp_path) -> None:
    with chat_server(lambda body, n: "Score: 1") as api, serving(judge=local_judge(api.base_url)) as service:
        client = RewardServiceClient(service.endpoint, timeout_s=5.0, retries=0)  # ms; x1000
        reply = client.ping()
        client.close()
    assert set(reply) == {"op", "rid", "components", "max_items"}
    assert reply["components"] == ["judge_score"] and reply["max_items"] == 1024


def test_the_drivers_keys_are_checked_at_start(tmp_path) -> None:
    _, secret = generate_keypair(tmp_path, "driver")
    with pytest.raises(ValueError, match="`reward_service_curve_key` is empty"):
        TrainConfig(data="d.jsonl", reward_service="tcp://r:5560", reward_service_curve_secret_key=str(secret))
    with pytest.raises(ValueError, match="reward_service_curve_key"):
        TrainConfig(data="d.jsonl", reward_service="tcp://r:5560", reward_service_curve_key=str(tmp_path / "missing.key"))
