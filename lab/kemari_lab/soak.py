"""The soak: kemari and QEMU (-M microvm) guests side by side under load, for
an A/B count of guest crashes (issue 24: "guest triple fault" under kemari,
silent resets under QEMU — kemari's or the emulated platform's?).

Each of the two virtual hosts runs one kemari guest and one qemu-microvm
guest (2 vCPUs, 512 MiB, private disk copies), booted verbose
(``GuestSpec.verbose``: ``loglevel=7 oops=panic panic=-1``, the init keeps the
log level) so any oops or panic reaches the console. Every guest carries, from
the client namespace, one byte-checked echo connection (~100 KiB/s) and a disk
writer (``GET /cgi-bin/disk?TOKEN`` back to back with 0.5 s pauses, disk_client.py). A monitor
loop looks at every guest every few seconds; when a VMM exits or a client
breaks it records the crash (VMM, host, minutes since boot, exit status,
triple fault, panic text, the console's tail; the whole console is saved in
the run dir as ``<host>-<guest>.console``) and boots that guest afresh.

KEMARI_SOAK_MINUTES sets the duration (default 60); KEMARI_SOAK_INJECT_KILL=1
kills the VMM of the first guest (kemari on vh0) once, 20 s into the soak (a
test of the crash path: it is recorded as ``exit-137``). KEMARI_SOAK_MIGRATE=1
starts vh0's kemari guest on the lab's shared disk (as guest 2 of vh0) and,
once all four guests run, live-migrates it to vh1 with its clients open
(``migration`` in its slot summary; reboots after a crash are on vh0 again,
with a private disk). At the end everything
powers off and ``soak.json`` and ``soak-summary.txt`` land in the run dir:
per VMM guest-minutes, boots, crashes by kind (``triple-fault``, ``panic``,
``silent-reset``, ``client-error``, ``exit-N``, ``boot-failure``,
``host-died``: the virtual host's QEMU exited, e.g. its kernel panicked; the
excerpt is then from the host's console) and the crash records.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kemari_lab import cleanup, images
from kemari_lab.connection import LongConnection
from kemari_lab.errors import LabError
from kemari_lab.guests import EXIT_RE, VMMS, Guest, GuestSpec
from kemari_lab.lab import Lab
from kemari_lab.migration import install_key, live_migrate
from kemari_lab.shared_disk import SharedDisk
from kemari_lab.vhost import VirtualHost

# KEMARI_SOAK_VMMS (comma-separated, two of guests.VMMS) picks the pair,
# e.g. qemu-microvm,qemu-microvm-memfd: the same VMM with its guest memory
# anonymous or in a memfd as kemari's (issue 24).
SOAK_VMMS = ("kemari", "qemu-microvm")

MONITOR_INTERVAL_S = 5.0
# The echo client: one block of 1..32768 bytes (16 KiB on average) every
# 30 ms plus a round trip (~0.15 s through the virtual hosts): ~100 KiB/s per guest.
ECHO_INTERVAL_S = 0.03
ECHO_MAX_BLOCK = 32768
# A disk write request every 0.5 s plus its own time (~2 s under load).
DISK_INTERVAL_S = 0.5
READY_TIMEOUT_S = 420.0
# After a client error, how long to wait for the VMM's exit before calling it
# a client error (the connection usually breaks a moment before the exit shows).
EXIT_GRACE_S = 20.0
# A slot that fails to boot this many times in a row is given up.
MAX_BOOT_FAILURES = 3
_DISK_SCRIPT = Path(__file__).resolve().parent / "disk_client.py"

TRIPLE_FAULT_RE = re.compile(r"triple fault", re.IGNORECASE)
# Kernel text that explains a crash: a panic or an oops (oops=panic makes an
# oops a panic). Not soft lockups: the qemu-microvm guest (rtc=off) reports
# some at every verbose boot, in cmos_do_probe.
PANIC_RE = re.compile(
    r"Kernel panic|Oops|BUG: (?!soft lockup)|double fault|general protection fault|invalid opcode:|"
    r"[Uu]nable to handle|stack-protector"
)
# Further lines worth quoting from a console (warnings, stalls, traces).
NOTABLE_RE = re.compile(r"WARNING: CPU|BUG: soft lockup|rcu: INFO|self-detected stall|NMI backtrace|Call Trace|RIP: ")
# The kernel saying it resets (panic=-1 or a reboot request).
RESTART_RE = re.compile(r"reboot: Restarting system|Rebooting in|reboot: machine restart")


def soak_vmms() -> tuple[str, ...]:
    """The VMMs the soak runs side by side (KEMARI_SOAK_VMMS or SOAK_VMMS)."""
    raw = os.environ.get("KEMARI_SOAK_VMMS")
    if not raw:
        return SOAK_VMMS
    vmms = tuple(v.strip() for v in raw.split(",") if v.strip())
    unknown = [v for v in vmms if v not in VMMS]
    if len(vmms) != 2 or len(set(vmms)) != 2 or unknown:
        raise LabError(f"KEMARI_SOAK_VMMS={raw!r}: two different VMMs of {', '.join(VMMS)}")
    return vmms


def classify(vmm: str, status: int | None, console: str, client_error: str | None = None) -> dict[str, Any]:
    """What a guest's end looks like from its console text and the VMM's exit
    status (None: the VMM had not exited, only a client broke).

    Returns ``kind`` (``triple-fault``: kemari logged one or exited 4;
    ``panic``: kernel panic/oops/BUG text; ``silent-reset``: the VMM exited 0
    with neither, i.e. a reset — a triple fault under QEMU -no-reboot, or an
    unexplained reset under kemari; ``client-error``: the VMM runs but a client
    broke; ``exit-N`` otherwise), and the flags ``triple_fault``,
    ``panic_text``, ``restart_text``, ``poweroff`` (the guest asked for it)."""
    triple = (vmm == "kemari" and status == 4) or bool(TRIPLE_FAULT_RE.search(console))
    panic = bool(PANIC_RE.search(console))
    restart = bool(RESTART_RE.search(console))
    poweroff = "KLAB-GUEST-POWEROFF" in console
    if status is None:
        kind = "client-error"
    elif triple:
        kind = "triple-fault"
    elif panic:
        kind = "panic"
    elif status == 0 and not poweroff:
        kind = "silent-reset"
    elif status == 0:
        kind = "poweroff"
    else:
        kind = f"exit-{status}"
    return {
        "kind": kind,
        "triple_fault": triple,
        "panic_text": panic,
        "restart_text": restart,
        "poweroff": poweroff,
        "client_error": client_error,
    }


def crash_excerpt(console: str, tail: int = 40, marks: int = 30) -> dict[str, list[str]]:
    """The console's last `tail` lines, and the first `marks` lines (after
    KLAB-GUEST-READY, if there) that match PANIC_RE, NOTABLE_RE, TRIPLE_FAULT_RE or RESTART_RE (with their line numbers)."""
    lines = console.splitlines()
    # After the guest's READY if it got there: the boot's own warnings (the
    # same at every boot) would crowd out what came at the end.
    ready = next((i for i, line in enumerate(lines) if line.startswith("KLAB-GUEST-READY")), 0)
    hits = [
        f"{i + 1}: {line}"
        for i, line in enumerate(lines)
        if i >= ready and any(r.search(line) for r in (PANIC_RE, NOTABLE_RE, TRIPLE_FAULT_RE, RESTART_RE))
    ]
    return {"tail": lines[-tail:], "marked": hits[:marks]}


class DiskWriter:
    """disk_client.py in the client namespace against one guest; keeps its
    latest JSON line."""

    def __init__(self, lab: Lab, ip: str, interval: float = DISK_INTERVAL_S, stall_limit: float = 90) -> None:
        self.ip = ip
        self._stderr = lab.run_dir / f"disk-client-{ip}.stderr"
        cmd = lab.network.in_client(
            [sys.executable, "-u", str(_DISK_SCRIPT), ip, "--interval", str(interval), "--stall-limit", str(stall_limit)]
        )
        with self._stderr.open("ab") as err:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
            )
        self._cleanup: int | None = cleanup.register(f"disk writer -> {ip} (pid {self._proc.pid})", self._kill)
        self.last: dict[str, Any] = {"acks": 0, "failures": 0, "error": None}
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name=f"disk-{ip}", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)

    def stats(self) -> dict[str, Any]:
        """The latest line; ``error`` set if the client ended."""
        while True:
            try:
                self.last = json.loads(self._lines.get_nowait())
            except queue.Empty:
                break
            except ValueError:
                continue
        if self.last.get("error") is None and self._proc.poll() is not None:
            self.last = dict(self.last, error=f"the disk client exited ({self._proc.returncode})")
        return self.last

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=5)

    def stop(self) -> dict[str, Any]:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=45)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(timeout=5)
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)
        return self.stats()


class SoakGuest(Guest):
    """A guest whose VMM pid is kept in /tmp/<name>.pid on its host (to kill a hung one)."""

    @property
    def pidfile(self) -> str:
        return f"/tmp/{self.spec.name}.pid"

    def launch(self, host: VirtualHost, command: str) -> None:
        host.run(
            f"( {command} > {self.console} 2>&1 & echo $! > {self.pidfile}; wait $!;"
            f" echo KLAB-VMM-EXIT=$? >> {self.console} ) >/dev/null 2>&1 &"
        )

    def wait_ready(self, timeout: float = 240) -> str:
        """Like Guest.wait_ready, but polls with grep: a verbose console is too
        big to `cat` through the virtual host's serial console twice a second."""
        pattern = r"KLAB-GUEST-READY ip=[^ ]*|KLAB-VMM-EXIT=[0-9]*"
        deadline = time.monotonic() + timeout
        while True:
            out = self.host.run(f"grep -o -E '{pattern}' {self.console}; true", timeout=30).output
            if "KLAB-VMM-EXIT" in out:
                raise LabError(
                    f"{self.host.name}: {self.spec.vmm} exited before guest {self.spec.name} was ready:\n"
                    + self.console_text()[-3000:]
                )
            if "KLAB-GUEST-READY" in out:
                self.ready_seconds = time.monotonic() - self.started_at
                return self.console_text()
            if time.monotonic() > deadline:
                raise LabError(f"{self.host.name}: guest {self.spec.name} not ready after {timeout:.0f}s")
            time.sleep(2)

    def exit_status(self) -> int | None:
        out = self.host.run(f"grep -o 'KLAB-VMM-EXIT=[0-9]*' {self.console}; true", timeout=90).output
        m = EXIT_RE.search(out)
        return int(m.group(1)) if m else None

    def kill_vmm(self) -> None:
        self.host.run(f"kill -9 $(cat {self.pidfile}) 2>/dev/null; true", timeout=30)


