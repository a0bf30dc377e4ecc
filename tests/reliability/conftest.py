"""The real learner for the reliability tests: in a thread of the test process, or as its own `ppoz learner` process."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.redis_server import connect
from common.shared_settings import PolicySpec, StoreSettings
from learner_node import checkpoint
from learner_node.config import LearnerConfig
from learner_node.worker import Learner
from tests.helpers import REDIS_S
from tests.processes import PPOZ

POLICY = dict(lora_rank=0, normalisation="token")
LEARNER_SETTINGS = dict(
    device="cpu",
    rollout_batch=48,  # transitions (segments of 4 here): the fault tests check what is stored, not what is learned
    rollout_timeout_s=1.0,
    policy_minibatch=48,
    micro_batch=16,
    update_epochs=1,
    value_epochs=1,
    max_policy_lag=1000,
    tensorboard_dir="",
)
READY_TIMEOUT_S = 300  # importing torch and loading the model in a fresh process, on a loaded 2-core machine
SETTLE_STALL_S = 300  # longer than any single update here on a loaded 2-core machine; the ledger moves after each one


@dataclass
class RunningLearner:
    """The real learner, in a thread of the test process or as its own process (as in a farm)."""

    ckpt: Path
    said: Callable[[], str]  # what it has logged so far
    alive: Callable[[], bool]
    stop: Callable[[], None]

    def checkpoint_state(self) -> dict[str, Any]:
        return checkpoint.read_state(checkpoint.latest(self.ckpt) or self.ckpt)


@pytest.fixture
def start_learner(tiny_models: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Callable[..., RunningLearner]]:
    """Start the real learner on the tiny Llama (`as_process`: `ppoz learner` as its own process); stopped at teardown."""
    started: list[RunningLearner] = []

    def start(redis_url: str, key_prefix: str, as_process: bool = False) -> RunningLearner:
        learner = launch_learner(tiny_models["llama"], redis_url, key_prefix, tmp_path, caplog, as_process)
        started.append(learner)
        wait_until_ready(learner)
        return learner

    yield start
    for learner in started:
        learner.stop()


def wait_until_ready(learner: RunningLearner) -> None:
    """Until the learner has made its consumer group and published its weights: a fault injected
    before then would test its start-up, not its recovery (a learner process loads torch and the model first)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "learner ready" not in learner.said():
        if not learner.alive():
            pytest.fail(f"the learner ended before it was ready; it said:\n{learner.said()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the learner was not ready after {READY_TIMEOUT_S} s; it said:\n{learner.said()[-4000:]}")
        time.sleep(0.2)  # a tick of the loop above, which READY_TIMEOUT_S bounds


def launch_learner(
    tiny_model: str, redis_url: str, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, as_process: bool
) -> RunningLearner:
    ckpt = tmp_path / "ckpt"
    if as_process:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**POLICY, **LEARNER_SETTINGS}.items()]
        log_path = tmp_path / "learner.log"
        proc = subprocess.Popen(
            [
                *PPOZ,
                "learner",
                "--model",
                tiny_model,
                "--redis-url",
                redis_url,
                "--key-prefix",
                key_prefix,
                "--weights-bind",
                "tcp://127.0.0.1:0",
                "--checkpoint-dir",
                str(ckpt),
                *flags,
            ],
            stderr=log_path.open("w"),
        )

        def stop_process() -> None:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(120)  # its update in hand (seconds at most here), a checkpoint, the exit: 2-10 s alone; x12

        return RunningLearner(ckpt, log_path.read_text, lambda: proc.poll() is None, stop_process)
    caplog.set_level(logging.INFO, logger="learner_node.worker")
    cfg = LearnerConfig(
        policy=PolicySpec(model=tiny_model, **POLICY),
        store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
        weights_bind="tcp://127.0.0.1:*",
        checkpoint_dir=str(ckpt),
        **LEARNER_SETTINGS,
    )
    learner = Learner(cfg, connect(redis_url, socket_timeout=REDIS_S))
    thread = threading.Thread(target=learner.run, daemon=True)
    thread.start()

    def stop_thread() -> None:
        learner.stop()
        thread.join(120)  # as the process's stop above

    return RunningLearner(ckpt, lambda: caplog.text, thread.is_alive, stop_thread)
