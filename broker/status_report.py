"""The broker's figures: the `status` reply (`ppoz status`), systemd's STATUS= line, the metrics endpoint."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from broker.metrics import latency_summary
from broker.state import BrokerState


class StatusReport(BrokerState):
    """The figures of the broker's state, as its status reply and its STATUS= line give them."""

    def status_line(self) -> str:
        """The key figures in one line (systemd's STATUS=)."""
        return (
            f"{len(self.sessions)} sessions, {len(self.registry.actors)} actors, {len(self.jobs)} steps in flight, "
            f"{len(self.queue)} queued, {self.metrics['broker/steps']} steps, stream backlog {self.stream_transitions} transitions"
            + ("" if self.storage_ok else ", REDIS DOWN")
        )

    def status(self, window_s: float = 60.0) -> dict[str, Any]:
        """The `status` reply's figures (docs/protocol.md, section 3, lists each)."""
        return {
            "added_latency": latency_summary(self.outbox.added_latency, window_s),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "sessions": len(self.sessions),
            "pending_steps": sum(s.pending is not None for s in self.sessions.values()),
            "queued_jobs": len(self.queue),
            "jobs": len(self.jobs),
            "stream_length": self.stream_length,
            "stream_read": self.stream_read,
            "stream_transitions": self.stream_transitions,
            "stream_backlog_limit": self.backlog_limit,
            "storage_ok": self.storage_ok,
            "actors": [
                {"name": a.name, "credits": a.credits, "inflight": len(a.inflight), "policy_version": a.policy_version, "served": a.served}
                for a in self.registry.actors.values()
            ],
            "counters": dict(self.metrics),
            "steps_per_s": round(self.step_rate.rate(), 3),
            "learner": self._learner(),
            "limits": dataclasses.asdict(self.limits),
        }
