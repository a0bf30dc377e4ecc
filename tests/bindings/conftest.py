"""A live stack for the other-language clients: the real broker and a real LLM actor on a tiny model."""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from typing import Iterator

import pytest

from actor_node.config import ActorConfig
from actor_node.main import run_actor
from common.shared_settings import PolicySpec
from tests.helpers import actors_ready, wait_for

BINDINGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bindings")


@dataclass
class LiveStack:
    frontend: str
    broker: object  # tests.conftest.RunningBroker


@pytest.fixture
def live_stack(start_broker, make_client, tiny_models) -> Iterator[LiveStack]:
    broker = start_broker()
    stop = threading.Event()
    cfg = ActorConfig(broker=broker.backend, policy=PolicySpec(model=tiny_models["llama"], lora_rank=0, normalisation="token"),
                      device="cpu", heartbeat_ms=100)
    thread = threading.Thread(target=run_actor, args=(cfg, stop), daemon=True)
    thread.start()
    # the actor thread loads the tiny model (torch already imported here) and registers: 1-3 s alone; x20
    wait_for(lambda: actors_ready(make_client(broker.frontend), 1), timeout=60, what="the LLM actor")
    yield LiveStack(broker.frontend, broker)
    stop.set()
    thread.join(30)  # the actor ends its batch in hand: under 0.5 s alone; x60 (a daemon thread)


def require_tool(name: str, hint: str) -> str:
    """The path of a tool the bindings need; a clear failure (not a skip) when it is missing.

    CI installs them through bin/test; PPOZ_SKIP_BINDINGS=1 skips these tests on purpose."""
    if os.environ.get("PPOZ_SKIP_BINDINGS") == "1":
        pytest.skip("PPOZ_SKIP_BINDINGS=1")
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: {hint} (bin/test installs it; PPOZ_SKIP_BINDINGS=1 skips these tests)")
    return path
