"""The farm's report (`ppoz bench farm`, tools/reliability/farm.py): its phases, the recoveries timed, and the
rules it passes by."""

from __future__ import annotations

from dataclasses import dataclass, field

from tools.reliability.output import ledger_and_steps_failures

RECOVERIES = ("actor rejoined", "actor serving again", "learner published again", "broker storage back", "clients stepping again")


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
        out += ledger_and_steps_failures(self.ledger_balanced, self.ledger, self.steps)
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