@dataclass
class Slot:
    """One guest position (VMM, host, index) and what happened to it."""

    lab: Lab
    host: VirtualHost
    vmm: str
    index: int
    boots: int = 0
    guest_seconds: float = 0.0
    crashes: list[dict[str, Any]] = field(default_factory=list)
    disk_acks: int = 0
    echo_bytes: int = 0
    given_up: str | None = None
    # The first boot's disk (an NBD URL: the shared disk) and where the first
    # guest live-migrates once everything is booted (KEMARI_SOAK_MIGRATE=1).
    disk_url: str | None = None
    migrate_to: VirtualHost | None = None
    migration: dict[str, Any] | None = None
    host_stalls: list[dict[str, Any]] = field(default_factory=list)
    # Since when the guest's host has not answered (its time is not counted).
    stall_since: float | None = None
    stalled_seconds: float = 0.0
    booted: threading.Event = field(default_factory=threading.Event)
    guest: SoakGuest | None = None
    conn: LongConnection | None = None
    disk: DiskWriter | None = None
    ready_at: float = 0.0
    _old: list[str] = field(default_factory=list)

    # How long a boot may take before it counts as failed.
    ready_timeout: float = READY_TIMEOUT_S

    @property
    def label(self) -> str:
        return f"{self.vmm}@{self.host.name}"

    def guest_name(self) -> str:
        """The name of this slot's current guest (its files in the virtual host)."""
        return f"soak-{self.vmm}-{self.host.name}-{self.boots}"

    def spec_for(self, name: str) -> GuestSpec:
        """The spec of this slot's next guest."""
        return GuestSpec(
            name=name, vmm=self.vmm, host_index=self.host.index, index=self.index, verbose=True, disk_url=self.disk_url
        )

    def boot(self) -> None:
        """Boots a fresh guest (fresh disk copy) and opens its clients; records
        a boot that fails as a crash and retries, up to MAX_BOOT_FAILURES."""
        failures = 0
        while True:
            self.boots += 1
            name = self.guest_name()
            h = self.host
            # The previous guest's TAP (same index) and files.
            h.run(f"/sbin/ip link del g{self.index} 2>/dev/null; rm -f {' '.join(self._old)}; true", check=False)
            spec = self.spec_for(name)
            self.disk_url = None  # boots after a crash use a private copy
            g = SoakGuest(h, spec)
            self._old = [spec.disk_path, g.pidfile, spec.api_socket]
            self.guest = g
            images.log(f"soak: booting {name} ({spec.ip}) on {h.name}")
            try:
                g.start()
                console = g.wait_ready(timeout=self.ready_timeout)
                g.check_boot(console)
                self.ready_at = time.monotonic()
                self.conn = LongConnection(
                    self.lab, spec.ip, interval=ECHO_INTERVAL_S, stall_limit=60, max_block=ECHO_MAX_BLOCK
                ).open()
                self.disk = DiskWriter(self.lab, spec.ip)
                images.log(f"soak: {name} ready in {g.ready_seconds:.0f}s")
                return
            except LabError as e:
                self._close_clients()
                status = g.exit_status()
                if status is None:
                    g.kill_vmm()
                self.record(status, f"boot failed: {e}", boot_failure=True)
                failures += 1
                if failures >= MAX_BOOT_FAILURES:
                    self.given_up = f"{failures} boots failed in a row; last: {e}"
                    images.log(f"soak: giving up {self.label}: {self.given_up}")
                    self.guest = None
                    return

    def _close_clients(self) -> None:
        if self.conn is not None:
            try:
                self.echo_bytes += int(self.conn.stats().get("bytes", 0))
            except LabError:
                pass
            self.conn.abort()
            self.conn = None
        if self.disk is not None:
            self.disk_acks += int(self.disk.stop().get("acks", 0))
            self.disk = None

    def _count_time(self) -> None:
        if self.ready_at:
            self.guest_seconds += time.monotonic() - self.ready_at
            self.ready_at = 0.0

    def record(
        self, status: int | None, client_error: str | None, boot_failure: bool = False, host_died: bool = False
    ) -> dict[str, Any]:
        """Records the end of the current guest (its console saved in the run dir).
        If its virtual host died, the excerpt is from the host's console."""
        g = self.guest
        assert g is not None
        self._count_time()
        try:
            console = g.console_text()
        except LabError as e:
            console = f"(console unreadable: {e})"
        info = classify(self.vmm, status, console, client_error)
        if boot_failure:
            info["kind"] = "boot-failure"
        if host_died:
            info["kind"] = "host-died"
            console = g.host.console_text()
        crash = {
            "vmm": self.vmm,
            "host": g.host.name,
            "guest": g.spec.name,
            "migrated": g.host is not self.host,
            "minutes_since_boot": round((time.monotonic() - g.started_at) / 60, 2),
            "exit_status": status,
            **info,
            **crash_excerpt(console),
            "console_file": str(g.host.run_dir / f"{g.host.name}-{g.spec.name}.console"),
            "at": time.strftime("%H:%M:%S"),
        }
        self.crashes.append(crash)
        images.log(
            f"soak: CRASH {self.label} {g.spec.name}: {crash['kind']} status={status} "
            f"after {crash['minutes_since_boot']} min; client error: {client_error}; console {crash['console_file']}"
        )
        for line in crash["marked"][:10]:
            images.log(f"soak:   | {line}")
        return crash

    def check(self) -> None:
        """One look: exit or broken client → record, reboot."""
        g = self.guest
        if g is None or self.given_up:
            return
        client_error = None
        if self.conn is not None:
            try:
                s = self.conn.stats()
                client_error = f"echo: {s['error']}" if s["error"] else None
            except LabError as e:
                client_error = f"echo: {e}"
        if client_error is None and self.disk is not None:
            d = self.disk.stats()
            client_error = f"disk: {d['error']}" if d.get("error") else None
        status = g.exit_status()
        if status is None and client_error is None:
            return
        if status is None:
            deadline = time.monotonic() + EXIT_GRACE_S
            while status is None and time.monotonic() < deadline:
                time.sleep(2)
                status = g.exit_status()
            if status is None:
                g.kill_vmm()
        self._close_clients()
        self.record(status, client_error)
        self.boot()

    def finish(self) -> None:
        """Closes the clients, powers the guest off (records a failed poweroff)."""
        g = self.guest
        if g is None or self.given_up:
            return
        if self.conn is not None:
            try:
                final = self.conn.close()
                self.echo_bytes += int(final.get("bytes", 0))
            except LabError as e:
                images.log(f"soak: {self.label}: echo connection at the end: {e}")
                self.conn.abort()
            self.conn = None
        self._close_clients()
        self._count_time()
        status: int | None
        try:
            self.lab.client_http_get(g.spec.ip, "/cgi-bin/poweroff", timeout=30)
            status = g.wait_exit(timeout=180)
        except LabError as e:
            images.log(f"soak: {self.label}: poweroff failed: {e}")
            status = g.exit_status()
            if status is None:
                g.kill_vmm()
        if status != 0:
            self.record(status, "poweroff at the end of the soak failed")

    def run(self, go: threading.Event, deadline: list[float]) -> None:
        """The slot's thread: boots, waits for `go` (every slot booted), checks
        every MONITOR_INTERVAL_S until deadline[0], powers off."""
        try:
            self.boot()
            self.booted.set()
            go.wait()
            if self.guest is not None:
                self.move()
            inject = os.environ.get("KEMARI_SOAK_INJECT_KILL") == "1" and self.host.index == 0 and self.index == 0
            while time.monotonic() < deadline[0]:
                if inject and self.guest is not None:
                    # A test of the crash path: the first slot's VMM is killed once.
                    inject = False
                    time.sleep(20)
                    images.log(f"soak: KEMARI_SOAK_INJECT_KILL=1: killing {self.guest.spec.name}'s VMM")
                    self.guest.kill_vmm()
                try:
                    self.check()
                    self._stall_over()
                except LabError as e:
                    # A virtual host that does not answer its console for a
                    # while (seen under load): noted, and the slot carries on;
                    # one that died ends the slot (below).
                    host = self.guest.host if self.guest is not None else self.host
                    if not host.alive():
                        raise
                    if self.stall_since is None:
                        self.stall_since = time.monotonic()
                        stall = {"at": time.strftime("%H:%M:%S"), "host": host.name, "error": str(e)[:300]}
                        self.host_stalls.append(stall)
                        images.log(f"soak: {self.label}: {host.name} does not answer: {str(e).splitlines()[0]}")
                time.sleep(MONITOR_INTERVAL_S)
            self.finish()
        except LabError as e:
            # A virtual host that died or stopped answering: the slot ends here.
            self.given_up = f"harness error: {e}"
            images.log(f"soak: {self.label}: {self.given_up}")
            host = self.guest.host if self.guest is not None else self.host
            if self.guest is not None and not host.alive():
                self.record(None, f"virtual host {host.name} died", host_died=True)
        finally:
            self.booted.set()

    def move(self) -> None:
        """What happens to the guest once every slot is booted, before the
        load is counted: here a live migration if `migrate_to` is set."""
        if self.migrate_to is not None:
            self.migrate()

    def migrate(self) -> None:
        """Live-migrates the guest (shared disk) to `migrate_to`, clients open."""
        g = self.guest
        dest = self.migrate_to
        assert g is not None and dest is not None
        images.log(f"soak: live-migrating {g.spec.name} {g.host.name} -> {dest.name}")
        try:
            report = live_migrate(g, dest)
            keys = ("wall_s", "total_ms", "downtime_ms", "round", "bytes_sent")
            self.migration = {k: report.get(k) for k in keys}
            images.log(f"soak: migrated {g.spec.name} to {dest.name}: {self.migration}")
        except LabError as e:
            self.migration = {"error": str(e)}
            images.log(f"soak: migration of {g.spec.name} failed: {e}")

    def _stall_over(self) -> None:
        """Ends a stall of the host (its duration is taken off the guest-minutes)."""
        if self.stall_since is not None:
            lasted = time.monotonic() - self.stall_since
            self.stalled_seconds += lasted
            self.stall_since = None
            self.host_stalls[-1]["seconds"] = round(lasted, 1)
            images.log(f"soak: {self.label}: {self.host_stalls[-1]['host']} answers again after {lasted:.0f}s")

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for c in self.crashes:
            kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
        return {
            "vmm": self.vmm,
            "host": self.host.name,
            "guest_minutes": round(max(0.0, self.guest_seconds - self.stalled_seconds) / 60, 2),
            "host_stalled_minutes": round(self.stalled_seconds / 60, 2),
            "boots": self.boots,
            "crashes": len(self.crashes),
            "by_kind": kinds,
            "disk_acks": self.disk_acks,
            "echo_mb": round(self.echo_bytes / 1e6, 2),
            "given_up": self.given_up,
            "migration": self.migration,
            "host_stalls": self.host_stalls,
        }


