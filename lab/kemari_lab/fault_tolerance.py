"""Fault tolerance of a kemari guest across virtual hosts (issue #7, docs/fault-tolerance.md).

    fence = FenceService(lab).start()            # the lab's STONITH (fence_server.py)
    start_standby(guest, lab.hosts[1], fence_cmd=fence.command)
    protect(guest, lab.hosts[1], timeout_ms=3000)  # kemarictl ft start on the primary
    ...
    lab.hosts[0].power_fail()
    wait_ft_state(guest, lab.hosts[1], {"failed_over"}, timeout=…)

On the standby host the harness creates the guest's TAP in br0 (as for a live
migration) and starts ``kemari --ft-standby <standby ip>:7780
--migration-key-file … --net tap=g0 --api-socket <same path>
[--ft-fence-cmd …]`` with its console in the guest's console file there.
``kemarictl ft start --peer`` on the primary blocks until the standby holds
the first complete epoch (live pre-copy, then the machine at rest). From then
on every disk request and transmitted frame of the guest waits for the
standby's acknowledgement of a sync. ``kemarictl ft status`` (both ends)
gives state, epoch, syncs, pause and sync percentiles, failover time.

The fence: virtual hosts share no file system, so the flock fence
(``--ft-fence``) cannot work across them; the standby runs
:attr:`FenceService.command` instead, which asks the lab's power switch
(fence_server.py, on the lab bridge) to make sure the primary's virtual host
is off — killing its QEMU if it still runs — and fails over only on its
"KLAB-FENCED" answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Self

from kemari_lab import cleanup, images
from kemari_lab.errors import LabError
from kemari_lab.guests import EXIT_RE, Guest
from kemari_lab.lab import Lab
from kemari_lab.migration import KEY_PATH, wait_listening
from kemari_lab.netns import BRIDGE_IP
from kemari_lab.vhost import VirtualHost

FT_PORT = 7780
FENCE_PORT = 10810
_SERVER = Path(__file__).resolve().parent / "fence_server.py"


def fence_command(ip: str, port: int) -> str:
    """A --ft-fence-cmd (run by `sh -c` in the standby's virtual host, with
    KEMARI_FT_PEER = the primary's address) that exits 0 only on the fence
    server's confirmation that the primary's virtual host is off."""
    return (
        "printf 'GET /fence?peer=%s HTTP/1.0\\r\\n\\r\\n' \"$KEMARI_FT_PEER\""
        f" | nc -w 5 {ip} {port} | grep -q KLAB-FENCED"
    )


class FenceService:
    """fence_server.py in the lab namespace, able to power off every virtual host of the lab."""

    def __init__(self, lab: Lab, port: int = FENCE_PORT) -> None:
        self.lab = lab
        self.port = port
        self.log = lab.run_dir / "fence.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._cleanup: int | None = None

    @property
    def command(self) -> str:
        """kemari's --ft-fence-cmd for this server (see :func:`fence_command`)."""
        return fence_command(BRIDGE_IP, self.port)

    def start(self, timeout: float = 10) -> Self:
        targets = []
        for vh in self.lab.hosts:
            if vh.pid is None:
                raise LabError(f"{vh.name}: no QEMU process to fence")
            targets += ["--target", f"{vh.ip}={vh.pid}"]
        cmd = self.lab.network.in_lab(
            [sys.executable, "-u", str(_SERVER), "--listen", f"{BRIDGE_IP}:{self.port}", "--log", str(self.log), *targets]
        )
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._cleanup = cleanup.register(f"fence server (pid {self._proc.pid})", self.stop)
        deadline = time.monotonic() + timeout
        while not any("listening" in e for e in self.events(all_lines=True)):
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise LabError(f"fence server exited with status {self._proc.returncode}: {err[-1500:]}")
            if time.monotonic() > deadline:
                raise LabError(f"fence server not listening on {BRIDGE_IP}:{self.port} after {timeout:.0f}s")
            time.sleep(0.1)
        return self

    def events(self, all_lines: bool = False) -> list[dict[str, Any]]:
        """The fence requests served so far (t, peer, action, code, done)."""
        try:
            lines = self.log.read_text().splitlines()
        except OSError:
            return []
        events = [json.loads(line) for line in lines if line.strip()]
        return events if all_lines else [e for e in events if "peer" in e]

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            cleanup.stop_process(proc)
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_standby(
    guest: Guest, host: VirtualHost, port: int = FT_PORT, fence_cmd: str | None = None, timeout: float = 30
) -> None:
    """Starts kemari --ft-standby for `guest` on `host` and returns once it listens."""
    s = guest.spec
    if s.vmm != "kemari" or (s.disk and not s.disk_url):
        raise LabError(f"guest {s.name}: fault tolerance needs a kemari guest with a shared disk")
    if host is guest.host:
        raise LabError(f"{host.name}: the standby must run on another host than the primary")
    guest.add_tap(host)
    cmd = (
        f"kemari --ft-standby {host.ip}:{port} --migration-key-file {KEY_PATH} --serial stdout"
        f" --api-socket {s.api_socket}"
    )
    if s.net:
        cmd += f" --net tap={s.tap}"
    if fence_cmd:
        cmd += " --ft-fence-cmd '" + fence_cmd.replace("'", "'\\''") + "'"
    guest.launch(host, cmd + s.log_args)
    wait_listening(guest, host, port, "kemari --ft-standby", timeout)


def protect(
    guest: Guest,
    standby: VirtualHost,
    port: int = FT_PORT,
    timeout_ms: int = 3000,
    heartbeat_ms: int = 100,
    timeout: float = 600,
) -> dict[str, Any]:
    """`kemarictl ft start` on the primary (where the guest runs); returns its
    report once the VM is protected (the standby holds the first epoch)."""
    args = (
        f"ft start --peer {standby.ip}:{port} --key-file {KEY_PATH}"
        f" --timeout-ms {timeout_ms} --heartbeat-ms {heartbeat_ms}"
    )
    t0 = time.monotonic()
    try:
        report = guest.ctl(args, timeout=timeout)
    except LabError as e:
        console = standby.run(f"cat {guest.console}", timeout=30, check=False).output
        raise LabError(f"{e}\nstandby {standby.name} console:\n{console[-2000:]}") from None
    report["wall_s"] = time.monotonic() - t0
    if report.get("state") != "protected":
        raise LabError(f"{guest.host.name}: ft start did not protect {guest.spec.name}: {report}")
    return report


def ft_status(guest: Guest, host: VirtualHost | None = None) -> dict[str, Any]:
    """`kemarictl ft status` against the guest's kemari on `host` (default: where it runs)."""
    return guest.ctl("ft status", timeout=30, host=host)


def wait_ft_state(
    guest: Guest, host: VirtualHost, states: Collection[str], timeout: float, poll: float = 0.2
) -> dict[str, Any]:
    """Polls `kemarictl ft status` on `host` until its state is one of `states`;
    returns the status with ``seen_at`` (time.monotonic() of the answer). Fails
    early if that kemari exits."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while True:
        try:
            last = ft_status(guest, host)
        except LabError as e:
            console = host.run(f"cat {guest.console}", timeout=30, check=False).output
            if EXIT_RE.search(console):
                raise LabError(f"{host.name}: kemari exited while waiting for {sorted(states)}:\n{console[-3000:]}") from e
            last = {"error": str(e)}
        if last.get("state") in states:
            last["seen_at"] = time.monotonic()
            return last
        if time.monotonic() > deadline:
            console = host.run(f"cat {guest.console}", timeout=30, check=False).output
            raise LabError(
                f"{host.name}: fault-tolerance state not in {sorted(states)} after {timeout:.0f}s: {last}\n"
                f"console tail:\n{console[-3000:]}"
            )
        time.sleep(poll)


def log_status(label: str, status: dict[str, Any]) -> None:
    images.log(f"ft status {label}: " + json.dumps(status, sort_keys=True))
