"""The asyncio client on a socket that takes no more frames (issue 41): a broker that refused its CURVE handshake
leaves the DEALER with no connection to queue on, and an awaited send there never completes by itself.

The request must still end at its deadline (each attempt's send is awaited inside the attempt's timeout), and the
cancelled send must leave nothing stuck: the client closes, and the context terminates at once. The blocking
client's counterpart is tests/common/test_security.py's refused-connection test.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from client import AsyncClient, RequestTimeout
from common.security import generate_keypair
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")

DEADLINE_S = 1.0


def test_an_async_request_on_a_refused_socket_ends_at_its_deadline_and_leaves_nothing_stuck(start_broker, tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("broker", "stranger"):
        generate_keypair(keys, name)
    allowed.mkdir()  # no client allowed
    broker = start_broker(
        curve_secret_key=str(keys / "broker.key_secret"), curve_allowed_clients=str(allowed), curve_allowed_actors=str(allowed)
    )
    context = zmq.Context()  # its own, so that the test can see nothing is left open on it

    async def main() -> None:
        client = AsyncClient(
            broker.frontend,
            deadline=DEADLINE_S,
            attempt_timeout=0.5,
            context=context,
            curve_secret_key=keys / "stranger.key_secret",
            curve_server_key=keys / "broker.key",
        )
        sock = client._open()
        await sock.send_multipart([b"", b"queued before the refusal"])
        # 30 s: a handshake and the broker's ZAP answer take milliseconds on loopback, and seconds at worst on a loaded machine.
        await asyncio.to_thread(wait_for, lambda: broker.broker.allow_lists[0].refused >= 1, 30, "the broker to refuse the key")

        async def takes_no_more() -> bool:
            try:
                await sock.send_multipart([b"", b"queued after the refusal"], zmq.NOBLOCK)
            except zmq.Again:
                return True
            return False

        end = time.monotonic() + 30  # as above: libzmq's I/O thread drops the refused connection's queue right after
        while not await takes_no_more():
            assert time.monotonic() < end, "the refused socket still takes frames after 30 s"
            await asyncio.sleep(0.02)
        start = time.monotonic()
        with pytest.raises(RequestTimeout):
            # 10 s: ten times the request's deadline; past it the send is taken as stuck.
            await asyncio.wait_for(client.ping(), 10)
        assert time.monotonic() - start < DEADLINE_S + 2.0
        await client.close()

    asyncio.run(main())
    ending = threading.Thread(target=context.term, daemon=True)  # waits for every socket of the context to be closed
    ending.start()
    ending.join(5)  # closing the client's sockets is immediate (linger 0); 5 s allows for a loaded machine
    assert not ending.is_alive(), "a socket of the client was left open (a send still pending on it?)"
