"""Relative paths, as a user gives them: each command run by the `ppoz` console script from a working directory
outside the repository, every path it is given relative to it.

A path is made absolute once, when the command starts (common/config.py `local_path`: a config field marked
`path=`; a flag's `type=local_path`), before any child process starts: redis-server changes into its data
folder before it opens its log and socket, so a relative data folder failed (`ppoz train`'s quick start
crashed on `outputs/redis/redis.log`, issue 41). `ppoz train` and both demos run with relative paths in the
docs' own tests (tests/test_docs.py runs docs/train.md and README.md from an empty folder); `ppoz export`'s
are in tests/ppoz/test_export.py; `ppoz play` takes no path.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from client import Client
from common.config import code_path, load, local_path, local_path_or_any, local_path_or_id
from common.redis_server import EmbeddedRedis
from tests.helpers import wait_for
from tests.processes import free_port

PPOZ_SCRIPT = str(Path(sys.executable).parent / "ppoz")  # the console script a user runs, not `python -m`
# A process that imports torch, transformers and peft takes 5-8 s of CPU to start on the 2-core VM; beside the
# other pytest worker and spinning processes, several times that.
START_S = 120.0
STOP_S = 30.0  # SIGTERM to exit: a broker drains for up to 10 s, then closes


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory, not the repository, for this test and the commands it runs."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def started(elsewhere: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start `ppoz ARGS` in the working directory (output to ppoz.log there); every one is stopped at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        log = (elsewhere / "ppoz.log").open("a")
        proc = subprocess.Popen([PPOZ_SCRIPT, *args], cwd=elsewhere, stdout=log, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(STOP_S)


def _stop(proc: subprocess.Popen[str], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_S) == 0, log.read_text()[-3000:]


def test_config_paths_are_made_absolute_against_the_working_directory(elsewhere: Path) -> None:
    from dataset_driver.config import TrainConfig
    from learner_node.config import LearnerConfig

    (elsewhere / "tiny").mkdir()
    (elsewhere / "conf").mkdir()
    (elsewhere / "conf" / "run.toml").write_text(
        '[policy]\nmodel = "tiny"\n[learner]\ncheckpoint_dir = "runs/ckpt"\n'
        '[train]\ndata = "data/train.jsonl"\nreward_fn = "rewards/mine.py:score"\n'
    )
    learner = load(LearnerConfig, "conf/run.toml", {"store.redis_url": "redis://x"})
    assert learner.checkpoint_dir == str(elsewhere / "runs" / "ckpt")
    assert learner.tensorboard_dir == str(elsewhere / "runs" / "learner" / "tb"), "a relative default is the working directory's too"
    assert learner.policy.model == str(elsewhere / "tiny"), "a model folder that exists here"
    train = load(TrainConfig, "conf/run.toml", {"output_dir": "out"})
    assert (train.data, train.output_dir) == (str(elsewhere / "data" / "train.jsonl"), str(elsewhere / "out"))
    assert train.reward_fn == f"{elsewhere / 'rewards' / 'mine.py'}:score"


def test_path_kinds() -> None:
    assert local_path("") == "" and local_path_or_id("") == ""
    assert local_path_or_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct", "a hub id that is no folder here"
    assert local_path_or_id("./my-model").endswith("/my-model") and local_path_or_id("./my-model").startswith("/")
    assert local_path_or_any("*") == "*" and local_path_or_any("keys").startswith("/")
    assert code_path("my_rewards:compute_score") == "my_rewards:compute_score", "a module is looked up on sys.path, not here"
    assert code_path("math") == "math" and code_path("r.py:f").endswith("/r.py:f")


def test_an_embedded_redis_keeps_a_relative_data_folder_under_the_working_directory(elsewhere: Path) -> None:
    """The root cause of the quick start's crash: redis-server changes into --dir before it opens --logfile."""
    with EmbeddedRedis(appendonly=True, data_dir="state/redis") as server:
        assert server.url == f"unix://{elsewhere / 'state' / 'redis' / 'redis.sock'}", "redis-py reads unix://rel/... as a host"
    assert (elsewhere / "state" / "redis" / "redis.log").is_file()


