"""The farm's processes (`ppoz bench farm`, tools/reliability/farm.py): every host's, started through `ip netns
exec`, and the broker's status read from the root namespace while they run."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from client import Client
from common.learner_figures import Latest
from common.processes import die_with_parent
from common.redis_server import connect, find_redis_server
from ppoz.up import ppoz_command
from tools.reliability.farm_network import Network

log = logging.getLogger(__name__)

KEY_PREFIX = "farm"
REDIS_PORT, FRONTEND_PORT, BACKEND_PORT, WEIGHTS_PORT, RENDEZVOUS_PORT = 6379, 5555, 5556, 5557, 29500
PYTHON_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}


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
        self._spawn("broker", "store", ppoz_command("broker", "--frontend", self.frontend, "--backend", backend, *common))
        for name in ("actor-a", "actor-b"):
            actor = ["actor", "--name", name, "--broker", backend, "--weights", weights, "--weights-poll-s", "2"]
            self._spawn(name, name, ppoz_command(*actor, *"--credits 32 --max-batch 16".split(), *policy, *common))
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
            self._spawn(f"learn-{rank}", f"learn-{rank}", ppoz_command(*learner, python=torchrun))

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
        version = int(learner[Latest.VERSION]) if isinstance(learner.get(Latest.VERSION), (int, float)) else last.version if last else 0
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
