"""CURVE on every socket (common/security.py): real sockets on loopback, the real broker, actor and learner.

Keys are made per test in tmp_path. A refused peer gets no answer at all
(CURVE or ZAP ends its handshake), so "refused" reads: its request times out
and the broker counted nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import zmq

from actor_node.link import BrokerLink
from actor_node.policies import UniformPolicy
from actor_node.weight_follower import WeightFollower
from actor_node.worker import serve
from broker.config import BrokerConfig
from client import AsyncClient, Client, PPOClient, RequestTimeout
from common.config import ConfigError, load
from common.security import ALLOW_ANY, ClientKeys, KeyFileError, client_keys, generate_keypair, load_keypair, load_public
from common.shared_settings import PolicySpec, StoreSettings
from gateway.config import GatewayConfig
from gateway.server import Gateway
from tests.helpers import OBS, actors_ready, wait_for
from tests.processes import PPOZ, free_port

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")

SECRET = "SECRET-PROMPT-1234"
REFUSED_DEADLINE_S = 1.0


@dataclass
class Keys:
    """Key pairs for every role, and the two allow-list directories of the broker."""

    root: Path
    allowed_clients: Path
    allowed_actors: Path

    def secret(self, name: str) -> str:
        return str(self.root / f"{name}.key_secret")

    def public(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    def allow(self, name: str, directory: Path) -> None:
        shutil.copy(self.public(name), directory)

    def client(self, name: str = "client", server: str = "broker") -> ClientKeys:
        keys = client_keys(self.secret(name), self.public(server))
        assert keys is not None
        return keys


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    root = tmp_path / "keys"
    k = Keys(root, tmp_path / "allowed-clients", tmp_path / "allowed-actors")
    k.allowed_clients.mkdir()
    k.allowed_actors.mkdir()
    for name in ("broker", "learner", "client", "stranger", "actor"):
        generate_keypair(root, name)
    k.allow("client", k.allowed_clients)
    k.allow("actor", k.allowed_actors)
    return k


@pytest.fixture
def curve_broker(start_broker: Callable[..., Any], keys: Keys) -> Callable[..., Any]:
    """Start a broker with CURVE on both sockets (config overrides as for start_broker)."""

    def start(**overrides: Any) -> Any:
        settings = dict(
            curve_secret_key=keys.secret("broker"),
            curve_allowed_clients=str(keys.allowed_clients),
            curve_allowed_actors=str(keys.allowed_actors),
        )
        settings.update(overrides)
        return start_broker(**settings)

    return start


@pytest.fixture
def start_curve_actor(zmq_context: zmq.Context) -> Iterator[Callable[..., BrokerLink]]:
    """As conftest's start_actor, with CURVE keys on the actor's BrokerLink."""
    started: list[tuple[BrokerLink, threading.Event, threading.Thread]] = []

    def start(endpoint: str, curve: ClientKeys | None, name: str = "") -> BrokerLink:
        link = BrokerLink(endpoint, name=name, credits=8, heartbeat_ms=100, context=zmq_context, curve=curve).start()
        stop = threading.Event()
        thread = threading.Thread(target=serve, args=(link, UniformPolicy(0), stop), daemon=True)
        thread.start()
        started.append((link, stop, thread))
        return link

    yield start
    for link, stop, thread in started:
        stop.set()
        thread.join(10)
        link.close()


@pytest.fixture
def make_curve_client(zmq_context: zmq.Context, keys: Keys) -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def make(endpoint: str, name: str | None = "client", deadline: float = 10.0, attempt_timeout: float = 5.0, **curve: Any) -> Client:
        if name is not None and not curve:
            curve = {"curve_secret_key": keys.secret(name), "curve_server_key": keys.public("broker")}
        client = Client(endpoint, deadline=deadline, attempt_timeout=attempt_timeout, context=zmq_context, **curve)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def assert_refused(client: Client, broker: Any) -> None:
    """The request gets no answer (RequestTimeout at its deadline) and the broker counted no request."""
    start = time.monotonic()
    with pytest.raises(RequestTimeout):
        client.ping()
    assert time.monotonic() - start < REFUSED_DEADLINE_S + 2.0
    assert broker.broker.metrics["broker/requests"] == 0


# --- 1. an allowed client and actor work -----------------------------------------------------------
def test_allowed_client_attaches_and_steps_through_a_curve_actor(curve_broker, start_curve_actor, make_curve_client, keys):
    broker = curve_broker()
    start_curve_actor(broker.backend, keys.client("actor"), name="curve-actor")
    client = make_curve_client(broker.frontend)
    wait_for(lambda: actors_ready(client, 1), what="the CURVE actor to register")
    task = client.attach()
    reply = client.step(task, OBS)
    assert reply["status"] == "ok" and 0 <= reply["action"] < len(OBS["action"])
    assert client.feedback(task, 1.0, done=True)["status"] == "ok"
    status = client.status()
    assert [a["name"] for a in status["actors"]] == ["curve-actor"]
    assert status["counters"]["broker/steps"] == 1 and status["counters"]["broker/feedbacks"] == 1
    assert [a.allowed > 0 for a in broker.broker.allow_lists] == [True, True]  # both keys went through ZAP


def test_async_and_ppoapi_clients_speak_curve(curve_broker, start_curve_actor, make_curve_client, keys, zmq_context):
    broker = curve_broker()
    start_curve_actor(broker.backend, keys.client("actor"))
    wait_for(lambda: actors_ready(make_curve_client(broker.frontend), 1), what="the CURVE actor to register")

    async def play() -> dict[str, Any]:
        async with AsyncClient(
            broker.frontend,
            deadline=10,
            context=zmq_context,
            curve_secret_key=keys.secret("client"),
            curve_server_key=keys.public("broker"),
        ) as c:
            return await c.step(await c.attach(), OBS)

    assert asyncio.run(play())["status"] == "ok"
    # Keys given as Z85 strings rather than files.
    _, secret = load_keypair(keys.secret("client"))
    with PPOClient(
        broker.frontend,
        deadline=10,
        context=zmq_context,
        curve_secret_key=secret.decode(),
        curve_server_key=load_public(keys.public("broker")).decode(),
    ) as kea:
        kea.attach()
        assert kea.step(OBS)["status"] == "ok"


@pytest.mark.slow
def test_gateway_forwards_over_curve(curve_broker, start_curve_actor, make_curve_client, keys):
    broker = curve_broker()
    start_curve_actor(broker.backend, keys.client("actor"))
    wait_for(lambda: actors_ready(make_curve_client(broker.frontend), 1), what="the CURVE actor to register")
    cfg = GatewayConfig(port=0, broker=broker.frontend, curve_secret_key=keys.secret("client"), curve_server_key=keys.public("broker"))
    gateway = Gateway(cfg).start()
    thread = threading.Thread(target=gateway.serve, daemon=True)
    thread.start()
    try:
        res = requests.post(f"http://127.0.0.1:{gateway.port}/attach", timeout=30)
        assert res.status_code == 200 and res.json()["task_id"]
    finally:
        gateway.stop()
        thread.join(10)


def test_client_keeps_curve_on_the_sockets_it_opens_after_a_timeout(start_broker, make_curve_client, keys):
    """No broker yet: attempts time out and each replaces the socket; the one that finally reaches it must speak CURVE."""
    port = free_port()
    client = make_curve_client(f"tcp://127.0.0.1:{port}", deadline=15.0, attempt_timeout=0.3)
    result: list[Any] = []

    def ping() -> None:
        try:
            result.append(client.ping())
        except Exception as e:  # reported by the assertion below, not as an unhandled thread exception
            result.append(e)

    pinger = threading.Thread(target=ping, daemon=True)
    pinger.start()
    time.sleep(1.0)
    start_broker(
        frontend=f"tcp://127.0.0.1:{port}",
        curve_secret_key=keys.secret("broker"),
        curve_allowed_clients=str(keys.allowed_clients),
        curve_allowed_actors=str(keys.allowed_actors),
    )
    pinger.join(20)
    assert result and isinstance(result[0], dict) and result[0]["status"] == "ok", result
    assert client.attempts >= 3


# --- 2, 3. unknown keys and plain peers are refused ----------------------------------------------------
def test_with_curve_an_attach_rid_is_the_client_key_s_own(curve_broker, make_curve_client, keys):
    """Under CURVE the client is its key: another allowed key reusing an attach rid from the same address gets a
    task of its own; the same key on a new socket (a retry, rule 3) gets its task again."""
    keys.allow("stranger", keys.allowed_clients)
    broker = curve_broker()
    mine = make_curve_client(broker.frontend, name="client").request("attach", rid="shared-rid")["task_id"]
    again = make_curve_client(broker.frontend, name="client").request("attach", rid="shared-rid")["task_id"]
    theirs = make_curve_client(broker.frontend, name="stranger").request("attach", rid="shared-rid")["task_id"]
    assert again == mine and theirs != mine
    stored = broker.broker.store.load_sessions(32, 0)
    assert stored[mine].attach_sender == keys.client("client").public.decode()  # Z85, as the ZAP handler names it


def test_client_with_an_unknown_key_gets_no_answer(curve_broker, make_curve_client):
    broker = curve_broker()
    stranger = make_curve_client(broker.frontend, name="stranger", deadline=REFUSED_DEADLINE_S, attempt_timeout=0.5)
    assert_refused(stranger, broker)
    assert broker.broker.allow_lists[0].refused >= 1  # the ZAP handler saw the key and said no
    assert make_curve_client(broker.frontend).ping()["status"] == "ok"  # the broker itself is fine


def test_a_client_whose_connection_was_refused_times_out_rather_than_blocking_on_send(curve_broker, keys):
    """A refused CURVE handshake can leave the client's socket taking no more frames: the send must keep the deadline.

    (A fresh-clone CI run once hung 300 s in `send_multipart` on such a socket.)
    """
    broker = curve_broker()
    context = zmq.Context()  # its own, so that a send stuck in it can be ended when the test fails
    stranger = Client(
        broker.frontend,
        deadline=REFUSED_DEADLINE_S,
        attempt_timeout=0.5,
        context=context,
        curve_secret_key=keys.secret("stranger"),
        curve_server_key=keys.public("broker"),
    )
    sock = stranger._socket()
    sock.send_multipart([b"", b"queued before the refusal"])
    wait_for(lambda: broker.broker.allow_lists[0].refused >= 1, what="the broker to refuse the stranger's key")

    def takes_no_more() -> bool:
        try:
            sock.send_multipart([b"", b"queued after the refusal"], zmq.NOBLOCK)
        except zmq.Again:
            return True
        return False

    wait_for(takes_no_more, what="the refused socket to stop taking frames")
    outcome: list[object] = []  # what ping returned or raised

    def ask() -> None:
        try:
            outcome.append(stranger.ping())
        except BaseException as e:  # noqa: BLE001 - asserted on below
            outcome.append(e)

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(REFUSED_DEADLINE_S + 5)
    blocked = worker.is_alive()
    if blocked:  # end the stuck send (ETERM), wait for the request to give up, then close its socket
        ending = threading.Thread(target=context.term, daemon=True)
        ending.start()
        worker.join(10)
        stranger.close()
        ending.join(10)
    else:
        stranger.close()
        context.term()
    assert not blocked, "the request blocked in its send past its deadline"
    assert isinstance(outcome[0], RequestTimeout), outcome


def test_plain_client_gets_no_answer(curve_broker, make_curve_client):
    broker = curve_broker()
    plain = make_curve_client(broker.frontend, name=None, deadline=REFUSED_DEADLINE_S, attempt_timeout=0.5)
    assert plain.curve is None
    assert_refused(plain, broker)
    assert make_curve_client(broker.frontend).ping()["status"] == "ok"


def test_client_with_an_ephemeral_key_is_refused_by_an_allow_list(curve_broker, make_curve_client, keys):
    broker = curve_broker()
    anonymous = make_curve_client(broker.frontend, deadline=REFUSED_DEADLINE_S, attempt_timeout=0.5, curve_server_key=keys.public("broker"))
    assert_refused(anonymous, broker)


def test_allow_any_accepts_any_key_but_no_plain_client(curve_broker, make_curve_client, keys):
    broker = curve_broker(curve_allowed_clients=ALLOW_ANY)
    assert make_curve_client(broker.frontend, name="stranger").ping()["status"] == "ok"
    assert make_curve_client(broker.frontend, curve_server_key=keys.public("broker")).ping()["status"] == "ok"
    plain = make_curve_client(broker.frontend, name=None, deadline=REFUSED_DEADLINE_S, attempt_timeout=0.5)
    with pytest.raises(RequestTimeout):
        plain.ping()


def test_a_key_added_to_the_allow_list_is_accepted_without_a_restart(curve_broker, make_curve_client, keys):
    broker = curve_broker()
    assert_refused(make_curve_client(broker.frontend, name="stranger", deadline=REFUSED_DEADLINE_S, attempt_timeout=0.5), broker)
    keys.allow("stranger", keys.allowed_clients)
    assert make_curve_client(broker.frontend, name="stranger").ping()["status"] == "ok"


def test_actors_with_an_unknown_key_or_without_curve_are_not_registered(curve_broker, start_curve_actor, make_curve_client, keys):
    broker = curve_broker()
    refused = [
        start_curve_actor(broker.backend, keys.client("stranger"), name="stranger-actor"),
        start_curve_actor(broker.backend, None, name="plain-actor"),
    ]
    probe = make_curve_client(broker.frontend)
    # A link reconnects after 0.3 s without a word from the broker, which beats every 0.1 s to an actor it let in: two
    # reconnects, two refused rounds. 30 s: 100 rounds, for a loaded 2-core machine (a send that hung, issue 41, fails).
    wait_for(lambda: all(link.reconnects >= 2 for link in refused), timeout=30, what="both refused links to retry twice")
    assert probe.status()["actors"] == []
    assert broker.broker.allow_lists[1].refused >= 1
    for link in refused:  # a refused link keeps trying (it logs each retry) and still stops at once
        start = time.monotonic()
        link.close()
        assert time.monotonic() - start < 2.0 and not link._thread.is_alive()
    start_curve_actor(broker.backend, keys.client("actor"), name="actor")
    wait_for(lambda: actors_ready(probe, 1), timeout=30, what="the allowed actor to register")  # ms when idle; 30 s: loaded
    assert [a["name"] for a in probe.status()["actors"]] == ["actor"]


# --- 4. what goes over the wire -------------------------------------------------------------------------
class Relay:
    """A TCP relay on loopback that records every byte it forwards: what a wiretap on the network would see."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = [self.listener]
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                downstream, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [downstream, upstream]
            for src, dst in ((downstream, upstream), (upstream, downstream)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                thread.start()
                self.threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.stopped.set()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for thread in self.threads:
            thread.join(5)


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "plain"])
def test_traffic_is_not_readable_on_the_wire_with_curve(curve, start_broker, start_curve_actor, make_curve_client, keys):
    settings = (
        dict(
            curve_secret_key=keys.secret("broker"),
            curve_allowed_clients=str(keys.allowed_clients),
            curve_allowed_actors=str(keys.allowed_actors),
        )
        if curve
        else {}
    )
    broker = start_broker(**settings)
    start_curve_actor(broker.backend, keys.client("actor") if curve else None)
    relay = Relay(int(broker.frontend.rsplit(":", 1)[1]))
    try:
        client = make_curve_client(f"tcp://127.0.0.1:{relay.port}", name="client" if curve else None)
        wait_for(lambda: actors_ready(client, 1), what="the actor to register")
        task = client.attach()
        reply = client.step(task, dict(OBS, prompt=f"{SECRET} {OBS['prompt']}"))
        assert reply["status"] == "ok"
    finally:
        relay.close()
    wire = bytes(relay.seen)
    assert len(wire) > 200  # the requests and replies did go through the relay
    if curve:
        assert SECRET.encode() not in wire and task.encode() not in wire
    else:
        assert SECRET.encode() in wire and task.encode() in wire  # the control: without CURVE anyone on the path reads it


