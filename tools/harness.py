"""What the tools share to run the product: a whole stack as `ppoz up` starts it, watched in the background,
and the wait for its first actor. The loopback ports come from ppoz/ports.py (`free_port`) and the `ppoz`
command line from ppoz/up.py (`ppoz_command`): one of each in the repository, for the tools and the product's
own commands alike."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ppoz.up import Stack, UpConfig, started_stack


@contextlib.contextmanager
def watched_stack(up: UpConfig, config_file: str | None, log_level: str, **options: Any) -> Iterator[Stack]:
    """`started_stack` (ppoz/up.py; `options` are its own) with its supervisor watching the components in a
    thread of its own, as `ppoz up` does: a component that dies is restarted or, with [up] on_failure = "stop",
    stops the stack and is named in `stack.supervisor.failed`."""
    with started_stack(up, config_file, log_level, **options) as stack:
        watcher = threading.Thread(target=stack.supervisor.watch, name="stack-watch", daemon=True)
        watcher.start()
        try:
            yield stack
        finally:
            # The watcher's own end stops every component (once: `started_stack` then finds them stopped).
            stack.supervisor.stop()
            watcher.join()


def wait_for_actor(stack: Stack, timeout: float, period: float = 0.5) -> bool:
    """Until an actor has registered at the stack's broker: True then; False when a component failed or
    `timeout` seconds passed first."""
    from client import Client

    end = time.monotonic() + timeout
    with Client(stack.client_broker, deadline=10.0, attempt_timeout=5.0) as probe:
        while not probe.status()["actors"]:
            if stack.supervisor.failed or time.monotonic() > end:
                return False
            time.sleep(period)
    return True
