"""Helpers the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from client import Client


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `condition` until it is truthy; fail the test with `what` after `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def actors_ready(client: Client, n: int) -> bool:
    return len(client.status()["actors"]) >= n


OBS = {
    "prompt": "Screen: MainActivity. History: none.",
    "question": "Which action should I choose next? I shall choose No. ",
    "action": ["0: TouchEvent(view=Shop)", "1: TouchEvent(view=Cart)", "2: KeyEvent(BACK)"],
}
