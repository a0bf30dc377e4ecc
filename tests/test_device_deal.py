"""`ppoz up` deals the machine's GPUs out, one per process where there are enough (ppoz/device_deal.py).

The machine's GPU count is faked (`visible_gpus`); the flags the deal produces are parsed by the real CLI into
the real component configs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError, load
from ppoz import device_deal
from ppoz.device_deal import deal


@pytest.mark.parametrize(
    ("gpus", "actors", "learner", "want_learner", "want_actors"),
    [
        (0, 2, True, "", ["", ""]),  # no GPU: every process on its own setting (auto: cpu)
        (1, 2, True, "cuda:0", ["cuda:0", "cuda:0"]),  # one GPU: all share it
        (8, 4, True, "cuda:0", ["cuda:1", "cuda:2", "cuda:3", "cuda:4"]),  # one each, three left idle
        (3, 4, True, "cuda:0", ["cuda:1", "cuda:2", "cuda:1", "cuda:2"]),  # the learner's GPU its own, actors round robin
        (2, 2, False, "", ["cuda:0", "cuda:1"]),  # no learner here: the actors take every GPU
        (2, 0, True, "cuda:0", []),
    ],
)
def test_the_deal_gives_each_process_a_gpu_of_its_own_where_there_are_enough(gpus, actors, learner, want_learner, want_actors):
    got = deal(gpus, actors, learner, "auto", "auto", [""])
    assert (got.learner, got.actors) == (want_learner, want_actors)


def test_the_summary_says_how_and_when_processes_share() -> None:
    assert deal(8, 2, True, "auto", "auto", [""]).summary == "8 GPU(s): learner cuda:0, actor-0 cuda:1, actor-1 cuda:2"
    shared = deal(1, 1, True, "auto", "auto", [""]).summary
    assert shared.startswith("1 GPU(s): learner cuda:0, actor-0 cuda:0; some share a GPU") and "actor_devices" in shared
    assert deal(0, 1, True, "auto", "auto", [""]).summary.startswith("no GPU visible")


def test_devices_that_are_set_are_kept() -> None:
    got = deal(4, 3, True, "auto", "auto", ["cuda:3", ""])  # actor_devices: actor 0 and 2 on cuda:3, actor 1 dealt
    assert got.actors == ["cuda:3", "cuda:1", "cuda:3"] and got.learner == "cuda:0"
    got = deal(4, 2, True, "cpu", "cuda:2", [""])  # [actor] device cpu, [learner] device cuda:2: as set
    assert got.actors == ["", ""] and got.learner == ""


@pytest.mark.parametrize(
    ("gpus", "actor_device", "learner_device", "actor_devices", "message"),
    [
        (2, "auto", "auto", ["cuda:0", "cuda:5"], r"device 'cuda:5': this machine has 2 GPU\(s\), cuda:0 to cuda:1"),
        (0, "cuda", "auto", [""], r"device 'cuda': this machine has no CUDA GPU"),
        (1, "auto", "cuda:1", [""], r"device 'cuda:1': this machine has 1 GPU\(s\)"),
        (2, "cuda:x", "auto", [""], r"device 'cuda:x': this machine has 2 GPU\(s\)"),
    ],
)
def test_a_gpu_the_machine_lacks_is_a_config_error(gpus, actor_device, learner_device, actor_devices, message) -> None:
    with pytest.raises(ConfigError, match=message):
        deal(gpus, 2, True, actor_device, learner_device, actor_devices)


class Recorder:
    """Takes the supervisor's place in `_started`: records each component's command line, starts nothing."""

    def __init__(self) -> None:
        self.argv: dict[str, list[str]] = {}
        self.env: dict[str, dict[str, str]] = {}

    def add(self, name: str, argv: list[str], env: Any = None) -> None:
        self.argv[name] = argv
        self.env[name] = dict(env or {})

    def start_all(self, on_started: Any) -> None:
        pass


@pytest.mark.parametrize("inherited", [None, "4,5,6,7"], ids=["every-gpu", "visible-subset"])
def test_ppoz_up_starts_each_component_on_its_dealt_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, inherited) -> None:
    """Each process sees its own GPU alone (CUDA_VISIBLE_DEVICES, of those `ppoz up` itself sees) as its cuda:0."""
    from actor_node.config import ActorConfig
    from common.shared_settings import StoreSettings
    from learner_node.config import LearnerConfig
    from ppoz.cli import build_parser
    from ppoz.up import UpConfig, _started

    monkeypatch.setattr(device_deal, "visible_gpus", lambda: 4)
    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited)
    config = tmp_path / "up.toml"
    config.write_text('[policy]\nmodel = "m"\n')
    actor = load(ActorConfig, str(config))
    learner = load(LearnerConfig, str(config), {"store.redis_url": "redis://embedded"})
    up = UpConfig(broker=False, actors=3)
    sup = Recorder()
    store = StoreSettings(redis_url="redis://127.0.0.1:1")
    with caplog.at_level(logging.INFO, logger="ppoz.up"):
        next(_started(up, sup, str(config), "info", store, None, actor, learner, None, [], []))  # started: the Stack
    assert "devices: 4 GPU(s): learner cuda:0, actor-0 cuda:1, actor-1 cuda:2, actor-2 cuda:3" in caplog.text
    parser = build_parser()
    gpus = inherited.split(",") if inherited else ["0", "1", "2", "3"]
    for name, cls, gpu in [("learner", LearnerConfig, 0), *((f"actor-{i}", ActorConfig, i + 1) for i in range(3))]:
        args = parser.parse_args(sup.argv[name][sup.argv[name].index("ppoz.cli") + 3 :])  # after "-m ppoz.cli --log-level info"
        assert load(cls, args.config, args).device == "cuda:0", name
        assert sup.env[name]["CUDA_VISIBLE_DEVICES"] == gpus[gpu], name
