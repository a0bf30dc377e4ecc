"""The gateway's configuration (TOML table [gateway], or flags of `ppoz gateway`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check, option, section
from common.protocol import DEFAULT_MAX_ABS_REWARD, is_reward_bound
from common.security import check_client_settings


@section("gateway")
@dataclass
class GatewayConfig:
    host: str = option("127.0.0.1", "address the HTTP server binds (0.0.0.0: every interface)")
    port: int = option(8000, "HTTP port (PPOAPI's default is 8000)")
    broker: str = option("tcp://127.0.0.1:5555", "the broker's client endpoint (its `frontend`)")
    request_deadline_s: float = option(60.0, "longest one HTTP request waits for the broker, retries included")
    attempt_timeout_s: float = option(10.0, "longest wait for one attempt's reply before the request is sent again")
    generate_deadline_s: float = option(300.0, "POST /generate without deadline_ms: longest it waits for the response, retries included")
    max_inflight: int = option(256, "most requests forwarded at once; more wait for a free slot until their deadline")
    max_body_bytes: int = option(8 * 1024 * 1024, "largest HTTP request body accepted")
    max_abs_reward: float = option(
        DEFAULT_MAX_ABS_REWARD,
        "POST /feedback: the largest |reward| forwarded; a larger or non-finite one gets 400 here (the broker's own"
        " [broker] max_abs_reward still holds: set both, or the key once at the top of a shared file)",
    )
    curve_secret_key: str = option(
        "",
        "CURVE: the gateway's key pair file (NAME.key_secret from `ppoz keygen`); its NAME.key goes in the broker's curve_allowed_clients",
    )
    curve_server_key: str = option(
        "", "CURVE: the broker's public key file (NAME.key); set, the connection to the broker is encrypted (docs/security.md)"
    )

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, f"`port` must be 0-65535, got {self.port}")
        check(self.request_deadline_s > 0, f"`request_deadline_s` must be positive, got {self.request_deadline_s}")
        check(self.attempt_timeout_s > 0, f"`attempt_timeout_s` must be positive, got {self.attempt_timeout_s}")
        check(self.generate_deadline_s > 0, f"`generate_deadline_s` must be positive, got {self.generate_deadline_s}")
        check(self.max_inflight >= 1, f"`max_inflight` must be at least 1, got {self.max_inflight}")
        check(self.max_body_bytes >= 1024, f"`max_body_bytes` must be at least 1024, got {self.max_body_bytes}")
        check(
            is_reward_bound(self.max_abs_reward),
            f"`max_abs_reward` must be a positive finite number, got {self.max_abs_reward}",
        )
        check_client_settings(self.curve_secret_key, {"curve_server_key": self.curve_server_key})
