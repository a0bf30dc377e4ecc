"""The gateway's configuration (TOML table [gateway], or flags of `ppoz gateway`)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from common.config import check, curve_broker_key, curve_key_pair, local_path, option, section
from common.protocol import DEFAULT_MAX_ABS_REWARD, is_reward_bound
from common.security import LOOPBACK_NAMES, check_client_settings, read_secret

TOKEN_ENV = "PPOZ_GATEWAY_TOKEN"


@section("gateway")
@dataclass
class GatewayConfig:
    host: str = option("127.0.0.1", "address the HTTP server binds (0.0.0.0: every interface)")
    port: int = option(8000, "HTTP port (PPOAPI's default is 8000)")
    broker: str = option("tcp://127.0.0.1:5555", "the broker's client endpoint (its `frontend`)")
    request_deadline_s: float = option(60.0, "longest one HTTP request waits for the broker, retries included")
    attempt_timeout_s: float = option(10.0, "longest wait for one attempt's reply before the request is sent again")
    generate_deadline_s: float = option(
        300.0,
        "POST /generate: longest it waits for the response, retries included; a request's deadline_ms may shorten it,"
        " and a longer one is lowered to it (as the broker lowers it to its generate_timeout_ms)",
    )
    max_inflight: int = option(256, "most requests forwarded at once; more wait for a free slot until their deadline")
    max_body_bytes: int = option(8 * 1024 * 1024, "largest HTTP request body accepted")
    max_abs_reward: float = option(
        DEFAULT_MAX_ABS_REWARD,
        "POST /feedback: the largest |reward| forwarded; a larger or non-finite one gets 400 here (the broker's own"
        " [broker] max_abs_reward still holds: set both, or the key once at the top of a shared file)",
    )
    curve_secret_key: str = curve_key_pair("the gateway's", "; its NAME.key goes in the broker's curve_allowed_clients")
    curve_server_key: str = curve_broker_key()
    allowed_hosts: list = option(
        list(LOOPBACK_NAMES),
        "names a request's Host header may give (with any port), so a web page cannot reach the gateway by a name of"
        " its own (DNS rebinding); `host`, when a specific address, is added. Bound to 0.0.0.0: add the names and"
        " addresses the emulators use",
    )
    allowed_origins: list = option(
        [],
        'browser origins (e.g. "http://localhost:3000") whose requests are served; any other Origin header gets 403,'
        " so a web page open on the machine cannot attach, step or send rewards (emulators send none)",
    )
    token_file: str = option(
        "",
        f"a file whose first line is the bearer token every request must carry (Authorization: Bearer TOKEN); or set"
        f" {TOKEN_ENV}. Empty and unset: no token (unmodified Kea builds send none)",
        path=local_path,
    )
    read_deadline_s: float = option(
        10.0,
        "longest a connection may take to send one request's line, headers and body, and to stay idle between requests;"
        " past it the connection is closed, so a slow sender never holds a worker",
    )
    max_connections: int = option(512, "connections served at once (a thread each); one more is answered 503 and closed at once")

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
        check(self.read_deadline_s > 0, f"`read_deadline_s` must be positive, got {self.read_deadline_s}")
        check(self.max_connections >= 1, f"`max_connections` must be at least 1, got {self.max_connections}")
        check(
            all(_is_host(h) for h in self.allowed_hosts),
            f"`allowed_hosts` must be host names or addresses without a port, got {self.allowed_hosts!r}",
        )
        check(
            all(isinstance(o, str) and "://" in o and not o.endswith("/") for o in self.allowed_origins),
            f'`allowed_origins` must be origins such as "http://localhost:3000" (no path), got {self.allowed_origins!r}',
        )
        check(not self.token_file or os.path.isfile(self.token_file), f"`token_file` {self.token_file!r} is not a file")

    def hosts(self) -> frozenset[str]:
        """The Host names accepted: `allowed_hosts`, and `host` when it is one address (not every interface)."""
        names = {h.strip("[]").lower() for h in self.allowed_hosts}
        if self.host not in ("", "0.0.0.0", "::"):
            names.add(self.host.strip("[]").lower())
        return frozenset(names)

    def token(self) -> str | None:
        """The bearer token (TOKEN_ENV, else `token_file`'s first line), or None: no token required."""
        return read_secret(TOKEN_ENV, self.token_file, "gateway token", "token_file")


def _is_host(value: object) -> bool:
    """A host name or an address (IPv6 bare or in brackets), without a port or a path."""
    if not isinstance(value, str) or not value:
        return False
    bare = value.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return True
    except ValueError:
        return ":" not in bare and "/" not in bare and " " not in bare
