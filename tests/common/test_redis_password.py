"""A Redis password is read from the environment, never from a URL: not in argv (`ps`), not in checkpoints."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import redis

from actor_node.config import ActorConfig
from broker.config import BrokerConfig
from common.config import ConfigError, load
from common.redis_server import PASSWORD_ENV, PASSWORD_FILE_ENV, EmbeddedRedis, RedisUnavailable, connect, redis_password
from common.shared_settings import StoreSettings
from learner_node.config import LearnerConfig
from ppoz.up import UpConfig
from tests.learner_node.test_resume import learner, write_segments
from tests.processes import PPOZ

SECRET = "hunter2-Zq8"


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.parametrize("cls", [BrokerConfig, LearnerConfig, ActorConfig, UpConfig], ids=["broker", "learner", "actor", "up"])
@pytest.mark.parametrize("url", [f"redis://:{SECRET}@127.0.0.1:6379/0", f"rediss://worker:{SECRET}@redis.farm:6380"])
def test_a_url_with_a_password_is_refused_by_every_component_without_repeating_it(cls, url) -> None:
    def make(url: str) -> object:  # as `ppoz <component> --redis-url URL` gives it: into the component's [store]
        return load(cls, None, {"store.redis_url": url, "policy.model": "m"})

    with pytest.raises(ValueError) as refused:
        make(url)
    message = str(refused.value)
    assert "`redis_url` carries a password" in message and PASSWORD_ENV in message and PASSWORD_FILE_ENV in message
    assert SECRET not in message
    make(url.replace(f":{SECRET}", ""))  # the same URL without it is accepted (a user name is no secret)


@pytest.mark.parametrize("table", ["broker", "learner", "actor", "up"])
def test_a_url_with_a_password_in_its_old_place_is_not_repeated_either(tmp_path, table) -> None:
    """`[broker] redis_url` moved to [store]: the message saying so shows the URL, its password masked."""
    cls = {"broker": BrokerConfig, "learner": LearnerConfig, "actor": ActorConfig, "up": UpConfig}[table]
    path = tmp_path / "old.toml"
    path.write_text(f'[policy]\nmodel = "m"\n[{table}]\nredis_url = "redis://:{SECRET}@127.0.0.1:6379/0"\n')
    with pytest.raises(ConfigError) as refused:
        load(cls, path)
    assert f"[{table}] redis_url has moved: write it as `redis_url = 'redis://:***@127.0.0.1:6379/0'` in the [store]" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_the_command_line_refuses_it_and_says_where_the_password_goes() -> None:
    # `ppoz broker` (no torch) refuses its flags at start: under 1 s alone; x100
    done = subprocess.run([*PPOZ, "broker", "--redis-url", f"redis://:{SECRET}@127.0.0.1:1/0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert PASSWORD_ENV in done.stderr and SECRET not in done.stderr + done.stdout


def test_the_password_from_the_environment_or_a_file_opens_a_server_that_asks_for_it(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    monkeypatch.setenv(PASSWORD_ENV, SECRET + ' "quoted" \\ and spaced')
    with EmbeddedRedis() as server:
        assert connect(server.url).ping()
        with pytest.raises(redis.AuthenticationError):  # a client without it is refused: the server asks for it
            redis.Redis.from_url(server.url).ping()
        assert SECRET not in _cmdline(server.process.pid)  # given on its stdin, not in argv

    monkeypatch.delenv(PASSWORD_ENV)
    secret_file = tmp_path / "redis.password"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret_file))
    assert redis_password() == SECRET
    with EmbeddedRedis() as server:
        assert connect(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, password="wrong").ping()

    for content, words in [("", "is empty"), ("\n\n", "is empty")]:
        secret_file.write_text(content)
        with pytest.raises(RedisUnavailable, match=words):
            redis_password()
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(RedisUnavailable, match="cannot read the Redis password file .*missing"):
        redis_password()
    monkeypatch.setenv(PASSWORD_ENV, "line\nbreak")  # the variable wins over the file, and is checked
    with pytest.raises(RedisUnavailable, match="control character"):
        redis_password()


@pytest.mark.slow
def test_a_learner_given_the_password_in_a_file_keeps_it_out_of_argv_and_its_checkpoints(
    tiny_models, key_prefix, tmp_path, monkeypatch
) -> None:
    secret_file = tmp_path / "redis.password"
    secret_file.write_text(SECRET)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret_file))  # inherited by the learner process
    ckpt = tmp_path / "ckpt"
    with EmbeddedRedis() as server:
        write_segments(connect(server.url), key_prefix, 8)
        proc = learner(tiny_models["llama"], server.url, key_prefix, ckpt, resume=False, max_updates=1)
        try:
            assert SECRET not in _cmdline(proc.pid)
            assert proc.wait(180) == 0  # a learner process: torch's start, one update of the tiny model, a checkpoint: 15-20 s alone; x9
        finally:
            if proc.poll() is None:
                proc.kill()
    saved = sorted(ckpt.glob("ckpt-*"))
    assert saved, "the learner wrote no checkpoint"
    for path in [ckpt, *ckpt.rglob("*")]:
        if path == ckpt:
            continue  # the folder it was given may be shared; what it writes in it is not
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} is {oct(mode)}"
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"{path} holds the password"
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o700  # made by the learner, so the owner's alone too


def test_a_broker_on_a_password_protected_redis_keeps_it_out_of_its_status_and_its_log(monkeypatch, caplog, zmq_context) -> None:
    """`ppoz status` shows the broker's `status` reply (limits, counters, the learner's figures): none of it, nor
    any log line of a broker that loses and finds Redis again, may hold the password."""
    import json
    import logging
    import threading

    from broker.server import Broker
    from client import Client

    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    caplog.set_level(logging.DEBUG)
    with EmbeddedRedis() as server:
        cfg = BrokerConfig(
            frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", store=StoreSettings(redis_url=server.url, key_prefix="secret")
        )
        broker = Broker(cfg, connect(server.url), zmq_context)
        broker.start()
        thread = threading.Thread(target=broker.run, daemon=True)
        thread.start()
        try:
            # a broker thread of this process answers in ms (x1000); the detach while Redis is away is retried until the
            # deadline, then raised, which the test wants
            with Client(broker.frontend_endpoint, deadline=5, context=zmq_context) as client:
                task = client.attach()
                status = client.status()
                server.stop()  # Redis gone: the broker logs what it found
                with pytest.raises(Exception):  # noqa: B017 - whichever error the lost write gives; its text is checked below
                    client.detach(task)
                status_after = client.status()
        finally:
            broker.stop()
            thread.join(15)  # as RunningBroker.stop in tests/conftest.py
    assert status["storage_ok"] and not status_after["storage_ok"]
    for text in (json.dumps(status), json.dumps(status_after), caplog.text):
        assert SECRET not in text
    assert "Redis" in caplog.text  # the loss was logged, so the log was looked at