# --- 5. weight announcements ---------------------------------------------------------------------------
@pytest.fixture
def tiny_llama(tiny_models: dict[str, str]) -> str:
    return tiny_models["llama"]


def test_weight_announcements_reach_only_allowed_curve_subscribers(
    tiny_llama, redis_url, redis_client, key_prefix, keys, zmq_context, tmp_path
):
    from learner_node.config import LearnerConfig
    from learner_node.worker import Learner

    learner_keys = {"curve_secret_key": keys.secret("learner"), "curve_allowed_actors": str(keys.allowed_actors)}
    learner = Learner(
        LearnerConfig(
            policy=PolicySpec(model=tiny_llama, lora_rank=4),
            device="cpu",
            store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
            weights_bind="tcp://127.0.0.1:*",
            tensorboard_dir="",
            checkpoint_dir=str(tmp_path / "ck"),
            **learner_keys,
        ),
        redis_client,
        zmq_context,
    )
    # The followers read another prefix, so Redis (the backstop) never hands them the snapshot: only PUB can.
    elsewhere = f"{key_prefix}-nothing-here"
    followers = {
        "allowed": WeightFollower(
            redis_client, elsewhere, learner.weights_endpoint, zmq_context, curve=client_keys(keys.secret("actor"), keys.public("learner"))
        ),
        "stranger": WeightFollower(
            redis_client,
            elsewhere,
            learner.weights_endpoint,
            zmq_context,
            curve=client_keys(keys.secret("stranger"), keys.public("learner")),
        ),
        "plain": WeightFollower(redis_client, elsewhere, learner.weights_endpoint, zmq_context),
    }
    got: dict[str, Any] = {}
    try:
        end = time.monotonic() + 10
        quiet_until = None
        while time.monotonic() < end:
            learner.publish()  # PUB drops messages for slow joiners: announce until heard
            time.sleep(0.05)
            for name, follower in followers.items():
                ann = follower.newest(time.monotonic(), -1)
                if ann is not None:
                    got[name] = ann
            if "allowed" in got and quiet_until is None:
                quiet_until = time.monotonic() + 1.0  # the others had as long as it did, and a second more
            if quiet_until is not None and time.monotonic() > quiet_until:
                break
    finally:
        for follower in followers.values():
            follower.close()
        learner.close()
    assert "allowed" in got and got["allowed"].version == learner.version
    assert "stranger" not in got and "plain" not in got


