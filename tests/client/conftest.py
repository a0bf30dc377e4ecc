"""Fixtures of the client tests: a real broker with a real actor, ready before the test starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from client import Client
from tests.client.helpers import EchoPolicy
from tests.helpers import actors_ready, wait_for


@pytest.fixture
def serving(start_broker, start_actor, make_client) -> Callable[..., tuple[Any, Client]]:
    """Start a broker (with config overrides) and one actor (default EchoPolicy); return (broker, probe client)."""

    def serve(policy: Any = None, credits: int = 8, **config: Any) -> tuple[Any, Client]:
        broker = start_broker(**config)
        start_actor(broker.backend, credits=credits, policy=policy or EchoPolicy())
        probe = make_client(broker.frontend)
        wait_for(lambda: actors_ready(probe, 1), what="the actor to register")
        return broker, probe

    return serve
