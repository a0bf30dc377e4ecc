"""`python -m tests.delayed_connect SECONDS ARGS...` runs `ppoz ARGS` whose DEALER sockets pause SECONDS after each
TCP connect, as a thread descheduled on a loaded machine pauses between `connect` and its first `send`.

A test-only stand-in for a busy machine: nothing of PPOZ is changed, only the moment its code gets the CPU
back. Why it is needed: libzmq connects and runs the CURVE handshake on its own I/O thread, so on an idle
machine the actor's first send after `connect` always comes before a broker's refusal (and finds the
connection's queue still there), while on a loaded one the refusal can come first and take the queue away
(issue 41: the actor's I/O thread then hung in that send). The pause makes the refusal come first every time.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import zmq


def main(argv: list[str]) -> int:
    delay = float(argv[0])
    connect = zmq.Socket.connect

    def paused(self: zmq.Socket, addr: str) -> Any:
        result = connect(self, addr)
        if self.socket_type == zmq.DEALER and addr.startswith("tcp://"):
            time.sleep(delay)
        return result

    zmq.Socket.connect = paused  # type: ignore[method-assign]
    from ppoz.cli import main as ppoz_main

    return ppoz_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
