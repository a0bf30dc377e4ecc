"""Optional CURVE encryption and authentication for PPOZ's ZeroMQ sockets (docs/security.md).

Keys are zmq.auth certificate files, as `ppoz keygen NAME` writes them:
NAME.key holds the public key (hand it to the peers that must accept NAME),
NAME.key_secret holds the public and the secret key (mode 0600; it never
leaves its machine).

Server side (broker front and back end, the learner's weight PUB):
`apply_server` makes a socket a CURVE server and registers its allow-list
with the one ZAP handler of the socket's context (zmq.auth's
ThreadAuthenticator, started with the first server socket and stopped with
the last). Each server socket gets a ZAP domain of its own, so the broker's
client front end and actor back end keep separate allow-lists in one context.
An allow-list is a directory of public key files, re-read when its contents
change, or ALLOW_ANY ("*"): any key, encryption without authentication.

Client side (clients, the gateway, the actor's DEALER and SUB): `client_keys`
loads a key pair and the server's public key once, and `ClientKeys.apply`
sets them on every new socket before it connects.

Every error names the setting and the file: KeyFileError is a ValueError, so a
config's __post_init__ can raise it and `ppoz` reports it as a config error.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import struct
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger(__name__)

ALLOW_ANY = "*"
"""An allow-list value: accept any client key (encryption without authentication)."""

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
KEY_CHARS = 40  # a 32-byte CURVE key in Z85

KeySource = str | bytes | os.PathLike
"""A key file's path, or the Z85 key itself."""


class KeyFileError(ValueError):
    """A key file or allow-list that is missing, unreadable, or holds no key of the kind needed."""


def has_curve() -> bool:
    return bool(zmq.has("curve"))


# --- key files ---------------------------------------------------------------------------------
def generate_keypair(directory: str | os.PathLike, name: str, force: bool = False) -> tuple[Path, Path]:
    """Write DIR/NAME.key (public) and DIR/NAME.key_secret (secret, mode 0600); return both paths.

    Existing files are kept (FileExistsError) unless `force`."""
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"a key name must be a plain file name such as `broker`, got {name!r}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing and not force:
        raise FileExistsError(
            f"{' and '.join(existing)} already exist; pass --force to replace them (peers holding the old public key will be refused)"
        )
    for path in (public, secret):
        path.unlink(missing_ok=True)
    # Create the secret file 0600 before a key is written to it: zmq.auth opens it with
    # "w", which keeps the mode, so the secret is never readable by others, not even briefly.
    os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return public, secret


def load_keypair(path: str | os.PathLike, what: str = "curve_secret_key") -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a NAME.key_secret file; `what` names the setting in errors."""
    public, secret = _read_certificate(path, what)
    if secret is None:
        raise KeyFileError(f"`{what}`: {path} holds no secret key; give the NAME{SECRET_SUFFIX} file `ppoz keygen` wrote")
    _check_key(secret, what, path)
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"`{what}`: in {path} the public key does not belong to the secret key; make a new pair with `ppoz keygen`")
    mode = os.stat(path).st_mode
    if mode & 0o077:
        log.warning("%s (%s) is readable by other users (mode %o); `chmod 600 %s`", path, what, mode & 0o777, path)
    return public, secret


def load_public(path: str | os.PathLike, what: str = "curve_server_key") -> bytes:
    """The Z85 public key of a NAME.key (or NAME.key_secret) file."""
    public, _ = _read_certificate(path, what)
    return public


def _read_certificate(path: str | os.PathLike, what: str) -> tuple[bytes, bytes | None]:
    if not str(path):
        raise KeyFileError(f"`{what}`: no key file given")
    if not os.path.exists(path):
        raise KeyFileError(f"`{what}`: key file {path} does not exist (make one with `ppoz keygen NAME`)")
    if os.path.isdir(path):
        raise KeyFileError(f"`{what}`: {path} is a directory, not a key file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise KeyFileError(f"`{what}`: cannot read key file {path}: {e.strerror or e}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise KeyFileError(f"`{what}`: {path} is not a key file (no public-key line): {e}") from e
    _check_key(public, what, path)
    return public, secret


def _check_key(key: bytes, what: str, where: Any) -> None:
    try:
        ok = len(key) == KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError, OverflowError, struct.error):
        ok = False
    if not ok:
        raise KeyFileError(f"`{what}`: {where} does not hold a {KEY_CHARS}-character Z85 CURVE key")


def _as_key(value: KeySource) -> bytes | None:
    """A Z85 key given as such (bytes, or 40 characters naming no file), else None (a file path)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, os.PathLike):
        return None
    if len(value) == KEY_CHARS and not os.path.exists(value):
        return value.encode("ascii", "replace")
    return None


def _public_from(value: KeySource, what: str) -> bytes:
    key = _as_key(value)
    if key is None:
        return load_public(cast("str | os.PathLike", value), what)  # _as_key took bytes as a key
    _check_key(key, what, "the value given")
    return key


