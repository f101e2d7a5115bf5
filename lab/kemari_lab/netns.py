"""The lab network: namespaces, a bridge, TAPs and a veth, all created here.

```text
 this machine (root namespace: nothing is created here)
 ┌──────────────────────── namespace klab-<tag> ───────────────────────────┐
 │  bridge klbr (10.77.0.1/24)                                             │
 │   ├── tap vh0 ── QEMU/TCG virtual host 0 (eth0 in br0, 10.77.0.10)      │
 │   │                 └─ br0 ── tap g0 ── guest (10.77.0.100)            │
 │   ├── tap vh1 ── QEMU/TCG virtual host 1 (10.77.0.11) ...              │
 │   └── veth kcl ─┐                                                       │
 └─────────────────│───────────────────────────────────────────────────────┘
 ┌─ namespace klab-<tag>-c (client) ─┐
 │  veth kcl 10.77.0.2/24            │
 └───────────────────────────────────┘
```

Nothing leaves the namespaces: the lab bridge has no uplink.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from kemari_lab.errors import LabError

SUBNET_PREFIX = "10.77.0"
PREFIX_LEN = 24
BRIDGE = "klbr"
CLIENT_IF = "kcl"
NS_PREFIX = "klab-"


def host_ip(index: int) -> str:
    """Address of virtual host `index`."""
    return f"{SUBNET_PREFIX}.{10 + index}"


def guest_ip(host_index: int, guest_index: int) -> str:
    """Address of guest `guest_index` on virtual host `host_index`."""
    return f"{SUBNET_PREFIX}.{100 + 10 * host_index + guest_index}"


CLIENT_IP = f"{SUBNET_PREFIX}.2"
# The lab bridge's own address: services the lab runs on this machine, inside
# the lab namespace (the shared-disk NBD server), listen here.
BRIDGE_IP = f"{SUBNET_PREFIX}.1"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise LabError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of all network namespaces (ip netns list)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """PIDs of the processes inside namespace `ns`."""
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace: float = 3.0) -> None:
    """SIGTERM then SIGKILL each process in `ns` (all were started by the lab)."""
    pids = namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = namespace_pids(ns)
        if pids:
            time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespace(ns: str) -> None:
    """Kills what runs in `ns` and deletes it (its TAPs, bridge and veth go with it)."""
    if ns not in list_namespaces():
        return
    kill_namespace_processes(ns)
    _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Deletes lab namespaces left by lab runs whose process is gone."""
    removed = []
    for ns in list_namespaces():
        if not ns.startswith(NS_PREFIX):
            continue
        owner = ns[len(NS_PREFIX) :].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            delete_namespace(ns)
            removed.append(ns)
    return removed


class LabNetwork:
    """The namespaces of one lab run, named after the owning process."""

    def __init__(self, tag: str) -> None:
        self.ns = f"{NS_PREFIX}{tag}"
        self.client_ns = f"{NS_PREFIX}{tag}-c"
        self.taps: list[str] = []

    def create(self) -> None:
        """Creates the lab namespace with its bridge, and the client namespace."""
        for ns in (self.ns, self.client_ns):
            if ns in list_namespaces():
                raise LabError(f"namespace {ns} already exists")
        _ip("netns", "add", self.ns)
        _ip("netns", "add", self.client_ns)
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", self.ns, "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0")
        _ip("-n", self.ns, "addr", "add", f"{BRIDGE_IP}/{PREFIX_LEN}", "dev", BRIDGE)
        _ip("-n", self.ns, "link", "set", BRIDGE, "up")
        _ip("-n", self.ns, "link", "add", CLIENT_IF, "type", "veth", "peer", "name", CLIENT_IF, "netns", self.client_ns)
        _ip("-n", self.ns, "link", "set", CLIENT_IF, "master", BRIDGE, "up")
        _ip("-n", self.client_ns, "link", "set", "lo", "up")
        _ip("-n", self.client_ns, "addr", "add", f"{CLIENT_IP}/{PREFIX_LEN}", "dev", CLIENT_IF)
        _ip("-n", self.client_ns, "link", "set", CLIENT_IF, "up")

    def add_tap(self, name: str) -> None:
        """A TAP on the lab bridge, for one virtual host's QEMU."""
        _ip("-n", self.ns, "tuntap", "add", name, "mode", "tap")
        _ip("-n", self.ns, "link", "set", name, "master", BRIDGE, "up")
        self.taps.append(name)

    def links(self) -> list[str]:
        """Interface names in the lab namespace (for checks)."""
        out = _ip("-n", self.ns, "-o", "link", "show", check=False).stdout
        return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]

    def destroy(self) -> None:
        """Deletes both namespaces and everything in them."""
        delete_namespace(self.client_ns)
        delete_namespace(self.ns)

    def in_lab(self, cmd: list[str]) -> list[str]:
        """`cmd` prefixed to run inside the lab namespace (on the lab bridge)."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def in_client(self, cmd: list[str]) -> list[str]:
        """`cmd` prefixed to run inside the client namespace."""
        return ["ip", "netns", "exec", self.client_ns, *cmd]

    def client_run(self, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Runs `cmd` in the client namespace (never raises on a non-zero exit)."""
        try:
            return subprocess.run(
                self.in_client(cmd), capture_output=True, text=True, check=False, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            raise LabError(f"client command timed out after {timeout}s: {' '.join(cmd)}") from e
