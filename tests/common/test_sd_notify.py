"""The notify protocol against a real unix datagram socket."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from common.sd_notify import Notifier


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2)  # each datagram read is sent before its read, on a local socket: ms alone; x1000
    yield path, sock
    sock.close()


def test_ready_status_stopping_arrive_as_datagrams(listener):
    path, sock = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready("bound on :5555")
    assert sock.recv(4096) == b"READY=1\nSTATUS=bound on :5555"
    assert n.status("3 sessions")
    assert sock.recv(4096) == b"STATUS=3 sessions"
    assert not n.status("3 sessions"), "an unchanged status is not sent again"
    assert n.stopping("draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    n.close()


def test_abstract_socket_names(listener):
    name = f"ppoz-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)  # as above
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_watchdog_pings_at_half_the_interval(listener):
    path, sock = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n.watchdog_s == 2.0
    assert n.watchdog(now=100.0)
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert not n.watchdog(now=100.5)  # before half the interval
    assert n.watchdog(now=101.01)
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_watchdog_for_another_pid_and_no_socket_are_off(listener):
    path, _ = listener
    assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_s == 0
    quiet = Notifier({})
    assert not quiet.enabled and not quiet.ready() and not quiet.watchdog()


def test_a_vanished_socket_is_reported_not_raised(tmp_path, caplog):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not n.ready()
    assert "could not notify systemd" in caplog.text


def test_a_full_queue_never_blocks_the_sender(listener):
    path, sock = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    sent = [n.status(f"figure {i}", min_interval_s=0) for i in range(2000)]  # nobody reads: the queue fills
    assert sent[0] and not all(sent), "some datagrams are dropped rather than waited for"
