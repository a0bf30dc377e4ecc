"""The actor's configuration (TOML table [actor], or flags of `ppoz actor`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check, option, section

POLICIES = ("uniform",)


@section("actor")
@dataclass
class ActorConfig:
    broker: str = option("tcp://127.0.0.1:5556", "the broker's actor endpoint (its `backend`) to connect to")
    name: str = option("", "name shown in the broker's status (default: actor-<random>)")
    policy: str = option("uniform", "what scores the candidates; `uniform` needs no model (a baseline and a test stand-in)")
    credits: int = option(16, "most requests the broker may hand this actor at once")
    max_batch: int = option(8, "most requests scored together")
    heartbeat_ms: int = option(1000, "heartbeat interval towards the broker")
    heartbeat_liveness: int = option(3, "the broker is taken as gone after this many silent intervals; the actor reconnects")
    seed: int = option(0, "random seed for sampling")

    def __post_init__(self) -> None:
        check("://" in self.broker, f"`broker` must be a ZeroMQ endpoint such as tcp://127.0.0.1:5556, got {self.broker!r}")
        check(self.policy in POLICIES, f"`policy` must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check(self.credits > 0, f"`credits` must be positive, got {self.credits}")
        check(self.max_batch > 0, f"`max_batch` must be positive, got {self.max_batch}")
        check(self.heartbeat_ms >= 10, f"`heartbeat_ms` must be at least 10, got {self.heartbeat_ms}")
        check(self.heartbeat_liveness >= 2, f"`heartbeat_liveness` must be at least 2, got {self.heartbeat_liveness}")