# --- 6. keys, the command, and config errors ------------------------------------------------------------
@pytest.mark.slow
def test_keygen_writes_a_pair_and_refuses_to_overwrite(tmp_path):
    folder = tmp_path / "k"
    result = subprocess.run([*PPOZ, "keygen", "broker", "--dir", str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    public, secret = folder / "broker.key", folder / "broker.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pub, sec = load_keypair(secret)
    assert load_public(public) == pub and pub.decode() in result.stdout and str(public) in result.stdout
    assert sec.decode() not in result.stdout and "secret-key" not in public.read_text()

    again = subprocess.run([*PPOZ, "keygen", "broker", "--dir", str(folder)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "already exist" in again.stderr and "--force" in again.stderr
    assert load_keypair(secret) == (pub, sec)  # untouched

    forced = subprocess.run([*PPOZ, "keygen", "broker", "--dir", str(folder), "--force"], capture_output=True, text=True, timeout=60)
    assert forced.returncode == 0 and load_public(public) != pub
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600


def test_broker_with_a_missing_key_file_fails_at_start_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "broker.key_secret"
    result = subprocess.run(
        [*PPOZ, "broker", "--curve-secret-key", str(missing), "--curve-allowed-clients", "*", "--curve-allowed-actors", "*"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "curve_secret_key" in result.stderr and str(missing) in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_errors_name_the_setting_and_the_file(keys, tmp_path):
    from actor_node.config import ActorConfig

    with pytest.raises(ConfigError, match="`curve_allowed_actors` is required with `curve_secret_key`"):
        load(BrokerConfig, flags={"curve_secret_key": keys.secret("broker"), "curve_allowed_clients": "*"})
    with pytest.raises(ConfigError, match="holds no secret key"):
        load(BrokerConfig, flags={"curve_secret_key": keys.public("broker"), "curve_allowed_clients": "*", "curve_allowed_actors": "*"})
    with pytest.raises(ConfigError, match="`curve_allowed_clients`: allow-list directory .*nope does not exist"):
        load(
            BrokerConfig,
            flags={"curve_secret_key": keys.secret("broker"), "curve_allowed_clients": str(tmp_path / "nope"), "curve_allowed_actors": "*"},
        )
    with pytest.raises(ConfigError, match="`curve_allowed_clients` = .* is set but `curve_secret_key` is empty"):
        load(BrokerConfig, flags={"curve_allowed_clients": "*"})
    with pytest.raises(ConfigError, match="`curve_broker_key`: key file .*missing.key does not exist"):
        load(ActorConfig, flags={"curve_secret_key": keys.secret("actor"), "curve_broker_key": str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match="`curve_secret_key` is set but `curve_broker_key` and `curve_learner_key` are empty"):
        load(ActorConfig, flags={"curve_secret_key": keys.secret("actor")})
    with pytest.raises(ConfigError, match="`curve_server_key`"):
        load(GatewayConfig, flags={"curve_server_key": str(tmp_path / "missing.key")})
    with pytest.raises(KeyFileError, match=f"{tmp_path / 'gone.key'} does not exist"):
        Client("tcp://127.0.0.1:1", curve_server_key=str(tmp_path / "gone.key"))
    assert load(BrokerConfig).curve_secret_key == ""  # off by default


def test_generate_keypair_refuses_odd_names(tmp_path):
    for name in ("", "a/b", ".."):
        with pytest.raises(ValueError, match="plain file name"):
            generate_keypair(tmp_path, name)
