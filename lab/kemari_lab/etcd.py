"""A three-member etcd cluster in the lab namespace (Debian's ``etcd-server``).

The fleet scenarios (docs/fleet.md) arbitrate who runs a VM with etcd leases
and keep the fleet's registry there. The cluster runs on this machine,
inside the lab namespace, one member per address added to the lab bridge
(10.77.0.3, .4, .5), so the virtual hosts reach it over the lab bridge and
a virtual host cut off the bridge (its TAP down) loses it::

    cluster = LabEtcd(lab).start()
    cluster.fence          # etcd://10.77.0.3:2379,10.77.0.4:2379,10.77.0.5:2379/kemari/vms?ttl=5
    cluster.get("/kemari/vms/roam")   # the fence key's value (JSON) or None
    cluster.kill(2)        # SIGKILL of one member

Each member's data and log are in the run directory (``etcd-m<i>/``,
``etcd-m<i>.log``). The namespace's teardown kills what is left.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any, Self

from kemari_lab import cleanup
from kemari_lab.errors import LabError
from kemari_lab.lab import Lab
from kemari_lab.netns import PREFIX_LEN, SUBNET_PREFIX

CLIENT_PORT = 2379
PEER_PORT = 2380
PREFIX = "/kemari/vms"


def member_ip(i: int) -> str:
    """Address of etcd member `i` on the lab bridge."""
    return f"{SUBNET_PREFIX}.{3 + i}"


def leader_index(status_json: str, ips: list[str]) -> int | None:
    """From `etcdctl endpoint status -w json`: the index in `ips` of the
    member the answering members name as their leader, None if unknown."""
    try:
        entries = json.loads(status_json or "[]")
    except json.JSONDecodeError:
        return None
    leader = next((e["Status"]["leader"] for e in entries if e.get("Status", {}).get("leader")), None)
    for e in entries:
        if leader is not None and e.get("Status", {}).get("header", {}).get("member_id") == leader:
            ip = e.get("Endpoint", "").split("//")[-1].rsplit(":", 1)[0]
            return ips.index(ip) if ip in ips else None
    return None


class LabEtcd:
    """`members` etcd processes in the lab namespace, one cluster."""

    def __init__(self, lab: Lab, members: int = 3, ttl: int = 5) -> None:
        if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
            raise LabError("etcd and etcdctl are needed (Debian: apt-get install etcd-server etcd-client)")
        self.lab = lab
        self.n = members
        self.ttl = ttl
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self._cleanup: int | None = None

    @property
    def endpoints(self) -> list[str]:
        return [f"{member_ip(i)}:{CLIENT_PORT}" for i in range(self.n)]

    @property
    def fence(self) -> str:
        """kemari's --ft-fence (and kemari-agent's --etcd) for this cluster."""
        return f"etcd://{','.join(self.endpoints)}{PREFIX}?ttl={self.ttl}"

    def start(self, timeout: float = 60) -> Self:
        ns = self.lab.network.ns
        for i in range(self.n):
            subprocess.run(
                ["ip", "-n", ns, "addr", "add", f"{member_ip(i)}/{PREFIX_LEN}", "dev", "klbr"],
                check=True,
                capture_output=True,
            )
        initial = ",".join(f"m{i}=http://{member_ip(i)}:{PEER_PORT}" for i in range(self.n))
        self._cleanup = cleanup.register("lab etcd cluster", self.stop)
        for i in range(self.n):
            ip = member_ip(i)
            cmd = self.lab.network.in_lab(
                [
                    "etcd",
                    "--name",
                    f"m{i}",
                    "--data-dir",
                    str(self.lab.run_dir / f"etcd-m{i}"),
                    "--listen-client-urls",
                    f"http://{ip}:{CLIENT_PORT}",
                    "--advertise-client-urls",
                    f"http://{ip}:{CLIENT_PORT}",
                    "--listen-peer-urls",
                    f"http://{ip}:{PEER_PORT}",
                    "--initial-advertise-peer-urls",
                    f"http://{ip}:{PEER_PORT}",
                    "--initial-cluster",
                    initial,
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    f"klab-{self.lab.tag}",
                    # As in kemari_testkit::EtcdCluster: quick elections, but a
                    # member starved by the loaded machine keeps its leadership.
                    "--heartbeat-interval",
                    "200",
                    "--election-timeout",
                    "2000",
                ]
            )
            with (self.lab.run_dir / f"etcd-m{i}.log").open("ab") as log:
                self._procs[i] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            health = self.ctl(["endpoint", "health"], check=False)
            if health.returncode == 0:
                return self
            for i, p in enumerate(self._procs):
                if p is not None and p.poll() is not None:
                    raise LabError(f"etcd member m{i} exited with status {p.returncode}; see etcd-m{i}.log")
            if time.monotonic() > deadline:
                raise LabError(f"the lab's etcd is not healthy after {timeout:.0f}s: {health.stderr.strip()}")
            time.sleep(0.5)

    def ctl(self, args: list[str], check: bool = True, timeout: float = 15) -> subprocess.CompletedProcess[str]:
        """etcdctl (API v3) against the members still running, from the lab namespace."""
        eps = [e for i, e in enumerate(self.endpoints) if self.running(i)]
        cmd = self.lab.network.in_lab(
            ["etcdctl", f"--endpoints={','.join(eps)}", "--dial-timeout=2s", "--command-timeout=5s", *args]
        )
        proc = subprocess.run(
            cmd, capture_output=True, text=True, check=False, timeout=timeout, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
        )
        if check and proc.returncode != 0:
            raise LabError(f"etcdctl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def get(self, key: str) -> dict[str, Any] | None:
        """The JSON value of `key`, or None if it does not exist."""
        out = self.ctl(["get", key, "--print-value-only"]).stdout.strip()
        return json.loads(out) if out else None

    def leader(self) -> int | None:
        """The index of the member that is the leader now (None if unknown)."""
        status = self.ctl(["endpoint", "status", "-w", "json"], check=False).stdout
        return leader_index(status, [member_ip(i) for i in range(self.n)])

    def running(self, i: int) -> bool:
        p = self._procs[i]
        return p is not None and p.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL of member `i` (a member that dies)."""
        p = self._procs[i]
        if p is None or p.poll() is not None:
            raise LabError(f"etcd member m{i} is not running")
        p.kill()
        p.wait(timeout=10)

    def stop(self) -> None:
        for p in self._procs:
            if p is not None and p.poll() is None:
                cleanup.stop_process(p)
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
