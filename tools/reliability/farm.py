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
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from common.config import local_path
from common.redis_server import connect
from common.weights import latest
from ppoz.flags import add_json_flag, add_seed_flag
from tools.bench import load_at_start
from tools.reliability.farm_network import NamespacesUnavailable, Network, namespaces_unavailable
from tools.reliability.farm_processes import KEY_PREFIX, RECOVERY_PERIOD_S, Farm, Sample, Watch, learner_updates
from tools.reliability.farm_report import Phase, Report, format_report
from tools.reliability.ledger import add_settle_flag, settle_ledger
from tools.reliability.output import print_report, run_as_script
from tools.reliability.soak import Clients

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16, help="simulated emulators on the clients host (default: 16)")
    parser.add_argument("--actor-cut-s", type=float, default=30.0, help="seconds actor-a's link is down (default: 30)")
    parser.add_argument("--learner-cut-s", type=float, default=20.0, help="seconds learn-1's link is down (default: 20)")
    parser.add_argument("--redis-down-s", type=float, default=5.0, help="seconds Redis stays dead before its restart (default: 5)")
    parser.add_argument(
        "--phase-s", type=float, default=20.0, help="seconds of undisturbed play before each fault and after the last (default: 20)"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="the learner's LoRA rank (0: all weights) (default: 8)")
    add_seed_flag(parser)
    parser.add_argument(
        "--deadline-s", type=float, default=1500.0, help="stop a run that takes longer than this, cleaning up (default: 1500)"
    )
    add_settle_flag(parser, 300.0, until="")
    parser.add_argument(
        "--keep", default="", type=local_path, help="keep the logs and checkpoints in this folder (default: a temporary one, removed)"
    )
    add_json_flag(parser, "print the report as one JSON object")


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
    load_at_start("farm")
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
