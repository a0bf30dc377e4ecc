"""`ppoz up`: a whole stack on one machine from one config file.

The file is the one each component reads on its own ([broker], [actor],
[learner], [reward_service] tables, the shared [store], [policy] and [retrieval]
tables, top-level keys for all), plus an [up] table saying what to start here.
Each component runs as its own `ppoz broker|actor|learner|play|reward-server`
process with `--config FILE`, so a farm that outgrows one machine moves a
component elsewhere by running that same command there (docs/farm.md).
Addresses are wired here: the actors connect to the broker's back end and the
learner's weight endpoint, the environment clients to the broker's front end,
everyone to the same Redis ([store], embedded unless a URL is given; the
[store] flags given to `ppoz up` go on to every component).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import IO, Any

from common.config import check, load, local_path, nested, option, read_toml, section
from common.sd_notify import NotifyListener
from common.shared_settings import StoreSettings
from ppoz import device_deal

log = logging.getLogger(__name__)


@section("up")
@dataclass
class UpConfig:
    store: StoreSettings = nested(StoreSettings)  # [store], for every component; an empty URL starts an embedded redis-server
    redis_data_dir: str = option(
        "",
        "where the embedded redis-server keeps an append-only file (empty: a temporary directory; `ppoz train`: output_dir/redis)",
        path=local_path,
    )
    redis_appendfsync: str = option(
        "everysec",
        "how often the embedded Redis flushes its append-only file to disk: everysec (a machine that fails loses up to"
        " about a second of writes), always (none, slower writes) or no (the OS decides)",
    )
    broker: bool = option(True, "start the broker here")
    actors: int = option(1, "actor processes to start here")
    actor_devices: list = option(
        [""],
        "device of actor i is actor_devices[i % len]; empty entries keep [actor] device (auto: with GPUs, one GPU per"
        " process where there are enough, the learner's cuda:0; docs/farm.md)",
    )
    learner: bool = option(True, "start the learner here")
    env: str = option("", "environment clients to start as well: kea, frozenlake, cliffwalking or taxi (empty: none)")
    env_clients: int = option(4, "environment clients (threads of one `ppoz play` process)")
    env_broker: str = option("", "the broker's client endpoint for the environment clients when the broker runs elsewhere")
    reward_service: bool = option(
        False, "start `ppoz reward-server` here: the [reward_service] table's reward model and/or judge, for every driver of the farm"
    )
    on_failure: str = option("restart", "a component that dies is restarted (`restart`) or stops the whole stack (`stop`)")
    max_restarts: int = option(5, "restarts of one component before the whole stack stops")
    stop_timeout_s: float = option(30.0, "how long a component may take to stop after SIGTERM before it is killed")
    log_lines: int = option(20, "last log lines shown when a component dies")
    ready_timeout_s: float = option(300.0, "longest wait for the broker (and the reward service) to answer after start")
    cpu_threads: int = option(
        0,
        "CPU threads of each actor and of the learner (OMP_NUM_THREADS); 0: this machine's cores shared among them,"
        " unless OMP_NUM_THREADS is set (each process's default, every core, makes them fight over the cores:"
        " the learner's first update took 4.5 minutes instead of 40 s on 2 cores)",
    )

    def __post_init__(self) -> None:
        check(self.on_failure in ("restart", "stop"), f"on_failure={self.on_failure!r}: must be 'restart' or 'stop'")
        check(self.actors >= 0, f"actors={self.actors}: must be 0 or more")
        check(self.env_clients >= 1, f"env_clients={self.env_clients}: must be at least 1")
        check(self.max_restarts >= 0, f"max_restarts={self.max_restarts}: must be 0 or more")
        check(self.stop_timeout_s > 0, f"stop_timeout_s={self.stop_timeout_s}: must be positive")
        check(self.cpu_threads >= 0, f"cpu_threads={self.cpu_threads}: must be 0 (share the cores) or more")
        check(
            self.redis_appendfsync in ("always", "everysec", "no"),
            f"redis_appendfsync={self.redis_appendfsync!r}: must be always, everysec or no",
        )
        if self.env:
            from envs.runner import environment_names

            names = environment_names()
            check(self.env in names, f"env={self.env!r}: not an environment; known: {', '.join(names)}")


def ppoz_command(*args: str, log_level: str | None = "info", python: Sequence[str] = (sys.executable,)) -> list[str]:
    """`ppoz ARGS` as a child process runs it: this Python (or `python`, a launcher such as torchrun) on ppoz.cli,
    at `log_level` (None: no --log-level flag, the command's default)."""
    return [*python, "-m", "ppoz.cli", *(["--log-level", log_level] if log_level else []), *args]


def connect_address(bind: str) -> str:
    """The address a local peer connects to for a bind address (`tcp://*:5555` -> `tcp://127.0.0.1:5555`)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if bind.startswith(wildcard):
            return "tcp://127.0.0.1:" + bind[len(wildcard) :]
    return bind


@dataclass
class Stack:
    """What `started_stack` runs: where clients reach the broker, the Redis every component was given (its URL
    that of the embedded redis-server if one was started), the supervisor, and where drivers reach the reward
    service started here ("" if none is)."""

    client_broker: str
    store: StoreSettings
    supervisor: Any
    reward_service: str = ""


@contextlib.contextmanager
def started_stack(
    up: UpConfig,
    config_file: str | None,
    log_level: str,
    model: str = "",
    checkpoint_dir: str = "",
    learner_flags: Sequence[str] = (),
    run_dir: Path | None = None,
    fresh_redis: bool = False,
    output: IO[str] | None = None,
) -> Iterator[Stack]:
    """Start what `up` says (the embedded Redis first, then the reward service, broker, learner, actors,
    environment clients), each component reading `config_file` (`model`, if given, overrides [policy]
    model for actors and learner; `checkpoint_dir` the learner's; `learner_flags` are more of `ppoz
    learner`'s flags, which override the file); stop everything on leaving. The caller watches the
    supervisor (`Stack.supervisor.watch()`).

    Nothing starts while a port the stack binds is taken (StackBusy names the process). With `run_dir`
    (`ppoz train`'s output directory), the stack holds its lock and records its children there; the
    children of an earlier stack on it that was killed -9 are stopped first, so none of them still holds
    a port or writes the Redis files when this one starts. `fresh_redis`: the embedded Redis's data
    directory is emptied then, before it starts (`ppoz train --no-resume`). The components' output goes to
    `output` (this process's stdout if None), each line prefixed with its component's name."""
    from actor_node.config import ActorConfig
    from broker.config import BrokerConfig
    from common.redis_server import EmbeddedRedis
    from learner_node.config import LearnerConfig
    from ppoz.supervisor import StackBusy, Supervisor, hold_lock, stop_previous
    from rewards.config import RewardServiceConfig

    policy_flags = {"policy.model": model} if model else {}
    model_args = ["--model", model] if model else []
    learner_args = [*model_args, *(["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []), *learner_flags]
    # Only the components that run here are validated, and only their files (keys, allow-lists) opened: a host of a
    # farm holds the files of its own components alone (docs/farm.md).
    broker = load(BrokerConfig, config_file) if up.broker else None
    actor = load(ActorConfig, config_file, policy_flags) if up.actors else None
    # The embedded Redis's URL is known only once it runs; validate with a stand-in.
    stand_in = {"store.redis_url": up.store.redis_url or "redis://embedded", **policy_flags}
    learner = load(LearnerConfig, config_file, stand_in) if up.learner else None
    rewards = load(RewardServiceConfig, config_file) if up.reward_service else None
    binds = {
        "broker.frontend": broker.frontend if broker is not None else "",
        "broker.backend": broker.backend if broker is not None else "",
        "learner.weights_bind": learner.weights_bind if learner else "",
        "reward_service.bind": rewards.bind if rewards else "",
    }
    for name, endpoint in binds.items():
        check(not endpoint.endswith(":*"), f"{name} = {endpoint!r}: `ppoz up` needs fixed ports to wire components together")
    check(
        not (up.env and broker is not None and broker.curve_secret_key),
        "[up] env starts `ppoz play` clients, which have no CURVE keys, and [broker] curve_secret_key is set: they could"
        " not connect; run CURVE clients of your own (docs/security.md) or leave [up] env empty",
    )
    if actor is not None and not actor.policy.model:
        log.warning("[policy] model is empty: the actors serve the uniform random policy")
    client_broker = connect_address(broker.frontend) if broker is not None else up.env_broker
    check(not up.env or bool(client_broker), "[up] env_broker is empty: the environment clients need the broker's client endpoint")

    lock = None
    record = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = hold_lock(run_dir / "stack.lock")
        record = run_dir / "stack.json"
        try:
            stop_previous(record, up.stop_timeout_s)
        except StackBusy:  # a survivor of the killed run that would not die: named, and the lock let go
            lock.close()
            raise
    if fresh_redis and up.redis_data_dir and not up.store.redis_url:
        shutil.rmtree(up.redis_data_dir, ignore_errors=True)
    embedded = None
    sup = Supervisor(up.on_failure, up.max_restarts, up.stop_timeout_s, up.log_lines, output=output, record=record)
    try:
        check_ports_free(binds)
        redis_url = up.store.redis_url
        if not redis_url:
            data_dir = up.redis_data_dir or None
            embedded = EmbeddedRedis(appendonly=bool(data_dir), data_dir=data_dir, appendfsync=up.redis_appendfsync).start()
            redis_url = embedded.url
            if embedded.process is not None:
                sup.adopt("redis-server", embedded.process.pid)
            log.info("embedded redis-server at %s", redis_url)
        store = replace(up.store, redis_url=redis_url)
        yield from _started(up, sup, config_file, log_level, store, broker, actor, learner, rewards, model_args, learner_args)
    finally:
        sup.stop_all()
        if embedded is not None:
            embedded.stop()
        if lock is not None:
            lock.close()


def _started(
    up: UpConfig,
    sup: Any,
    config_file: str | None,
    log_level: str,
    store: StoreSettings,
    broker: Any,
    actor: Any,
    learner: Any,
    rewards: Any,
    model_args: list[str],
    learner_args: list[str],
) -> Iterator[Stack]:
    """Start the components under `sup` and yield the stack (the caller stops them)."""
    # Components started here find each other through the bind addresses; those elsewhere
    # through the addresses the config gives ([actor] broker and weights, [up] env_broker).
    actor_broker = connect_address(broker.backend) if broker is not None else actor.broker if actor is not None else ""
    actor_weights = connect_address(learner.weights_bind) if learner else actor.weights if actor is not None else ""
    client_broker = connect_address(broker.frontend) if broker is not None else up.env_broker
    common = ppoz_command(log_level=log_level)
    torch_env = thread_env(up.cpu_threads, up.actors + int(up.learner) + int(bool(rewards and rewards.reward_model)))
    config = ["--config", config_file] if config_file else []
    store_args = store_flags(store)
    # Readiness as each component reports it itself (READY=1 on a notify socket of ours): no request to its sockets,
    # which under CURVE this process could not make.
    ready: dict[str, NotifyListener] = {}
    if rewards:  # first: its model loads while the others start, and it stops last, after every driver's broker
        ready["reward-server"] = NotifyListener("reward-server")
        sup.add("reward-server", [*common, "reward-server", *config], {**torch_env, **ready["reward-server"].env})
    if up.broker:
        ready["broker"] = NotifyListener("broker")
        sup.add("broker", [*common, "broker", *config, *store_args], ready["broker"].env)
    devices = dealt_devices(up, actor, learner)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if up.learner:
        device, pin = device_deal.pinned(devices.learner, inherited)
        learner_device = ["--device", device] if device else []
        sup.add("learner", [*common, "learner", *config, *store_args, "--resume", *learner_args, *learner_device], {**torch_env, **pin})
    for i in range(up.actors):
        device, pin = device_deal.pinned(devices.actors[i], inherited)
        argv = [
            *common,
            "actor",
            *config,
            *store_args,
            "--name",
            f"actor-{i}",
            "--seed",
            str(actor.seed + i),
            "--broker",
            actor_broker,
            "--weights",
            actor_weights,
            *model_args,
        ]
        sup.add(f"actor-{i}", argv + (["--device", device] if device else []), {**torch_env, **pin})
    if up.env:
        sup.add(
            "clients",
            [*common, "play", "--env", up.env, "--clients", str(up.env_clients), "--broker", client_broker, "--report-every", "30"],
        )
    try:
        # the others start once the broker serves, so that they find it there
        sup.start_all(lambda c: _wait_ready(c.name, ready["broker"], up.ready_timeout_s, sup) if c.name == "broker" else None)
        if rewards:
            _wait_ready("reward-server", ready["reward-server"], up.ready_timeout_s, sup)
        yield Stack(client_broker, store, sup, connect_address(rewards.bind) if rewards else "")
    finally:
        for listener in ready.values():
            listener.close()


def dealt_devices(up: UpConfig, actor: Any, learner: Any) -> device_deal.Deal:
    """One GPU per process where the machine has enough (ppoz/device_deal.py), logged; no GPU is looked for
    when every process here has its device set to something other than auto or cuda."""
    actor_device = actor.device if actor is not None else "auto"
    learner_device = learner.device if learner else "auto"
    settings = [d for d in up.actor_devices if d] + [actor_device, learner_device]
    gpus = device_deal.visible_gpus() if any(d == "auto" or d.startswith("cuda") for d in settings) else 0
    devices = device_deal.deal(gpus, up.actors, bool(learner), actor_device, learner_device, [d for d in up.actor_devices])
    if gpus:
        log.info("devices: %s", devices.summary)
    return devices


def store_flags(store: StoreSettings) -> list[str]:
    """`store` as flags of `ppoz broker|actor|learner`, which win over the file's [store] table: so the components
    started here get the embedded Redis's URL and the [store] flags given to `ppoz up`, not only the file's."""
    return [arg for f in fields(store) for arg in (f"--{f.name.replace('_', '-')}", str(getattr(store, f.name)))]


def check_ports_free(binds: dict[str, str]) -> None:
    """StackBusy if a TCP port one of `binds` (name -> ZeroMQ endpoint) needs is taken, naming the process that
    holds it when this machine says (a component of an earlier stack still stopping, say)."""
    import socket

    from ppoz.supervisor import StackBusy

    for name, endpoint in binds.items():
        if not endpoint.startswith("tcp://"):
            continue
        host, _, port_text = endpoint[len("tcp://") :].rpartition(":")
        if not port_text.isdigit() or int(port_text) == 0:
            continue
        host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
        try:
            family = socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)[0][0]
        except OSError:
            continue  # an interface name ZeroMQ understands but this check does not: ZeroMQ reports it
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds: a closing connection does not count
            try:
                probe.bind((host, int(port_text)))
            except OSError as e:
                holder = port_holder(int(port_text))
                raise StackBusy(
                    f"{name} = {endpoint}: port {port_text} is taken ({e.strerror}){' by ' + holder if holder else ''};"
                    " stop that process or choose another port"
                ) from e


def port_holder(port: int) -> str:
    """The process listening on TCP `port`, as "pid N (command line)", if /proc tells (Linux, this user's processes); else ""."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return ""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {proc.name} ({command[:120]})"
        except OSError:
            continue
    return ""


def main(args: argparse.Namespace) -> int:
    from ppoz.supervisor import StackBusy

    up = load(UpConfig, args.config, args)
    try:
        with started_stack(up, args.config, args.log_level) as stack:
            sup = stack.supervisor
            if stack.reward_service:
                _warn_if_unused(args.config, stack.reward_service)

            def on_signal(signum: int, frame: Any) -> None:
                log.info("%s received: stopping every component", signal.Signals(signum).name)
                sup.stop()

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            code = sup.watch()
    except StackBusy as e:
        print(f"ppoz up: {e}", file=sys.stderr)
        return 2
    if sup.failed:
        print(f"ppoz up: stopped because {sup.failed} died", file=sys.stderr)
    return code


def thread_env(cpu_threads: int, torch_processes: int) -> dict[str, str]:
    """The environment that sets each torch process's CPU threads: `cpu_threads`, or with 0 the cores shared
    among `torch_processes` (at least one each); nothing when the user set OMP_NUM_THREADS themselves."""
    if cpu_threads:
        return {"OMP_NUM_THREADS": str(cpu_threads)}
    if "OMP_NUM_THREADS" in os.environ or torch_processes < 1:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // torch_processes))}


def _wait_ready(name: str, listener: NotifyListener, timeout: float, sup: Any) -> None:
    """Wait for a component's READY=1 until `timeout` passes or the stack stops; a component that dies at start
    is reported at once, not after the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not sup.stop_event.is_set():
        if listener.ready(min(1.0, max(0.0, end - time.monotonic()))):
            return
        sup.check()
    if not sup.stop_event.is_set():
        log.error("the %s did not report ready within %.0f s", name, timeout)
        sup.failed = name
        sup.stop()


def _warn_if_unused(config_file: str | None, bind: str) -> None:
    """Drivers that `ppoz train --broker` runs against this stack use the service only through [train]
    reward_service: say so when the file forgets it (`ppoz train` on one machine fills it in itself)."""
    train = read_toml(config_file).get("train") if config_file else None
    if isinstance(train, dict) and not train.get("reward_service"):
        log.warning(
            "[up] reward_service starts the reward service but [train] reward_service is empty: ppoz train's drivers"
            ' will not use it (set [train] reward_service = "%s")',
            connect_address(bind),
        )