def _pair_from(value: KeySource, what: str) -> tuple[bytes, bytes]:
    key = _as_key(value)
    if key is None:
        return load_keypair(cast("str | os.PathLike", value), what)
    _check_key(key, what, "the value given")
    return zmq.curve_public(key), key


# --- client side -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientKeys:
    """A client's key pair and the public key of the server it connects to."""

    public: bytes
    secret: bytes = field(repr=False)  # never in a log line
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client; call before connect."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)


def client_keys(
    secret_key: KeySource | None,
    server_key: KeySource | None,
    names: tuple[str, str] = ("curve_secret_key", "curve_server_key"),
) -> ClientKeys | None:
    """Keys for a CURVE client, or None (CURVE off) when `server_key` is empty.

    Each is a key file path or a Z85 key. Without `secret_key` the client uses a
    fresh key pair of its own, which only a server whose allow-list is "*" accepts.
    `names` are the settings the errors name."""
    if not server_key:
        if secret_key:
            raise KeyFileError(f"`{names[0]}` is set but `{names[1]}` is empty: CURVE needs the server's public key")
        return None
    _require_curve()
    server = _public_from(server_key, names[1])
    public, secret = _pair_from(secret_key, names[0]) if secret_key else zmq.curve_keypair()
    return ClientKeys(public, secret, server)


def apply_client(sock: zmq.Socket, client_secret_file: KeySource | None, server_public_file: KeySource) -> ClientKeys:
    """Load the keys and make `sock` a CURVE client (before connect)."""
    keys = client_keys(client_secret_file, server_public_file)
    if keys is None:
        raise KeyFileError("`curve_server_key`: no server key given")
    keys.apply(sock)
    return keys


# --- server side -------------------------------------------------------------------------------
class AllowList:
    """The ZAP check of one server socket: is a connecting client's public key allowed?

    `location` is a directory of NAME.key files (re-read when it changes, so a key
    added or removed there applies to the next connection) or ALLOW_ANY."""

    def __init__(self, location: str, domain: str) -> None:
        self.location = location
        self.domain = domain
        self.allowed = 0
        self.refused = 0
        self._keys: set[bytes] = set()
        self._stamp: tuple[int, ...] | None = None
        self._logged: set[bytes] = set()
        self._context_key: int | None = None
        if location != ALLOW_ANY:
            self._reload()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """zmq.auth's credentials-provider hook (runs on the ZAP thread); `client_key` is Z85."""
        ok = self.location == ALLOW_ANY or client_key in self._current()
        if ok:
            self.allowed += 1
        else:
            self.refused += 1
            if client_key not in self._logged and len(self._logged) < 1000:  # a refused peer retries every 100 ms
                self._logged.add(client_key)
                log.warning(
                    "refused a CURVE client with key %s: not in the allow-list %s", client_key.decode(errors="replace"), self.location
                )
        return ok

    def close(self) -> None:
        """Forget this socket's domain; the context's ZAP handler stops with its last allow-list."""
        _unregister(self)

    def _current(self) -> set[bytes]:
        try:
            stamp = self._stamp_now()
        except OSError as e:
            log.error("cannot read the allow-list %s: %s; refusing every key until it is back", self.location, e)
            return set()
        if stamp != self._stamp:
            self._reload()
        return self._keys

    def _stamp_now(self) -> tuple[int, ...]:
        folder = Path(self.location)
        files = sorted(folder.glob(f"*{PUBLIC_SUFFIX}"))
        return (folder.stat().st_mtime_ns, len(files), *(f.stat().st_mtime_ns for f in files))

    def _reload(self) -> None:
        try:
            self._stamp = self._stamp_now()
            self._keys = set(zmq.auth.load_certificates(self.location))
        except (OSError, ValueError) as e:
            log.error("cannot load the allow-list %s: %s; refusing every key", self.location, e)
            self._keys, self._stamp = set(), None
            return
        if not self._keys:
            log.warning("the allow-list %s holds no %s files: every CURVE client is refused", self.location, PUBLIC_SUFFIX)


_lock = threading.Lock()
_handlers: dict[int, tuple[Any, set[AllowList]]] = {}  # context handle -> (ThreadAuthenticator, its allow-lists)


def _register(ctx: zmq.Context, allow_list: AllowList) -> None:
    from zmq.auth.thread import ThreadAuthenticator

    key = ctx.underlying  # shadow contexts share the inproc ZAP endpoint of the context they shadow
    with _lock:
        entry = _handlers.get(key)
        if entry is None:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
            try:
                auth.start()
            except zmq.ZMQError as e:
                raise RuntimeError(f"cannot start the ZAP handler in this ZeroMQ context (is another one bound there?): {e}") from e
            entry = _handlers[key] = (auth, set())
        auth, allow_lists = entry
        auth.configure_curve_callback(allow_list.domain, allow_list)
        allow_lists.add(allow_list)
        allow_list._context_key = key


