"""Shared fixtures: a real Redis server, a broker on random loopback ports, actors, clients.

Redis: `--redis-url` (or the REDIS_URL environment variable) points the suite at
an external server; otherwise one embedded redis-server is started for the
session. Each test gets its own key prefix, so tests never see each other's data.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
import zmq

from actor_node.link import BrokerLink
from actor_node.policies import UniformPolicy
from actor_node.worker import serve
from broker.config import BrokerConfig
from broker.server import Broker
from client import Client
from common.redis_server import EmbeddedRedis, connect
from common.shared_settings import StoreSettings
from tests.model_cache import cached_build


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and the processes it starts) gets its share of the cores.

    torch's default is a thread per core in every process: two workers each starting a learner
    and an actor put six busy threads on two cores, and a test that takes 4 s alone took 40 s."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every process a test starts
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests spread over the pytest-xdist workers, and first in each worker's share.

    bin/test runs xdist's work-stealing scheduler: worker i starts on the i-th contiguous share of this
    list, and a worker that runs out takes half of what is left of the busiest one's, from its end.
    Slow tests bunched in one share kept one worker on them for the whole run while the other finished
    its share and waited; slow tests last would start late and trail. Dealt out in turn, each share
    starts with its slow tests and ends with quick ones that an idle worker can take."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    quick = [item for item in items if item.get_closest_marker("slow") is None]
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for n, item in enumerate(slow + quick):  # dealt in turn, so the shares are the sizes xdist cuts
        shares[n % workers].append(item)
    items[:] = [item for share in shares for item in share]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=os.environ.get("REDIS_URL", ""),
        help="Redis server for the tests (default: REDIS_URL, else an embedded redis-server)",
    )


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    url = request.config.getoption("--redis-url")
    if url:
        connect(url).ping()  # fail early and clearly if it is not there
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis_py.Redis]:
    client = connect(redis_url)
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_client: redis_py.Redis) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    for key in redis_client.scan_iter(f"{prefix}:*"):
        redis_client.delete(key)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@dataclass
class RunningBroker:
    broker: Broker
    thread: threading.Thread
    config: BrokerConfig

    @property
    def frontend(self) -> str:
        return self.broker.frontend_endpoint

    @property
    def backend(self) -> str:
        return self.broker.backend_endpoint

    def stop(self) -> None:
        self.broker.stop()
        self.thread.join(10)  # the loop sees the stop within one 50 ms poll and drains (drain_timeout_s 2 s at most); x5 (a daemon)


@pytest.fixture
def start_broker(redis_url: str, key_prefix: str, zmq_context: zmq.Context) -> Iterator[Callable[..., RunningBroker]]:
    """Start a broker thread on random loopback ports; stopped at teardown."""
    started: list[RunningBroker] = []

    def start(**overrides: Any) -> RunningBroker:
        settings = dict(
            frontend="tcp://127.0.0.1:*",
            backend="tcp://127.0.0.1:*",
            store=StoreSettings(redis_url=redis_url, key_prefix=key_prefix),
            heartbeat_ms=100,
            drain_timeout_s=2.0,  # how long a stopping broker waits for steps in flight: their actor threads answer in ms
        )
        settings.update(overrides)
        cfg = BrokerConfig(**settings)
        # A broker restarted on its predecessor's ports: that one's listeners are closed by the context's I/O thread
        # moments after its loop ends, and an actor reconnecting to a port of the ephemeral range can briefly hold it
        # itself (a TCP self-connect): bound again until it is free.
        deadline = time.monotonic() + 10  # a few ms alone; x1000
        while True:
            broker = Broker(cfg, connect(redis_url), zmq_context)
            try:
                broker.start()
                break
            except zmq.ZMQError as e:
                broker.close()
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        thread = threading.Thread(target=broker.run, name="broker", daemon=True)
        thread.start()
        running = RunningBroker(broker, thread, cfg)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def broker(start_broker: Callable[..., RunningBroker]) -> RunningBroker:
    return start_broker()


@dataclass
class RunningActor:
    link: BrokerLink
    stop_event: threading.Event
    thread: threading.Thread
    served: list[int] = field(default_factory=list)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(10)  # serve() sees the event between its polls (0.1 s) and the job in hand; x50 (a daemon)
        self.link.close()


@pytest.fixture
def start_actor(zmq_context: zmq.Context) -> Iterator[Callable[..., RunningActor]]:
    """Start a uniform-policy actor thread on a real BrokerLink; stopped at teardown."""
    started: list[RunningActor] = []

    def start(endpoint: str, credits: int = 8, name: str = "", policy: Any = None) -> RunningActor:
        link = BrokerLink(endpoint, name=name, credits=credits, heartbeat_ms=100, context=zmq_context).start()
        stop = threading.Event()
        actor = RunningActor(link, stop, threading.Thread())
        actor.thread = threading.Thread(target=lambda: actor.served.append(serve(link, policy or UniformPolicy(0), stop)), daemon=True)
        actor.thread.start()
        started.append(actor)
        return actor

    yield start
    for actor in started:
        if not actor.stop_event.is_set():
            actor.stop()


@pytest.fixture
def make_client(zmq_context: zmq.Context) -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    # The defaults are for a broker thread of this process on loopback, which answers in ms (REPLY_S); a step waits on
    # an in-process actor too, 10-100 ms alone: a 5 s attempt is x50, and the 10 s deadline leaves room for one retry.
    def make(endpoint: str, deadline: float = 10.0, attempt_timeout: float = 5.0) -> Client:
        client = Client(endpoint, deadline=deadline, attempt_timeout=attempt_timeout, context=zmq_context)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture(scope="session")
def model_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tiny models are kept (tests/model_cache.py): pytest's cache folder, shared by the workers and kept between runs."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("tiny-models"))
    return tmp_path_factory.getbasetemp().parent / "tiny-models"  # without the cache plugin: shared by this run's workers


@pytest.fixture(scope="session")
def tiny_model(model_cache: Path) -> Callable[..., str]:
    """The folder of a tiny causal LM, loaded with `from_pretrained` as a real one is:
    `tiny_model("gpt2", tokenizer="words", max_positions=128)` (models.tiny_models.build_tiny_model's arguments)."""
    from models.tiny_models import build_tiny_model

    def get(arch: str = "llama", tokenizer: str = "byte", **overrides: Any) -> str:
        return cached_build(model_cache, build_tiny_model, f"{arch}-{tokenizer}", arch=arch, tokenizer=tokenizer, **overrides)

    return get


@pytest.fixture(scope="session")
def tiny_reward_model(model_cache: Path) -> Callable[..., str]:
    """The folder of a tiny reward model (one-label sequence classifier): `tiny_reward_model("llama")`, default DeBERTa-v2."""
    from models.tiny_models import build_tiny_reward_model

    def get(arch: str = "deberta-v2") -> str:
        return cached_build(model_cache, build_tiny_reward_model, f"reward-{arch}", arch=arch)

    return get


@pytest.fixture(scope="session")
def tiny_models(tiny_model: Callable[..., str]) -> dict[str, str]:
    """Tiny Llama-, Qwen2- and GPT-2-style models with the byte tokenizer."""
    from models.tiny_models import ARCHITECTURES

    return {arch: tiny_model(arch) for arch in ARCHITECTURES}
