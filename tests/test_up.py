"""`ppoz up` as users run it: one real process supervising real component processes."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.processes import Up, alive, free_port, ppoz, status


def write_config(path: Path, front: int, back: int, weights: int, **extra: str) -> Path:
    lines = [
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nmax_stream_backlog = 16\n'
        "segment_len = 4\nheartbeat_ms = 200\n",
        f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\n',
    ]
    lines += [f"{key} = {value}\n" for key, value in extra.items()]
    path.write_text("".join(lines[2:]) + "".join(lines[:2]))
    return path


@pytest.mark.slow
def test_up_runs_the_whole_stack_restarts_a_killed_actor_and_stops_cleanly(tmp_path, tiny_models):
    front, back, weights = free_port(), free_port(), free_port()
    config = write_config(
        tmp_path / "up.toml", front, back, weights, model=f'"{tiny_models["llama"]}"', lora_rank="0", normalisation='"token"'
    )
    config.write_text(
        config.read_text() + f"rollout_batch = 8\npolicy_minibatch = 8\nmicro_batch = 8\nupdate_epochs = 1\n"
        f'checkpoint_dir = "{tmp_path / "ckpt"}"\ntensorboard_dir = ""\n'
        "[actor]\nweights_poll_s = 1.0\nheartbeat_ms = 200\n"
        '[up]\nactors = 1\nenv = "kea"\nenv_clients = 2\nstop_timeout_s = 60\n'
    )
    up = Up(config)
    try:
        # Wired together: the actor serves a version the learner trained and published.
        wait_for(
            lambda: (s := status(front)) and s["actors"] and s["actors"][0]["policy_version"] >= 1,
            timeout=240,
            what=f"the actor to serve a trained version\n{up.text()[-3000:]}",
        )
        for name in ("broker", "learner", "actor-0", "clients"):
            assert re.search(rf"^ *{name} \| ", up.text(), re.M), f"no log line prefixed with {name}"
        # `ppoz status` against the running stack: actors and load, sessions, speed, backlog, version and lag, losses.
        table = ppoz("status", "--broker", f"tcp://127.0.0.1:{front}", timeout=60)
        assert table.returncode == 0, table.stderr
        assert "sessions 2" in table.stdout and "steps/s" in table.stdout and "stream backlog" in table.stdout
        assert re.search(r"actor-0 +load \d+/\d+  policy v\d+  lag \d+", table.stdout), table.stdout
        assert re.search(r"learner: policy v[1-9]\d* after \d+ updates; last update: .*policy_loss", table.stdout), table.stdout
        actor = up.pid("actor-0")
        assert actor is not None
        # Each torch process gets its share of the cores, not all of them each (they would fight over them).
        expected = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
        for pid in (actor, up.pid("learner")):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={expected}".encode() in environ
        os.kill(actor, signal.SIGKILL)
        wait_for(lambda: up.pid("actor-0", 2), timeout=60, what="actor-0 to be restarted")
        assert "actor-0 died (killed by SIGKILL); its last lines:" in up.text()
        wait_for(
            lambda: (s := status(front)) and len(s["actors"]) == 1 and s["actors"][0]["served"] > 0 and "actor-0" in s["actors"][0]["name"],
            timeout=120,
            what="the restarted actor to serve",
        )
        children = [up.pid(name) for name in ("broker", "learner", "clients")] + [up.pid("actor-0", 2)]
    finally:
        code = up.stop()
    assert code == 0, up.text()[-3000:]
    assert all(pid is not None and not alive(pid) for pid in children)
    for name in ("clients", "actor-0", "learner", "broker"):
        assert f"stopped {name} (exit code 0)" in up.text(), up.text()[-3000:]
    order = [up.text().index(f"stopped {name} (exit code") for name in ("clients", "actor-0", "learner", "broker")]
    assert order == sorted(order), "components must stop clients first, broker last"


def test_thread_env_shares_the_cores_among_the_torch_processes(monkeypatch):
    from ppoz.up import thread_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert thread_env(0, 3) == {"OMP_NUM_THREADS": "5"}  # an actor per 5 cores and the learner: 15 of 16
    assert thread_env(0, 20) == {"OMP_NUM_THREADS": "1"}
    assert thread_env(4, 3) == {"OMP_NUM_THREADS": "4"}  # [up] cpu_threads as given
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert thread_env(0, 3) == {}  # the user's own setting stands


def test_the_components_get_the_store_of_up_over_the_files(tmp_path):
    """`ppoz up --key-prefix X` (or the embedded Redis's URL) reaches every component it starts, over the file's [store]."""
    from actor_node.config import ActorConfig
    from broker.config import BrokerConfig
    from common.config import load
    from common.shared_settings import StoreSettings
    from learner_node.config import LearnerConfig
    from ppoz.cli import build_parser
    from ppoz.up import store_flags

    config = tmp_path / "up.toml"
    config.write_text('[store]\nkey_prefix = "file"\nstream_key = "file-stream"\n[policy]\nmodel = "m"\n')
    store = StoreSettings(redis_url="unix:///tmp/r.sock", key_prefix="up", stream_key="s", consumer_group="g")
    for command, cls in (("broker", BrokerConfig), ("actor", ActorConfig), ("learner", LearnerConfig)):
        args = build_parser().parse_args([command, "--config", str(config), *store_flags(store)])
        assert load(cls, args.config, args).store == store, command


@pytest.mark.slow
def test_up_stops_everything_when_a_component_dies_and_on_failure_is_stop(tmp_path):
    front, back, weights = free_port(), free_port(), free_port()
    config = write_config(tmp_path / "up.toml", front, back, weights)
    up = Up(config, "--no-learner", "--actors", "2", "--on-failure", "stop")  # uniform-policy actors, no model needed
    try:
        wait_for(lambda: (s := status(front)) and len(s["actors"]) == 2, timeout=60, what=f"two actors\n{up.text()[-2000:]}")
        os.kill(up.pid("actor-1"), signal.SIGKILL)
        assert up.proc.wait(60) == 1
    finally:
        up.stop()
    text = up.text()
    assert "actor-1 died (killed by SIGKILL)" in text and "stopping everything: actor-1 died and on_failure is stop" in text
    assert "ppoz up: stopped because actor-1 died" in text
    assert not alive(up.pid("broker")) and not alive(up.pid("actor-0"))


def test_up_starts_a_curve_farm_its_readiness_reported_by_the_broker_itself(tmp_path):
    """docs/farm.md's example is secure by default, so `ppoz up` must start a CURVE broker: it waits for the broker's
    own READY=1 on a notify socket, not for an answer to a ping it could not send without keys (before: the ping
    went unanswered until `ready_timeout_s` and the stack stopped)."""
    import shutil

    from client import Client
    from common.security import generate_keypair

    keys, allowed_clients, allowed_actors = tmp_path / "keys", tmp_path / "allowed-clients", tmp_path / "allowed-actors"
    for name in ("broker", "actor", "emulator"):
        generate_keypair(keys, name)
    allowed_clients.mkdir()
    allowed_actors.mkdir()
    shutil.copy(keys / "emulator.key", allowed_clients)
    shutil.copy(keys / "actor.key", allowed_actors)
    front, back, weights = free_port(), free_port(), free_port()
    config = write_config(tmp_path / "up.toml", front, back, weights)
    config.write_text(
        config.read_text().replace(
            "heartbeat_ms = 200\n",
            f'heartbeat_ms = 200\ncurve_secret_key = "{keys / "broker.key_secret"}"\n'
            f'curve_allowed_clients = "{allowed_clients}"\ncurve_allowed_actors = "{allowed_actors}"\n',
        )
        + f'[actor]\ncurve_secret_key = "{keys / "actor.key_secret"}"\ncurve_broker_key = "{keys / "broker.key"}"\n'
        + "[up]\nready_timeout_s = 20\n"
    )
    up = Up(config, "--no-learner", "--actors", "1")
    try:
        with Client(
            f"tcp://127.0.0.1:{front}",
            deadline=5,
            curve_secret_key=str(keys / "emulator.key_secret"),
            curve_server_key=str(keys / "broker.key"),
        ) as client:
            wait_for(lambda: len(client.status()["actors"]) == 1, timeout=60, what=f"the CURVE actor\n{up.text()[-2000:]}")
        assert up.proc.poll() is None, up.text()[-2000:]
    finally:
        assert up.stop() == 0, up.text()[-2000:]
    assert "did not report ready" not in up.text()