def _unregister(allow_list: AllowList) -> None:
    with _lock:
        key = allow_list._context_key
        entry = _handlers.get(key) if key is not None else None
        if entry is None or key is None:
            return
        auth, allow_lists = entry
        auth.credentials_providers.pop(allow_list.domain, None)
        allow_lists.discard(allow_list)
        allow_list._context_key = None
        if not allow_lists:
            del _handlers[key]
            auth.stop()


def apply_server(sock: zmq.Socket, secret_key_file: str, allowed: str, name: str = "server") -> AllowList:
    """Make `sock` a CURVE server whose clients must be in `allowed`; call before bind.

    `allowed` is a directory of public key files or ALLOW_ANY. Returns the socket's
    allow-list; close it after the socket (the last one stops the ZAP handler)."""
    _require_curve()
    check_allow_list(allowed, "allowed")
    public, secret = load_keypair(secret_key_file)
    allow_list = AllowList(allowed, f"ppoz-{name.replace(' ', '-')}-{uuid.uuid4().hex[:8]}")
    _register(sock.context, allow_list)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.ZAP_DOMAIN, allow_list.domain.encode())
    log.info(
        "CURVE on for the %s socket (key %s): clients %s",
        name,
        public.decode(),
        "with any key" if allowed == ALLOW_ANY else f"whose keys are in {allowed}",
    )
    return allow_list


# --- config checks (for __post_init__) -------------------------------------------------------
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")  # the names of this machine that no other machine reaches


def is_loopback_host(host: str) -> bool:
    """`localhost`, or an address in 127.0.0.0/8 or ::1 (bare or in brackets)."""
    bare = host.strip("[]").lower()
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this machine can reach a ZeroMQ `endpoint` bound here: ipc:// and inproc://, or tcp:// on a
    loopback address (127.0.0.0/8, ::1, localhost). `*`, 0.0.0.0, an interface name or address: reachable."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    return transport == "tcp" and is_loopback_host(rest.rsplit(":", 1)[0])


def check_allow_list(value: str, what: str) -> None:
    """An allow-list setting must be ALLOW_ANY or an existing directory."""
    if value == ALLOW_ANY:
        return
    if not value:
        raise KeyFileError(
            f"`{what}` is required with `curve_secret_key`: a directory of the allowed peers' NAME{PUBLIC_SUFFIX} "
            f"files, or {ALLOW_ANY!r} to accept any key (encryption without authentication)"
        )
    if not os.path.isdir(value):
        raise KeyFileError(f"`{what}`: allow-list directory {value} does not exist (it holds the allowed peers' NAME{PUBLIC_SUFFIX} files)")


def check_server_settings(secret_key: str, allow_lists: dict[str, str]) -> None:
    """A server's CURVE settings: both set (a key pair file, allow-lists) or neither."""
    if not secret_key:
        for name, value in allow_lists.items():
            if value:
                raise KeyFileError(
                    f"`{name}` = {value!r} is set but `curve_secret_key` is empty: CURVE would be off and "
                    "nothing checked; set `curve_secret_key` too, or leave both empty"
                )
        return
    _require_curve()
    load_keypair(secret_key, "curve_secret_key")
    for name, value in allow_lists.items():
        check_allow_list(value, name)


def check_client_settings(secret_key: str, server_keys: dict[str, str]) -> None:
    """A client's CURVE settings: each server key given turns CURVE on for that connection."""
    if secret_key and not any(server_keys.values()):
        names = " and ".join(f"`{n}`" for n in server_keys)
        raise KeyFileError(
            f"`curve_secret_key` is set but {names} {'is' if len(server_keys) == 1 else 'are'} empty: CURVE needs the server's public key"
        )
    for name, value in server_keys.items():
        if value:
            client_keys(secret_key, value, ("curve_secret_key", name))


def _require_curve() -> None:
    if not has_curve():
        raise KeyFileError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE; install a pyzmq wheel (they bundle libsodium)")


__all__ = [
    "ALLOW_ANY",
    "LOOPBACK_NAMES",
    "is_local_endpoint",
    "is_loopback_host",
    "AllowList",
    "ClientKeys",
    "KeyFileError",
    "apply_client",
    "apply_server",
    "check_allow_list",
    "check_client_settings",
    "check_server_settings",
    "client_keys",
    "generate_keypair",
    "load_keypair",
    "load_public",
]


def read_secret(variable: str, path: str | None, what: str, path_setting: str) -> str | None:
    """A secret (a password, a token) from the environment variable `variable`, else the first line of the file
    at `path` (named by `path_setting`); None when neither is set. Never from a flag: argv is public (`ps`).
    ValueError, naming where it looked and never the secret, for an unreadable or empty file and for a control
    character (a line break would split the protocol line it goes into)."""
    secret = os.environ.get(variable)
    where = variable
    if not secret and path:
        where = f"the file {path} ({path_setting})"
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read the {what} file {path} ({path_setting}): {e.strerror}") from e
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ValueError(f"the {what} file {path} ({path_setting}) is empty")
    if secret and any(ord(c) < 32 or ord(c) == 127 for c in secret):
        raise ValueError(f"the {what} in {where} holds a control character (a line break?)")
    return secret or None