@pytest.mark.slow
def test_up_reads_its_config_and_keeps_its_redis_under_the_working_directory(
    elsewhere: Path, started: Callable[..., subprocess.Popen[str]]
) -> None:
    front, back = free_port(), free_port()
    (elsewhere / "conf").mkdir()
    (elsewhere / "conf" / "stack.toml").write_text(
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\n'
        '[up]\nactors = 0\nlearner = false\nredis_data_dir = "state/redis"\n'
    )
    up = started("up", "--config", "conf/stack.toml")
    with Client(f"tcp://127.0.0.1:{front}", deadline=START_S, attempt_timeout=START_S) as c:
        assert c.ping()["status"] == "ok"
    assert list((elsewhere / "state" / "redis").glob("appendonly*")), "the append-only file is not under the working directory"
    _stop(up, elsewhere / "ppoz.log")


@pytest.mark.slow
def test_broker_and_keygen_take_key_files_and_allow_lists_relative_to_the_working_directory(
    elsewhere: Path, started: Callable[..., subprocess.Popen[str]], redis_url: str, key_prefix: str
) -> None:
    for name in ("broker", "emu"):
        done = subprocess.run([PPOZ_SCRIPT, "keygen", name, "--dir", "keys"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    (elsewhere / "allowed").mkdir()
    shutil.copy(elsewhere / "keys" / "emu.key", elsewhere / "allowed")
    front, back = free_port(), free_port()
    broker = started(
        *("broker", "--frontend", f"tcp://127.0.0.1:{front}", "--backend", f"tcp://127.0.0.1:{back}"),
        *("--redis-url", redis_url, "--key-prefix", key_prefix),
        *("--curve-secret-key", "keys/broker.key_secret", "--curve-allowed-clients", "allowed", "--curve-allowed-actors", "*"),
    )
    keys = elsewhere / "keys"
    with Client(
        f"tcp://127.0.0.1:{front}",
        deadline=START_S,
        attempt_timeout=10,
        curve_secret_key=str(keys / "emu.key_secret"),
        curve_server_key=str(keys / "broker.key"),
    ) as c:
        assert c.ping()["status"] == "ok", "an allowed client is answered over CURVE"
    # The path it works with is the absolute one, made so when it started (the folder it names stays right if the
    # process changes directory, and its log and any child are told where it is).
    assert f"whose keys are in {elsewhere / 'allowed'}" in (elsewhere / "ppoz.log").read_text()
    _stop(broker, elsewhere / "ppoz.log")


@pytest.mark.slow
def test_learner_writes_its_tensorboard_logs_under_the_working_directory(
    elsewhere: Path, started: Callable[..., subprocess.Popen[str]], redis_url: str, key_prefix: str, tiny_model: Callable[..., str]
) -> None:
    shutil.copytree(tiny_model(), elsewhere / "models" / "tiny")
    learner = started(
        *("learner", "--model", "models/tiny", "--redis-url", redis_url, "--key-prefix", key_prefix),
        *("--weights-bind", "tcp://127.0.0.1:0", "--checkpoint-dir", "runs/ckpt", "--tensorboard-dir", "runs/tb", "--resume"),
    )
    log = elsewhere / "ppoz.log"
    wait_for(lambda: "learner ready" in log.read_text() or learner.poll() is not None, START_S, "the learner to be ready")
    assert learner.poll() is None, log.read_text()[-3000:]
    assert list((elsewhere / "runs" / "tb").glob("events.out.tfevents.*")), "no TensorBoard file under the working directory"
    # its checkpoints (which record the config, the base model's path among it, for `ppoz export` and a resume from
    # anywhere) are looked for by the absolute path made when it started
    assert f"no checkpoint in {elsewhere / 'runs' / 'ckpt'}, starting fresh" in log.read_text()
    _stop(learner, log)


@pytest.mark.slow
def test_reward_server_loads_a_reward_model_folder_relative_to_the_working_directory(
    elsewhere: Path, started: Callable[..., subprocess.Popen[str]], tiny_reward_model: Callable[..., str]
) -> None:
    shutil.copytree(tiny_reward_model(), elsewhere / "rm")
    port = free_port()
    (elsewhere / "rewards.toml").write_text(f'[reward_service]\nbind = "tcp://127.0.0.1:{port}"\nreward_model = "rm"\n')
    server = started("reward-server", "--config", "rewards.toml")
    log = elsewhere / "ppoz.log"
    wait_for(lambda: "reward service ready" in log.read_text() or server.poll() is not None, START_S, "the reward service to be ready")
    assert server.poll() is None, log.read_text()[-3000:]
    assert f"loading the reward model {elsewhere / 'rm'} on cpu" in log.read_text()
    _stop(server, log)
