"""`ppoz up` as users run it: one real process supervising real component processes."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.processes import Up, alive, free_port, ppoz, status

FIGURE = r"-?\d+(\.\d+)?(e[-+]\d+)?"  # a finite figure as `ppoz status` writes it ({:.4g})


def last_update(table: str, *names: str) -> bool:
    """`ppoz status` says the learner updated and shows these figures of its last update, in this order, and no other."""
    line = re.search(r"learner: policy v[1-9]\d* after [1-9]\d* updates; last update: (.*)", table)
    return bool(line and re.fullmatch("  ".join(f"{name} {FIGURE}" for name in names), line.group(1)))


def write_config(path: Path, front: int, back: int, weights: int, **extra: str) -> Path:
    lines = [
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nmax_stream_backlog = 64\n'
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
        '[up]\nactors = 1\nenv = "kea"\nenv_clients = 2\nstop_timeout_s = 60\n'  # a component's exit: 1-5 s alone; x12
    )
    up = Up(config)
    try:
        # Wired together: the actor serves a version the learner trained and published. The stack's start (two torch
        # processes at once), a rollout of 8, an update and the actor's next poll: 20-25 s alone (the test: 53 s); x10
        wait_for(
            lambda: (s := status(front)) and s["actors"] and s["actors"][0]["policy_version"] >= 1,
            timeout=240,
            what=f"the actor to serve a trained version\n{up.text()[-3000:]}",
        )
        for name in ("broker", "learner", "actor-0", "clients"):
            assert re.search(rf"^ *{name} \| ", up.text(), re.M), f"no log line prefixed with {name}"
        # `ppoz status` against the running stack: actors and load, sessions, speed, backlog, version and lag, losses.
        table = ppoz("status", "--broker", f"tcp://127.0.0.1:{front}", timeout=60)  # no torch: under 1 s alone; x60
        assert table.returncode == 0, table.stderr
        assert "sessions 2" in table.stdout and "steps/s" in table.stdout and "stream backlog" in table.stdout
        assert re.search(r"actor-0 +load \d+/\d+  policy v\d+  lag \d+", table.stdout), table.stdout
        # The last update's figures, as the candidate learner reports them (issue 41: both kinds of policy show theirs).
        assert last_update(table.stdout, "policy_loss", "value_loss", "entropy", "approx_kl", "kl_ref", "clipfrac"), table.stdout
        actor = up.pid("actor-0")
        assert actor is not None
        # Each torch process gets its share of the cores, not all of them each (they would fight over them).
        expected = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
        for pid in (actor, up.pid("learner")):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={expected}".encode() in environ
        os.kill(actor, signal.SIGKILL)
        wait_for(lambda: up.pid("actor-0", 2), timeout=60, what="actor-0 to be restarted")  # the 1 s back-off, a timer; x60
        assert "actor-0 died (killed by SIGKILL); its last lines:" in up.text()
        wait_for(  # the restarted actor process: torch, the model, its first steps; TORCH_START_S
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
        # a broker and two uniform actors, which import torch (2-5 s alone each, side by side): x12
        wait_for(lambda: (s := status(front)) and len(s["actors"]) == 2, timeout=60, what=f"two actors\n{up.text()[-2000:]}")
        os.kill(up.pid("actor-1"), signal.SIGKILL)
        assert up.proc.wait(60) == 1  # up stops the others, one by one (no model, nothing in flight): 2-3 s alone; x20
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
        + "[up]\nready_timeout_s = 20\n"  # the broker's READY=1 (no torch): about 1 s alone; x20
    )
    up = Up(config, "--no-learner", "--actors", "1")
    try:
        with Client(  # a status call: ms once the broker is up, and retried by the poll below while it starts
            f"tcp://127.0.0.1:{front}",
            deadline=5,
            curve_secret_key=str(keys / "emulator.key_secret"),
            curve_server_key=str(keys / "broker.key"),
        ) as client:
            # a broker and a uniform actor (torch imported: 2-5 s alone); x12
            wait_for(lambda: len(client.status()["actors"]) == 1, timeout=60, what=f"the CURVE actor\n{up.text()[-2000:]}")
        assert up.proc.poll() is None, up.text()[-2000:]
    finally:
        assert up.stop() == 0, up.text()[-2000:]
    assert "did not report ready" not in up.text()


FARM_FILES = {  # docs/farm.md, "Copy to each machine only what it needs": host -> {its path: the trusted machine's file}
    "cpu": {"keys/broker.key_secret": "broker.key_secret", "allowed-clients/emu.key": "emu.key", "allowed-actors/gpu.key": "gpu.key"},
    "learner": {"keys/learner.key_secret": "learner.key_secret", "allowed-actors/gpu.key": "gpu.key"},
    "gpu": {"keys/gpu.key_secret": "gpu.key_secret", "keys/broker.key": "broker.key", "keys/learner.key": "learner.key"},
}


@pytest.mark.slow
def test_each_host_of_a_curve_farm_holds_only_its_own_keys_and_ppoz_up_starts_its_part(tmp_path, tiny_models, redis_url, key_prefix):
    """docs/farm.md: one farm.toml on every host, and on each host only the keys and allow-lists of what runs there.
    `ppoz up` validates (and opens the files of) only the components it starts, so the learner's host and an actor's
    host start without the broker's secret key (before: both exited 2 on it), while a file the learner needs and
    lacks still stops its host at once. Each host is a folder, the working directory of its `ppoz up`, outside the
    repository; the file's paths are relative to it."""
    import shutil

    from client import Client, PPOZError
    from common.security import generate_keypair

    trusted = tmp_path / "trusted"
    for name in ("broker", "learner", "gpu", "emu"):
        generate_keypair(trusted, name)
    front, back, weights = free_port(), free_port(), free_port()
    farm = (
        f'[store]\nredis_url = "{redis_url}"\nkey_prefix = "{key_prefix}"\n[policy]\nmodel = "{tiny_models["llama"]}"\nlora_rank = 0\n'
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nheartbeat_ms = 200\n'
        'curve_secret_key = "keys/broker.key_secret"\ncurve_allowed_clients = "allowed-clients"\ncurve_allowed_actors = "allowed-actors"\n'
        f'[actor]\nbroker = "tcp://127.0.0.1:{back}"\nweights = "tcp://127.0.0.1:{weights}"\nheartbeat_ms = 200\n'
        'curve_secret_key = "keys/gpu.key_secret"\ncurve_broker_key = "keys/broker.key"\ncurve_learner_key = "keys/learner.key"\n'
        f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\ncurve_secret_key = "keys/learner.key_secret"\n'
        'curve_allowed_actors = "allowed-actors"\ncheckpoint_dir = "checkpoints"\ntensorboard_dir = ""\n'
        # ready_timeout_s: the broker's READY=1, about 1 s alone (x120); stop_timeout_s: a component's exit, 1-5 s (x12)
        "[up]\nbroker = false\nlearner = false\nactors = 0\nready_timeout_s = 120\nstop_timeout_s = 60\n"
    )
    hosts = {}
    for host, files in FARM_FILES.items():
        hosts[host] = tmp_path / "hosts" / host
        hosts[host].mkdir(parents=True)
        (hosts[host] / "farm.toml").write_text(farm)
        for path, source in files.items():
            if host != "learner" or not path.startswith("allowed-actors"):  # the learner's host gets its allow-list below
                (hosts[host] / path).parent.mkdir(exist_ok=True)
                shutil.copy(trusted / source, hosts[host] / path)
    # what the learner runs on is still checked: without its actors' allow-list its host stops at once, naming it
    # (before anything starts: a few seconds of imports, 120 s is far beyond that even on a loaded machine)
    refused = ppoz("up", "--config", "farm.toml", "--learner", timeout=120, cwd=hosts["learner"])
    assert refused.returncode == 2 and "curve_allowed_actors" in refused.stderr, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "started" not in refused.stdout + refused.stderr
    (hosts["learner"] / "allowed-actors").mkdir()
    shutil.copy(trusted / "gpu.key", hosts["learner"] / "allowed-actors")
    ups = {
        "cpu": Up(Path("farm.toml"), "--broker", cwd=hosts["cpu"]),
        "learner": Up(Path("farm.toml"), "--learner", cwd=hosts["learner"]),
        "gpu": Up(Path("farm.toml"), "--actors", "1", cwd=hosts["gpu"]),
    }
    try:
        # Two torch processes (the learner and the actor) start side by side, each about 7 s of CPU importing torch and
        # loading the tiny model: 120 s leaves room for a 2-core machine busy with other tests.
        wait_for(
            lambda: "learner ready" in ups["learner"].text() or ups["learner"].proc.poll() is not None,
            timeout=120,
            what=f"the learner host's learner\n{ups['learner'].text()[-3000:]}",
        )
        assert ups["learner"].proc.poll() is None, ups["learner"].text()[-3000:]
        secret, server = str(trusted / "emu.key_secret"), str(trusted / "broker.key")  # an emulator's keys
        # a status call: ms once the broker serves; a failed one counts as 0 and the poll below asks again
        with Client(f"tcp://127.0.0.1:{front}", deadline=5, curve_secret_key=secret, curve_server_key=server) as client:

            def actors() -> int:
                try:
                    return len(client.status()["actors"])
                except PPOZError:  # the broker host's broker not serving yet
                    return 0

            # the actor host's actor, through CURVE with its own key, registered with the broker; it started with the
            # learner, so the same 120 s hold
            wait_for(
                lambda: actors() == 1 or ups["gpu"].proc.poll() is not None,
                timeout=120,
                what=f"the GPU host's actor\n{ups['gpu'].text()[-3000:]}",
            )
        for up in ups.values():
            assert up.proc.poll() is None, up.text()[-3000:]
    finally:
        codes = {host: ups[host].stop() for host in ("gpu", "learner", "cpu")}  # the broker last
    assert codes == {"cpu": 0, "learner": 0, "gpu": 0}, {host: up.text()[-2000:] for host, up in ups.items()}
