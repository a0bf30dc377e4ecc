"""A farm across hosts: the whole stack in Linux network namespaces joined by a bridge, with links cut.

    ppoz bench farm            (as root: it creates network namespaces, a bridge and veth pairs)

Each "host" is a network namespace with one veth link into a bridge in the root namespace:

    store     redis-server (append-only, fsync always) and the broker
    actor-a   an actor                       actor-b   an actor
    learn-0   learner rank 0                 learn-1   learner rank 1
              (`torchrun --nnodes 2`, static rendezvous at learn-0, gloo over the veth links)
    clients   the emulators (tools.reliability.soak's Kea-shaped clients), a process of their own

This process stays in the root namespace, on the bridge, and reads the broker's status and Redis
from there. While the clients play, three faults come in order:

1. actor-a's link goes down for `--actor-cut-s` (30) and comes back;
2. learn-1's link goes down for `--learner-cut-s` while the learner is updating, and comes back;
3. the store host's redis-server is SIGKILLed, and restarted on its files after `--redis-down-s`.

Then the clients stop and detach, the learner trains what is left, and the run checks that the
ledger balances (tools/reliability/ledger.py), that both actors serve the newest published version, and
that no client request failed (what the protocol documents is counted, not failed: asks answered
`wait`, and requests sent again on `overloaded`, `internal` or a lost reply). It prints the jobs
and steps per host in each phase and how long each fault took to heal. `tc netem` is not
needed: faults are links down and up, and a process killed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from client import Client
from common.config import local_path
from common.processes import die_with_parent
from common.redis_server import connect, find_redis_server
from common.weights import latest
from tools.reliability.ledger import settle_ledger
from tools.reliability.output import print_report, run_as_script
from tools.reliability.soak import Clients

log = logging.getLogger(__name__)

KEY_PREFIX = "farm"
RECOVERIES = ("actor rejoined", "actor serving again", "learner published again", "broker storage back", "clients stepping again")
HOSTS = ("store", "actor-a", "actor-b", "learn-0", "learn-1", "clients")
BRIDGE_ADDRESS = 254  # the root namespace's address on the bridge
REDIS_PORT, FRONTEND_PORT, BACKEND_PORT, WEIGHTS_PORT, RENDEZVOUS_PORT = 6379, 5555, 5556, 5557, 29500
PROBE_PORT = 5559  # the reachability check's listener, gone before the stack starts
LISTEN = (
    "import socket, sys\ns = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "print('ready', flush=True)\nwhile True: s.accept()[0].close()"
)
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()"
PYTHON_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16, help="simulated emulators on the clients host (default: 16)")
    parser.add_argument("--actor-cut-s", type=float, default=30.0, help="seconds actor-a's link is down (default: 30)")
    parser.add_argument("--learner-cut-s", type=float, default=20.0, help="seconds learn-1's link is down (default: 20)")
    parser.add_argument("--redis-down-s", type=float, default=5.0, help="seconds Redis stays dead before its restart (default: 5)")
    parser.add_argument(
        "--phase-s", type=float, default=20.0, help="seconds of undisturbed play before each fault and after the last (default: 20)"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="the learner's LoRA rank (0: all weights) (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--deadline-s", type=float, default=1500.0, help="stop a run that takes longer than this, cleaning up (default: 1500)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=300.0, help="give up on the ledger once it has not moved for this long (default: 300)"
    )
    parser.add_argument(
        "--keep", default="", type=local_path, help="keep the logs and checkpoints in this folder (default: a temporary one, removed)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


# --- the network ---------------------------------------------------------------------------------
class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces here (not root, no `ip`, or a sandbox that forbids it)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")


def namespaces_unavailable() -> str | None:
    """Why the farm cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"ppoz-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except NamespacesUnavailable as e:
        return str(e)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Network:
    """One namespace per host, each with a veth link into one bridge; links go down and up on demand."""

    def __init__(self, hosts: tuple[str, ...] = HOSTS) -> None:
        # A tag of its own and a subnet no interface of this machine is on: several runs do not collide.
        taken = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
        while True:
            tag = secrets.token_hex(2)
            self.subnet = f"10.213.{int(tag, 16) % 250 + 1}"
            if f" {self.subnet}." not in taken:
                break
        self.bridge = f"pzb{tag}"
        self.namespaces = {host: f"ppoz-{tag}-{host}" for host in hosts}
        self.links = {host: f"pz{tag}{i}" for i, host in enumerate(hosts)}  # the root side of each host's veth
        self.addresses = {host: f"{self.subnet}.{i + 1}" for i, host in enumerate(hosts)}
        self.up: set[str] = set()

    def create(self) -> Network:
        """Make the bridge and every host; what a failure half-way made is removed again."""
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.{BRIDGE_ADDRESS}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host, ns in self.namespaces.items():
            _ip("netns", "add", ns)
            _ip("link", "add", self.links[host], "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.links[host], "master", self.bridge)
            _ip("link", "set", self.links[host], "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.up.add(host)

    def cut(self, host: str) -> None:
        """Take the host's link down: its packets go nowhere, its connections stay open, as with a pulled cable."""
        _ip("link", "set", self.links[host], "down")
        self.up.discard(host)

    def restore(self, host: str) -> None:
        _ip("link", "set", self.links[host], "up")
        self.up.add(host)

    def command(self, host: str, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *args]

    def unreachable(self, target: str, timeout_s: float = 3.0) -> list[str]:
        """The hosts whose TCP connection to `target` fails across the bridge: none on a working network. Checked
        before the stack starts, so a machine that filters bridged traffic (br_netfilter and a FORWARD policy of
        DROP) is named as the cause at once, not after the stack's own waits for its actors run out."""
        address = self.addresses[target]
        listen = [sys.executable, "-c", LISTEN, address, str(PROBE_PORT)]
        listener = subprocess.Popen(self.command(target, listen), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert listener.stdout is not None
            if not select.select([listener.stdout], [], [], 30)[0] or listener.stdout.readline().strip() != "ready":
                raise NamespacesUnavailable(f"a TCP listener on {target} ({address}:{PROBE_PORT}) did not start")
            connect = [sys.executable, "-c", CONNECT, address, str(PROBE_PORT), str(timeout_s)]
            return [host for host in self.namespaces if host != target and not self._connects(host, connect, timeout_s + 30)]
        finally:
            listener.kill()
            listener.wait()

    def _connects(self, host: str, connect: list[str], timeout_s: float) -> bool:
        try:
            return subprocess.run(self.command(host, connect), capture_output=True, timeout=timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def destroy(self) -> None:
        """Kill what still runs in the namespaces (torchrun's workers run in sessions of their own), then remove
        the namespaces, the links and the bridge; what is already gone is skipped."""
        for ns in self.namespaces.values():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for link in [*self.links.values(), self.bridge]:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


# --- the report ----------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    seconds: float
    served: dict[str, int]  # jobs each actor host answered in the phase (the broker's count)
    client_steps: int  # steps the clients host got answered
    versions: tuple[int, int]  # the learner's published version at the phase's start and its highest in it
    start_at: float = 0.0  # time.monotonic()
    end_at: float = 0.0

    def rates(self) -> dict[str, float]:
        per_host = {host: n / max(self.seconds, 1e-9) for host, n in self.served.items()}
        per_host["clients"] = self.client_steps / max(self.seconds, 1e-9)
        return {host: round(rate, 2) for host, rate in per_host.items()}


@dataclass
class Report:
    hosts: dict[str, str]
    clients: int
    phases: list[Phase] = field(default_factory=list)
    recovery_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    acknowledged: int = 0
    requests: int = 0
    retries: int = 0  # requests sent again (on `overloaded`, `internal` or a lost reply)
    ask_waits: int = 0  # asks answered `wait` (backpressure, or Redis down): the client sleeps and asks again
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    ledger: str = ""
    ledger_balanced: bool = False
    learner_held_during_cut: bool = False  # no version was published while learn-1 was cut off
    cut_update: int = 0  # the learner's update under way when learn-1 was cut off (0: none was)
    actor_a_served_cut_off: int = -1  # jobs actor-a answered from the broker dropping it to its link coming back
    final_version: int = -1
    actor_versions: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    stuck: str = ""  # why the scenario stopped before its end, if it did
    redis_back_at: float = 0.0  # time.monotonic() when the restarted Redis answered

    def failures(self) -> list[str]:
        out = [f"the scenario stopped early: {self.stuck}"] if self.stuck else []
        if self.error_count:
            out.append(f"{self.error_count} client requests failed, first: {self.errors[:3]}")
        if not self.ledger_balanced:
            out.append(f"ledger not balanced: {self.ledger}")
        if not self.steps:
            out.append("no step was answered")
        stale = {name: v for name, v in self.actor_versions.items() if v != self.final_version}
        if stale or len(self.actor_versions) < 2:
            out.append(f"actors {self.actor_versions} do not serve the newest version {self.final_version}")
        for what in RECOVERIES:
            if what not in self.recovery_s:
                out.append(f"never: {what}")
        if not self.cut_update:
            out.append("learn-1 was not cut off during an update")
        if not self.learner_held_during_cut:
            out.append("a version was published while learn-1 was cut off")
        if self.actor_a_served_cut_off != 0:
            out.append(f"actor-a answered {self.actor_a_served_cut_off} jobs while the broker had it for dead")
        return out


def format_report(report: Report) -> str:
    hosts = ", ".join(f"{host} {address}" for host, address in report.hosts.items())
    lines = [f"farm: {report.clients} clients on 6 hosts ({hosts})", "steps served per second, by host:"]
    names = ["actor-a", "actor-b", "clients"]
    lines.append(f"{'phase':<22} {'s':>5} " + " ".join(f"{n:>8}" for n in names) + "  learner versions")
    for phase in report.phases:
        rates = phase.rates()
        lines.append(
            f"{phase.name:<22} {phase.seconds:>5.0f} "
            + " ".join(f"{rates.get(n, 0.0):>8.2f}" for n in names)
            + f"  {phase.versions[0]} -> {phase.versions[1]}"
        )
    lines.append("recovery (seconds after the fault was lifted, or after it began where it says so):")
    lines.extend(f"  {what}: {seconds:.1f}" for what, seconds in report.recovery_s.items())
    lines.append(
        f"learn-1 cut off during update {report.cut_update or 'none'}; the learner held its version meanwhile: "
        f"{report.learner_held_during_cut}; actor-a answered {report.actor_a_served_cut_off} jobs while dropped"
    )
    lines.append(
        f"steps {report.steps}, feedbacks acknowledged {report.acknowledged}, requests {report.requests}, "
        f"sent again {report.retries}, asks answered `wait` {report.ask_waits}, failed {report.error_count}"
    )
    lines.append(f"newest version {report.final_version}, actors serve {report.actor_versions}")
    lines.append(f"ledger: {report.ledger} ({'balanced' if report.ledger_balanced else 'NOT balanced'})")
    failures = report.failures()
    lines.append("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return "\n".join(lines)


# --- the stack -----------------------------------------------------------------------------------
class Farm:
    """The processes of every host, started through `ip netns exec`, logs in `workdir`."""

    def __init__(self, net: Network, workdir: Path, seed: int, lora_rank: int) -> None:
        self.net = net
        self.workdir = workdir
        self.seed = seed
        self.lora_rank = lora_rank
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_dir = Path(tempfile.mkdtemp(prefix="ppoz-farm-redis-"))
        store = net.addresses["store"]
        self.redis_url = f"redis://{store}:{REDIS_PORT}"
        self.frontend = f"tcp://{store}:{FRONTEND_PORT}"

    def start(self) -> None:
        from models.tiny_models import build_tiny_model

        model = str(build_tiny_model(self.workdir / "model", arch="llama", seed=self.seed))
        store, learner_host = self.net.addresses["store"], self.net.addresses["learn-0"]
        common = ["--redis-url", self.redis_url, "--key-prefix", KEY_PREFIX]
        policy = ["--model", model, "--device", "cpu", "--lora-rank", str(self.lora_rank)]
        backend, weights = f"tcp://{store}:{BACKEND_PORT}", f"tcp://{learner_host}:{WEIGHTS_PORT}"
        self.start_redis()
        self._spawn("broker", "store", [*_ppoz(), "broker", "--frontend", self.frontend, "--backend", backend, *common])
        for name in ("actor-a", "actor-b"):
            actor = ["actor", "--name", name, "--broker", backend, "--weights", weights, "--weights-poll-s", "2"]
            self._spawn(name, name, [*_ppoz(), *actor, *"--credits 32 --max-batch 16".split(), *policy, *common])
        learner = [
            "learner",
            *policy,
            *"--normalisation token --rollout-batch 64 --rollout-timeout-s 5 --policy-minibatch 32 --micro-batch 32".split(),
            *"--update-epochs 2 --keep-checkpoints 2 --tensorboard-dir=".split(),
            *["--weights-bind", weights, "--checkpoint-dir", str(self.workdir / "ckpt"), *common],
        ]
        for rank in (0, 1):
            # Two hosts of one GPU (here one CPU process) each; the static rendezvous at rank 0's host.
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            torchrun += f"--node-rank {rank} --master-addr {learner_host} --master-port {RENDEZVOUS_PORT} --max-restarts 0".split()
            self._spawn(f"learn-{rank}", f"learn-{rank}", [*torchrun, "-m", "ppoz.cli", "--log-level", "info", *learner])

    def start_redis(self) -> None:
        """redis-server on the store host, append-only with fsync always, on the same files each time."""
        args = [
            find_redis_server(),
            "--bind",
            self.net.addresses["store"],
            "--port",
            str(REDIS_PORT),
            "--protected-mode",
            "no",  # no password: the bridge reaches only this run's namespaces and this machine
            "--dir",
            str(self.redis_dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--maxmemory-policy",
            "noeviction",
            "--loglevel",
            "warning",
        ]
        self._spawn("redis", "store", args, append=True)
        deadline = time.monotonic() + 30
        while True:
            client = connect(self.redis_url, socket_timeout=2.0, retries=0)
            try:
                client.ping()
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on the store host did not answer within 30 s: {e}") from e
                time.sleep(0.1)
            finally:
                client.close()

    def kill_redis(self) -> None:
        proc = self.procs.pop("redis")
        proc.send_signal(signal.SIGKILL)  # no shutdown save: only the append-only file survives
        proc.wait(10)

    def _spawn(self, name: str, host: str, args: list[str], append: bool = False) -> None:
        log_file = (self.workdir / f"{name}.log").open("a" if append else "w")
        env = dict(os.environ, **PYTHON_ENV)
        self.procs[name] = subprocess.Popen(
            self.net.command(host, args),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal is this process's to handle, in order
            preexec_fn=die_with_parent,  # and a killed bench leaves no process behind
        )
        log_file.close()

    def said(self, name: str, chars: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{self.said(name)}")

    def stop(self) -> None:
        # Users of Redis before it, as `ppoz up` stops them. The two learner ranks are told together, as
        # torchrun tells its workers: a rank stopped alone leaves the other in a collective with a closed peer.
        for group in (("clients",), ("actor-a", "actor-b"), ("learn-0", "learn-1"), ("broker",), ("redis",)):
            running = [self.procs[name] for name in group if name in self.procs and self.procs[name].poll() is None]
            for proc in running:
                proc.send_signal(signal.SIGTERM)
            for proc in running:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the process group; torchrun's workers go with the namespace
                    proc.wait()
        shutil.rmtree(self.redis_dir, ignore_errors=True)


def _ppoz() -> list[str]:
    return [sys.executable, "-m", "ppoz.cli", "--log-level", "info"]


# --- watching it ---------------------------------------------------------------------------------
@dataclass
class Sample:
    at: float  # time.monotonic(), the same clock in every namespace
    present: set[str]  # the actors registered at the broker
    served: dict[str, int]  # steps each actor has served since the start (kept while it is away)
    actor_versions: dict[str, int]
    storage_ok: bool
    version: int  # the learner's newest version (the last one read while Redis is down)


class Watch:
    """The broker's status, read from the root namespace (`sample()`)."""

    def __init__(self, farm: Farm) -> None:
        self.farm = farm
        self.status = Client(farm.frontend, deadline=3.0, attempt_timeout=1.0)
        self.samples: list[Sample] = []
        self.counted: dict[str, int] = {}  # jobs answered by an actor's earlier registrations (a new one counts from 0)

    def sample(self) -> Sample | None:
        self.farm.check_alive()
        try:
            status = self.status.status()
        except Exception as e:  # noqa: BLE001 - a missed reading, not a finding
            log.info("no status: %s", e)
            return None
        last = self.samples[-1] if self.samples else None
        served = dict(last.served) if last else {}
        versions = dict(last.actor_versions) if last else {}
        present = set()
        for actor in status["actors"]:
            name = actor["name"]
            if name in present:
                continue  # an old registration not dropped yet beside its new one: the first listed counts
            present.add(name)
            if last is not None and name not in last.present:  # registered anew: its count starts from 0 again
                self.counted[name] = served.get(name, 0)
            served[name] = self.counted.get(name, 0) + actor["served"]
            versions[name] = actor["policy_version"]
        storage_ok = bool(status["storage_ok"])
        # The broker reads the learner's figures from Redis: none while Redis is away, so keep the last one.
        learner = status.get("learner") or {}
        version = int(learner["version"]) if isinstance(learner.get("version"), (int, float)) else last.version if last else 0
        sample = Sample(time.monotonic(), present, served, versions, storage_ok, version)
        self.samples.append(sample)
        return sample

    def until(self, what: str, condition: Callable[[Sample], bool], timeout: float, period: float = 1.0) -> float:
        """Sample every `period` s until `condition` holds; when it did (monotonic time). RuntimeError past `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            sample = self.sample()
            if sample is not None and condition(sample):
                return sample.at
            if time.monotonic() > deadline:
                raise RuntimeError(f"the farm did not reach this within {timeout:.0f} s: {what}")
            time.sleep(period)

    def mark(self) -> Sample:
        """A sample now (a few tries: a status request can be lost)."""
        self.until("a reading of the broker's status", lambda _s: True, 30, period=0.2)
        return self.samples[-1]

    def hold(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(max(0.0, min(1.0, end - time.monotonic())))

    def close(self) -> None:
        self.status.close()


# A recovery is timed by sampling this often; its figures are good to about this much.
RECOVERY_PERIOD_S = 0.2
UPDATE_EVENT = re.compile(r"^(\S+ \S+) INFO learner_node\.worker: update (\d+): (?:training on (\d+) transitions|version)", re.M)


def learner_updates(text: str) -> dict[int, dict[str, Any]]:
    """The learner's updates from its log: number -> {"start": datetime, "transitions": n, "end": datetime}."""
    updates: dict[int, dict[str, Any]] = {}
    for when, number, transitions in UPDATE_EVENT.findall(text):
        at = datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f")
        update = updates.setdefault(int(number), {})
        if transitions:
            update.update(start=at, transitions=int(transitions))
        else:
            update["end"] = at
    return updates


# --- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace, workdir: Path) -> Report:
    net = Network()
    report = Report(dict(net.addresses), args.clients)
    started = time.monotonic()
    farm: Farm | None = None
    try:
        net.create()
        blocked = net.unreachable("store")
        if blocked:
            every_other = len(blocked) == len(net.namespaces) - 1
            cause = (
                "this machine filters bridged traffic, probably (usually br_netfilter with net.bridge.bridge-nf-call-iptables = 1"
                " and a FORWARD policy of DROP; allow the bridge in FORWARD, or set that sysctl to 0)"
                if every_other
                else "their links or namespaces do not work (see `ip netns` and `ip link`)"
            )
            raise NamespacesUnavailable(
                f"{', '.join(blocked)} cannot reach the store host ({net.addresses['store']}) across the bridge {net.bridge}: {cause}"
            )
        farm = Farm(net, workdir, args.seed, args.lora_rank)
        farm.start()
        _play(args, farm, report)
    finally:
        # A second signal must not cut the clean-up short.
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
            signal.signal(signum, signal.SIG_IGN)
        report.seconds = round(time.monotonic() - started, 1)
        if farm is not None:
            farm.stop()
        net.destroy()
    return report


def _play(args: argparse.Namespace, farm: Farm, report: Report) -> None:
    """Clients on, the faults, clients off; then the ledger and the actors' versions."""
    stop_file, played = farm.workdir / "clients.stop", farm.workdir / "clients.json"
    watch = Watch(farm)
    try:
        log.info("farm: %s", ", ".join(f"{host} {address}" for host, address in farm.net.addresses.items()))
        watch.until("both actors registered at the broker", lambda s: len(s.present) == 2, 600)
        play = [sys.executable, "-m", "tools.reliability.farm", "play", farm.frontend, str(args.clients), str(args.seed)]
        farm._spawn("clients", "clients", [*play, str(stop_file), str(played)])
        try:
            watch.until("the learner's first update", lambda s: s.version >= 1, 600)
            # The steady phase starts once the clients step again: the learner's first rollouts leave a backlog,
            # and the broker answers asks with `wait` until the learner has trained it (max_stream_backlog = -1).
            served = sum(watch.samples[-1].served.values())
            watch.until("the clients to step after the first update", lambda s: sum(s.served.values()) > served, 600)
            _scenario(args, farm, watch, report)
        except RuntimeError as e:
            report.stuck = str(e)
            log.error("farm: %s", e)
        log.info("farm: the clients stop; the learner trains what is left")
        stop_file.touch()
        clients = farm.procs["clients"]
        code = clients.wait(300)
        del farm.procs["clients"]
        if code != 0:
            raise RuntimeError(f"the clients exited with code {code}:\n{farm.said('clients')}")
        _read_clients(played, report)
        if report.stuck:
            report.ledger = "not read: the scenario stopped early"
            return
        client = connect(farm.redis_url)
        try:
            ledger = settle_ledger(client, KEY_PREFIX, report.acknowledged, args.settle_s, farm.check_alive)
            report.ledger, report.ledger_balanced = str(ledger), ledger.balanced

            # The learner acknowledges a rollout before it publishes the version trained on it: wait for the
            # newest snapshot, the learner's figures and both registered actors to agree on one version.
            def agreed(s: Sample) -> bool:
                report.final_version = _newest_version(client)
                both = s.present == {"actor-a", "actor-b"}
                return both and s.version == report.final_version and set(s.actor_versions.values()) == {report.final_version}

            try:
                watch.until("both actors serving the newest version", agreed, 120)
            except RuntimeError as e:
                log.warning("%s", e)
            report.actor_versions = {name: v for name, v in watch.samples[-1].actor_versions.items() if name in watch.samples[-1].present}
        finally:
            client.close()
    finally:
        watch.close()


def _newest_version(client: Any) -> int:
    stored = latest(client, KEY_PREFIX)
    return stored.version if stored is not None else -1


def _scenario(args: argparse.Namespace, farm: Farm, watch: Watch, report: Report) -> None:
    net = farm.net
    phases: list[tuple[str, Sample]] = []

    def mark(name: str) -> Sample:
        sample = watch.mark()
        phases.append((name, sample))
        log.info("farm: %s (learner version %d, jobs answered %s)", name, sample.version, sample.served)
        return sample

    # 1. actor-a cut off for actor_cut_s.
    mark("steady")
    watch.hold(args.phase_s)
    mark("actor-a cut off")
    net.cut("actor-a")
    cut_at = time.monotonic()
    gone = watch.until("the broker to drop actor-a", lambda s: "actor-a" not in s.present, args.actor_cut_s + 60, RECOVERY_PERIOD_S)
    report.recovery_s["actor dropped (after the cut)"] = round(gone - cut_at, 1)
    watch.hold(max(0.0, cut_at + args.actor_cut_s - time.monotonic()))
    away = mark("actor-a back")
    dropped = next(s for s in watch.samples if s.at >= gone)
    report.actor_a_served_cut_off = away.served.get("actor-a", 0) - dropped.served.get("actor-a", 0)
    net.restore("actor-a")
    restored = time.monotonic()
    back = watch.until("actor-a to rejoin", lambda s: "actor-a" in s.present, 120, RECOVERY_PERIOD_S)
    report.recovery_s["actor rejoined"] = round(back - restored, 1)
    before = away.served.get("actor-a", 0)
    serving = watch.until("actor-a to serve again", lambda s: s.served.get("actor-a", 0) > before, 300, RECOVERY_PERIOD_S)
    report.recovery_s["actor serving again"] = round(serving - restored, 1)
    watch.hold(args.phase_s)

    # 2. learn-1 cut off during an update: the cut follows the learner's log line that starts one.
    known = set(learner_updates(farm.said("learn-0", chars=10**7)))

    def update_started() -> int:
        for number, update in learner_updates(farm.said("learn-0", chars=10**7)).items():
            if number not in known and update.get("transitions") and "end" not in update:
                return number
        return 0

    deadline = time.monotonic() + 300
    while not (number := update_started()):
        farm.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError("the learner started no update with transitions to train in 300 s")
        time.sleep(0.05)
    cut = mark("learn-1 cut off")
    net.cut("learn-1")
    cut_wall, cut_at = datetime.now(), time.monotonic()
    watch.hold(args.learner_cut_s)
    report.learner_held_during_cut = all(s.version == cut.version for s in watch.samples if s.at >= cut_at)
    mark("learn-1 back")
    net.restore("learn-1")
    restored = time.monotonic()
    published = watch.until("the learner to publish again", lambda s: s.version > cut.version, 600, RECOVERY_PERIOD_S)
    report.recovery_s["learner published again"] = round(published - restored, 1)
    ended = learner_updates(farm.said("learn-0", chars=10**7)).get(number, {}).get("end")
    report.cut_update = number if ended is not None and ended > cut_wall else 0  # it had not ended when the link went
    watch.hold(args.phase_s)

    # 3. Redis killed on the store host, restarted on its append-only file.
    mark("redis down")
    farm.kill_redis()
    killed = time.monotonic()
    noticed = watch.until("the broker to notice Redis gone", lambda s: not s.storage_ok, 60, RECOVERY_PERIOD_S)
    report.recovery_s["broker noticed Redis gone (after the kill)"] = round(noticed - killed, 1)
    watch.hold(max(0.0, killed + args.redis_down_s - time.monotonic()))
    mark("redis back")
    restarting = time.monotonic()
    farm.start_redis()
    report.redis_back_at = time.monotonic()  # the times below count from here: Redis answering again
    report.recovery_s["redis restart to answering"] = round(report.redis_back_at - restarting, 1)
    ok = watch.until("the broker's storage to be back", lambda s: s.storage_ok, 120, RECOVERY_PERIOD_S)
    report.recovery_s["broker storage back"] = round(ok - report.redis_back_at, 1)
    watch.hold(args.phase_s)  # "clients stepping again" comes from the clients' own times (_read_clients)
    mark("end")

    for (name, start), (_, end) in zip(phases, phases[1:], strict=False):
        in_phase = [s for s in watch.samples if start.at <= s.at <= end.at]
        report.phases.append(
            Phase(
                name,
                round(end.at - start.at, 1),
                {host: end.served.get(host, 0) - start.served.get(host, 0) for host in ("actor-a", "actor-b")},
                0,
                (start.version, max(s.version for s in in_phase)),
                start.at,
                end.at,
            )
        )


def _read_clients(played: Path, report: Report) -> None:
    """The clients host's own account: steps with their times, requests, resends and failures."""
    data = json.loads(played.read_text())
    report.steps, report.acknowledged = len(data["step_times"]), data["acknowledged"]
    report.requests, report.retries = data["requests"], data["attempts"] - data["requests"]
    report.errors, report.error_count = data["errors"], data["error_count"]
    report.ask_waits = data["ask_waits"]
    for phase in report.phases:
        phase.client_steps = sum(1 for t in data["step_times"] if phase.start_at <= t < phase.end_at)
    after = [t for t in data["step_times"] if report.redis_back_at and t > report.redis_back_at]
    if after:
        report.recovery_s["clients stepping again"] = round(min(after) - report.redis_back_at, 1)


# --- the clients host ----------------------------------------------------------------------------
def play(frontend: str, clients: int, seed: int, stop_file: Path, out: Path) -> None:
    """Run on the clients host: Kea-shaped emulators until `stop_file` exists, then their account as JSON."""
    import asyncio

    driver = Clients(frontend, clients, seed)
    asyncio.run(driver.run(float("inf"), lambda _end: None, 3600.0, until=stop_file.exists))
    out.write_text(
        json.dumps(
            {
                "step_times": [driver.started + t for t, _ms in driver.latencies],
                "acknowledged": driver.acknowledged,
                "requests": driver.requests,
                "attempts": driver.attempts,
                "ask_waits": driver.ask_waits,
                "errors": driver.errors,
                "error_count": driver.error_count,
            }
        )
    )


def _end_run(signum: int, _frame: Any) -> None:
    what = "its --deadline-s" if signum == signal.SIGALRM else signal.Signals(signum).name
    raise SystemExit(f"ppoz bench farm: stopped by {what}; cleaning up")


def main(args: argparse.Namespace) -> int:
    why = namespaces_unavailable()
    if why:
        raise SystemExit(f"ppoz bench farm: {why}")
    for name in ("clients", "actor_cut_s", "learner_cut_s", "redis_down_s", "phase_s", "settle_s", "deadline_s"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"ppoz bench farm: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    # SIGTERM, SIGINT (which a shell ignores in background jobs) and the deadline end the run through its
    # `finally` blocks: the processes stopped, the namespaces and the bridge removed.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(signum, _end_run)
    signal.alarm(max(1, int(args.deadline_s)))
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ppoz-farm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = run(args, workdir)
    except NamespacesUnavailable as e:  # a step of `ip`, or the bridge, failed: say which, not a traceback
        raise SystemExit(f"ppoz bench farm: {e}") from None
    finally:
        signal.alarm(0)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return print_report(report, args.json, format_report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["play"]:  # the clients host's process, started by `run`
        frontend, n, seed, stop_file, out = sys.argv[2:7]
        logging.basicConfig(level=logging.WARNING)
        play(frontend, int(n), int(seed), Path(stop_file), Path(out))
    else:
        run_as_script("python -m tools.reliability.farm", __doc__, add_arguments, main, logging.INFO)
