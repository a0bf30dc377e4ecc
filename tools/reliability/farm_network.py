"""The farm's network (`ppoz bench farm`, tools/reliability/farm.py): one Linux network namespace per host, each
joined to one bridge in the root namespace by a veth link, which goes down and up on demand."""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys

HOSTS = ("store", "actor-a", "actor-b", "learn-0", "learn-1", "clients")
BRIDGE_ADDRESS = 254  # the root namespace's address on the bridge
PROBE_PORT = 5559  # the reachability check's listener, gone before the stack starts
LISTEN = (
    "import socket, sys\ns = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "print('ready', flush=True)\nwhile True: s.accept()[0].close()"
)
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()"


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