def per_vmm(slots: list[Slot]) -> dict[str, dict[str, Any]]:
    """Slot summaries added up per VMM."""
    out: dict[str, dict[str, Any]] = {}
    for s in slots:
        one = s.summary()
        tot = out.setdefault(
            s.vmm, {"guest_minutes": 0.0, "boots": 0, "crashes": 0, "by_kind": {}, "disk_acks": 0, "echo_mb": 0.0}
        )
        for k in ("guest_minutes", "boots", "crashes", "disk_acks", "echo_mb"):
            tot[k] = round(tot[k] + one[k], 2)
        for kind, n in one["by_kind"].items():
            tot["by_kind"][kind] = tot["by_kind"].get(kind, 0) + n
    return out


def human_summary(
    minutes: float, totals: dict[str, dict[str, Any]], crashes: list[dict[str, Any]], notes: list[str]
) -> str:
    pair = " + one ".join(totals) or " + one ".join(soak_vmms())
    lines = [f"soak: {minutes:.1f} min wall clock, 2 virtual hosts, one {pair} guest on each"]
    for vmm, t in totals.items():
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(t["by_kind"].items())) or "none"
        lines.append(
            f"  {vmm:13} {t['guest_minutes']:7.1f} guest-min  boots {t['boots']}  crashes {t['crashes']} ({kinds})"
            f"  disk writes acked {t['disk_acks']}  echo {t['echo_mb']} MB"
        )
    for c in crashes:
        lines.append(
            f"  - {c['at']} {c['vmm']}@{c['host']} {c['guest']}: {c['kind']} (exit {c['exit_status']}) after "
            f"{c['minutes_since_boot']} min; panic text {c['panic_text']}; client {c['client_error']}"
        )
        lines += [f"      {m}" for m in c["marked"][:8]]
    lines += [f"  ! {n}" for n in notes]
    return "\n".join(lines) + "\n"


