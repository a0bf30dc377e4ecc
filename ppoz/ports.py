"""Loopback TCP ports for the processes a command starts and wires together by address (`ppoz demo`'s stack,
the tools' stacks, the tests' processes).

Binding port 0, closing the socket and handing the number to another process is a race: the kernel gives out
the same ephemeral ports to every bind(0) and outgoing connection (ZeroMQ's own `tcp://127.0.0.1:*` binds
among them), so a port can be taken before the process binds it. `free_port` hands out ports from below the
ephemeral range instead, which the kernel never hands out by itself: each port once per block and process,
checked free by binding it first. A process that takes several blocks at once (the tests' pytest-xdist
workers) gives each its share (`use_share`); an unshared process starts its walk at a point of its own (its
pid), so that two tools started together do not walk the same ports in step. A process that can choose its
own port (a broker thread on `tcp://127.0.0.1:*`) needs none: let it bind port 0 and read the port back.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from pathlib import Path

LOWEST_PORT = 10_000  # below it: the well-known and registered services a machine may run


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; BSD and macOS start at 49152


class _Ports:
    """The ports of one share of the span below the ephemeral range, handed out in turn."""

    def __init__(self, share: int, shares: int, start: int) -> None:
        size = (_ephemeral_low() - LOWEST_PORT) // max(1, shares)
        self.block = range(LOWEST_PORT + share * size, LOWEST_PORT + (share + 1) * size)
        offset = start % len(self.block) if len(self.block) else 0
        self.turn = itertools.cycle([*self.block[offset:], *self.block[:offset]])
        self.lock = threading.Lock()


_ports = _Ports(0, 1, os.getpid())


def use_share(share: int, shares: int) -> None:
    """Hand out ports from share `share` of `shares` equal blocks only, from its start (one block per test worker)."""
    global _ports
    _ports = _Ports(share, shares, 0)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port for a process this one starts: free now, and handed to no other caller in this process."""
    ports = _ports
    if len(ports.block) < 100:  # an ephemeral range that starts too low to leave room below it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    with ports.lock:
        for _ in range(len(ports.block)):
            port = next(ports.turn)
            if _bindable(port):
                return port
    raise RuntimeError(f"no free port in {ports.block.start}-{ports.block.stop - 1}")