def soak(lab: Lab, vmm: str = "", minutes: float | None = None) -> dict[str, float]:
    """kemari and qemu-microvm guests side by side on 2 hosts under echo and
    disk load for KEMARI_SOAK_MINUTES (60); counts crashes per VMM (--vmm ignored)."""
    if minutes is None:
        minutes = float(os.environ.get("KEMARI_SOAK_MINUTES", "60"))
    vmms = soak_vmms()
    slots = [Slot(lab, h, v, i) for h in lab.hosts[:2] for i, v in enumerate(vmms)]
    shared: SharedDisk | None = None
    if os.environ.get("KEMARI_SOAK_MIGRATE") == "1":
        if vmms[0] != "kemari":
            raise LabError("KEMARI_SOAK_MIGRATE=1 migrates the first VMM's guest: it must be kemari")
        # The kemari guest of vh0 on the shared disk, as guest 2 (its own TAP
        # g2 on vh1 too), live-migrated to vh1 once all guests run.
        shared = SharedDisk(lab).start()
        install_key(lab.hosts[:2])
        first = slots[0]
        first.index, first.disk_url, first.migrate_to = 2, shared.url, lab.hosts[1]
    go = threading.Event()
    deadline = [float("inf")]
    threads = [threading.Thread(target=s.run, args=(go, deadline), name=f"soak-{s.label}") for s in slots]
    t0 = time.monotonic()
    try:
        for th in threads:
            th.start()
        for s in slots:
            s.booted.wait()
        t0 = time.monotonic()
        deadline[0] = t0 + minutes * 60
        images.log(f"soak: all guests booted; load for {minutes:g} min")
        go.set()
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=300)
                if th.is_alive():
                    break
            if any(th.is_alive() for th in threads):
                live = ", ".join(f"{s.label} boot {s.boots} crashes {len(s.crashes)}" for s in slots)
                images.log(f"soak: {(time.monotonic() - t0) / 60:.0f}/{minutes:g} min: {live}")
    finally:
        deadline[0] = 0.0
        go.set()
        for th in threads:
            th.join(timeout=600)
        if shared is not None:
            shared.stop()
        for s in slots:
            s._stall_over()
            s._count_time()
            if s.conn is not None or s.disk is not None:
                s._close_clients()
        totals = per_vmm(slots)
        crashes = [c for s in slots for c in s.crashes]
        wall = (time.monotonic() - t0) / 60
        result = {
            "minutes_requested": minutes,
            "wall_minutes": round(wall, 2),
            "per_vmm": totals,
            "slots": [s.summary() for s in slots],
            "crashes": crashes,
        }
        (lab.run_dir / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
        notes = [f"{s.label}: {s.given_up}" for s in slots if s.given_up]
        notes += [f"{s.label}: migration {s.migration}" for s in slots if s.migration]
        notes += [
            f"{s.label}: {st['host']} did not answer from {st['at']} for {st.get('seconds', '?')}s (not counted)"
            for s in slots
            for st in s.host_stalls
        ]
        text = human_summary(wall, totals, crashes, notes)
        (lab.run_dir / "soak-summary.txt").write_text(text)
        sys.stderr.write(text)
        images.log(f"soak: results in {lab.run_dir}/soak.json and soak-summary.txt")
    times: dict[str, float] = {"soak_wall_min": wall}
    for v, t in totals.items():
        key = v.replace("-", "_")
        times[f"{key}_guest_min"] = float(t["guest_minutes"])
        times[f"{key}_boots"] = float(t["boots"])
        times[f"{key}_crashes"] = float(t["crashes"])
    return times
