"""Guests inside a virtual host, run by kemari or by QEMU (-enable-kvm).

Both VMMs boot the same images (/lab/guest/ in the virtual host: the Debian
kernel, the guest initramfs, a fresh copy of the ext4 disk) with the same
command line, a virtio-blk disk and a virtio-net device on a TAP in the
virtual host's br0. The guest's console goes to /tmp/<name>.console in the
virtual host; when the VMM exits, ``KLAB-VMM-EXIT=<status>`` is appended.

The disk is a private copy in the virtual host, or (``GuestSpec.disk_url``)
an NBD export every virtual host reaches, such as the lab's shared disk
(kemari_lab/shared_disk.py) — what a guest that moves between hosts needs.
kemari guests serve their API on /tmp/<name>.sock (:meth:`Guest.ctl` runs
kemarictl there). :attr:`Guest.host` is where the guest runs now: a live
migration (kemari_lab/migration.py) moves it.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from kemari_lab.errors import LabError
from kemari_lab.netns import PREFIX_LEN, guest_ip
from kemari_lab.vhost import VirtualHost

GUEST_DIR = "/lab/guest"
# qemu: QEMU -M pc, virtio-pci devices; qemu-microvm: QEMU -M microvm with
# virtio-mmio devices described in ACPI, the same drivers kemari's guest uses;
# qemu-microvm-memfd: the same with guest memory in a shared memfd, as kemari's.
VMMS = ("qemu", "qemu-microvm", "qemu-microvm-memfd", "kemari")

READY_RE = re.compile(r"KLAB-GUEST-READY ip=(\S+)\n")
DISK_RE = re.compile(r"KLAB-DISK-(OK|FAIL)[^\n]*")
NET_RE = re.compile(r"KLAB-NET-(OK|FAIL)[^\n]*")
BOOTED_RE = re.compile(r"KLAB-GUEST-BOOTED cpus=(\d+) mem_kb=(\d+)")
EXIT_RE = re.compile(r"KLAB-VMM-EXIT=(\d+)")


@dataclass
class GuestSpec:
    """What to run: which VMM, how big, where on the network."""

    name: str
    vmm: str = "qemu"
    vcpus: int = 2
    memory_mb: int = 512
    host_index: int = 0
    index: int = 0
    extra_cmdline: str = ""
    disk: bool = True
    # An NBD URL (nbd://HOST:PORT/EXPORT) instead of a private copy of the disk.
    disk_url: str | None = None
    # kemari only: a file or block device in the virtual host given as
    # `--pmem PATH` (virtio-pmem); the guest mounts its /dev/pmem0 at /mnt
    # with -o dax (klab.disk=pmem0) as its data disk. Usually with disk=False.
    pmem: str | None = None
    net: bool = True
    # kemari's --log-level; with it, --log-json (log lines in the console file, see vmm_log).
    log_level: str | None = None
    # Verbose kernel console (soak runs): loglevel=7, oops=panic, and the
    # init keeps the log level (klab.verbose=1) instead of `quiet`.
    verbose: bool = False
    # More kemari flags (`--on-reboot exit` …).
    vmm_args: str = ""
    # Where the private copy of the disk lives in the virtual host.
    disk_dir: str = "/tmp"
    # QEMU only: its human monitor on 127.0.0.1:PORT in the virtual host
    # (`-monitor none` without), what a QEMU live migration is driven through
    # (kemari_lab/qemu_migration.py).
    monitor_port: int | None = None
    ip: str = field(init=False)
    mac: str = field(init=False)
    tap: str = field(init=False)

    def __post_init__(self) -> None:
        if self.vmm not in VMMS:
            raise LabError(f"unknown VMM {self.vmm!r} (one of {', '.join(VMMS)})")
        if self.pmem and self.vmm != "kemari":
            raise LabError(f"guest {self.name}: a pmem data disk is for kemari guests, not {self.vmm}")
        self.ip = guest_ip(self.host_index, self.index)
        self.mac = f"52:54:00:77:{1 + self.host_index:02x}:{self.index:02x}"
        self.tap = f"g{self.index}"

    @property
    def cmdline(self) -> str:
        kernel = "loglevel=7 oops=panic panic=-1 klab.verbose=1" if self.verbose else "quiet panic=-1"
        if self.pmem:
            kernel += " klab.disk=pmem0"
        return f"console=ttyS0 {kernel} klab.ip={self.ip}/{PREFIX_LEN} {self.extra_cmdline}".strip()

    @property
    def disk_path(self) -> str:
        return f"{self.disk_dir}/{self.name}.disk"

    @property
    def disk_arg(self) -> str:
        """What the VMM opens: the NBD export, or the private copy."""
        return self.disk_url or self.disk_path

    @property
    def api_socket(self) -> str:
        """kemari's API socket in the virtual host."""
        return f"/tmp/{self.name}.sock"

    def vmm_command(self) -> str:
        """The VMM's shell command line inside the virtual host."""
        if self.vmm.startswith("qemu"):
            microvm = self.vmm.startswith("qemu-microvm")
            machine = "microvm,acpi=on,pit=off,pic=off,rtc=off" if microvm else "pc"
            bus = "device" if microvm else "pci"
            memory = ""
            if self.vmm.endswith("-memfd"):
                # Guest memory in a shared memfd, as kemari's: shmem pages,
                # which KVM maps 4 KiB at a time where shmem THP is off.
                machine += ",memory-backend=m0"
                memory = f" -object memory-backend-memfd,id=m0,size={self.memory_mb}M,share=on"
            cmd = (
                f"qemu-system-x86_64 -enable-kvm -cpu host -M {machine}{memory} -nodefaults -display none -no-reboot"
                f" -smp {self.vcpus} -m {self.memory_mb} -serial stdio -monitor {self.monitor}"
                f" -kernel {GUEST_DIR}/vmlinuz -initrd {GUEST_DIR}/initrd.cpio -append '{self.cmdline}'"
            )
            if self.disk:
                cmd += f" -drive file={self.disk_arg},format=raw,if=none,id=d0 -device virtio-blk-{bus},drive=d0"
            if self.net:
                rom = "" if microvm else ",romfile="
                cmd += (
                    f" -netdev tap,id=n0,ifname={self.tap},script=no,downscript=no"
                    f" -device virtio-net-{bus},netdev=n0,mac={self.mac}{rom}"
                )
            return cmd
        cmd = (
            f"kemari --kernel {GUEST_DIR}/vmlinuz --initramfs {GUEST_DIR}/initrd.cpio"
            f" --cmdline '{self.cmdline}' --memory {self.memory_mb}M --vcpus {self.vcpus} --serial stdout"
            f" --api-socket {self.api_socket}"
        )
        if self.disk:
            cmd += f" --disk {self.disk_arg}"
        if self.pmem:
            cmd += f" --pmem {self.pmem}"
        if self.net:
            cmd += f" --net tap={self.tap},mac={self.mac}"
        if self.vmm_args:
            cmd += f" {self.vmm_args}"
        return cmd + self.log_args

    @property
    def monitor(self) -> str:
        """QEMU's -monitor argument."""
        return f"tcp:127.0.0.1:{self.monitor_port},server=on,wait=off" if self.monitor_port else "none"

    @property
    def log_args(self) -> str:
        """kemari's logging flags (JSON lines on stderr, into the console file)."""
        return f" --log-level {self.log_level} --log-json" if self.log_level and self.vmm == "kemari" else ""


def vmm_log(console: str, message: str | None = None) -> list[dict[str, Any]]:
    """kemari's JSON log lines in a console text (GuestSpec.log_level set), each
    as {"timestamp", "level", "fields": {"message", …}, "target"}; only those
    whose message is `message`, if given."""
    events = []
    for line in console.splitlines():
        if not line.startswith('{"timestamp"'):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a guest console byte interleaved with the log line
        if message is None or event.get("fields", {}).get("message") == message:
            events.append(event)
    return events


def check_memory(host: str, want_mb: int, mem_kb: int) -> None:
    """MemTotal is a little below the VM's RAM (kernel, reserved areas)."""
    if not want_mb * 0.8 < mem_kb / 1024 <= want_mb:
        raise LabError(f"{host}: guest reports {mem_kb // 1024} MiB of memory, expected about {want_mb}")


class Guest:
    """A guest started on a virtual host."""

    def __init__(self, host: VirtualHost, spec: GuestSpec) -> None:
        self.host = host
        self.spec = spec
        self.console = f"/tmp/{spec.name}.console"
        self.started_at = 0.0
        self.ready_seconds: float | None = None

    def start(self) -> None:
        s = self.spec
        h = self.host
        if s.vmm == "kemari" and not h.run("command -v kemari", check=False).ok:
            raise LabError(f"{h.name}: kemari is not in the virtual host image (run the set-up with --kemari)")
        if s.disk and not s.disk_url:
            h.run(f"cp {GUEST_DIR}/disk.ext4 {s.disk_path}")
        self.add_tap(h)
        self.started_at = time.monotonic()
        self.launch(h, s.vmm_command())

    def add_tap(self, host: VirtualHost) -> None:
        """The guest's TAP in `host`'s br0 (where the guest starts, or may move to)."""
        if self.spec.net:
            t = self.spec.tap
            host.run(f"/sbin/ip tuntap add {t} mode tap && /sbin/ip link set {t} master br0 up")

    def launch(self, host: VirtualHost, command: str) -> None:
        """Runs a VMM command in the background on `host`, its output in the
        guest's console file there, followed by KLAB-VMM-EXIT=<status>.
        With KEMARI_LAB_MEMORY_DIGEST=1 here, kemari logs its memory digests
        at each live migration (`transfer::memory_digest`)."""
        if command.startswith("kemari ") and os.environ.get("KEMARI_LAB_MEMORY_DIGEST") == "1":
            command = "KEMARI_DEBUG_MEMORY_DIGEST=1 " + command
        host.run(f"( {command} > {self.console} 2>&1; echo KLAB-VMM-EXIT=$? >> {self.console} ) >/dev/null 2>&1 &")

    def ctl(self, args: str, timeout: float = 60, host: VirtualHost | None = None) -> dict[str, Any]:
        """`kemarictl <args>` against the guest's kemari (on `host`, by default
        where the guest runs); returns its JSON answer, raises with kemarictl's
        message on failure."""
        h = host or self.host
        if self.spec.vmm != "kemari":
            raise LabError(f"{h.name}: kemarictl needs a kemari guest, not {self.spec.vmm}")
        res = h.run(f"kemarictl -s {self.spec.api_socket} {args}", timeout=timeout, check=False)
        if not res.ok:
            raise LabError(f"{h.name}: kemarictl {args} failed (status {res.status}): {res.output.strip()}")
        try:
            answer: dict[str, Any] = json.loads(res.output[res.output.index("{") :])
        except ValueError:
            raise LabError(f"{h.name}: kemarictl {args} printed no JSON: {res.output!r}") from None
        return answer

    def diagnostics(self, console_chars: int = 2000) -> str:
        """What to read when the guest stops answering: kemari's devices (request
        counters; each queue's position against the guest's avail index, and
        the unacknowledged interrupt status), seccomp kills in the virtual
        host's kernel log, and the end of the console. Best effort: never
        raises."""
        parts = []
        if self.spec.vmm == "kemari":
            try:
                for d in self.ctl("metrics", timeout=30).get("devices", []):
                    parts.append(
                        f"  {d.get('name')}: counters {d.get('counters')} queues {d.get('queues')}"
                        f" interrupt_status {d.get('interrupt_status')}"
                    )
            except Exception as e:  # noqa: BLE001 - diagnostics must not hide the failure
                parts.append(f"  kemarictl metrics: {e}")
            try:
                # Whether a silent guest runs (exits keep coming: spinning or
                # waiting on a device) or has stopped (halted, no exits).
                info = self.ctl("info", timeout=30)
                first = self.ctl("metrics", timeout=30).get("exits", {})
                time.sleep(5)
                second = self.ctl("metrics", timeout=30).get("exits", {})
                delta = {k: v - first.get(k, 0) for k, v in second.items() if v != first.get(k, 0)}
                parts.append(
                    f"  kemari: state {info.get('state')} reboots {info.get('reboots')}"
                    f" guest_uptime_ms {info.get('guest_uptime_ms')}; vCPU exits in 5 s: {delta or 'none'}"
                )
            except Exception as e:  # noqa: BLE001
                parts.append(f"  kemarictl info/metrics: {e}")
        try:
            # A seccomp kill (kemari exits 159, SIGSYS) names its call here.
            audit = self.host.run("dmesg | grep -a 'type=1326' | tail -5", timeout=30, check=False).output.strip()
            if audit:
                parts.append("  seccomp (dmesg): " + audit)
        except Exception as e:  # noqa: BLE001
            parts.append(f"  dmesg: {e}")
        try:
            # The TAP's counters (TX: frames towards the guest, RX: the
            # guest's) and its bridge port: an unreachable guest shows here
            # whether frames reach it and whether it answers.
            tap = self.host.run(
                f"/sbin/ip -s link show dev {self.spec.tap}; /sbin/bridge link show dev {self.spec.tap}",
                timeout=30,
                check=False,
            ).output.strip()
            parts.append("  tap: " + " | ".join(line.strip() for line in tap.splitlines()))
        except Exception as e:  # noqa: BLE001
            parts.append(f"  tap: {e}")
        try:
            if console_chars > 0:  # 0: the caller shows the console itself
                parts.append("console:\n" + self.console_text()[-console_chars:])
        except Exception as e:  # noqa: BLE001
            parts.append(f"console: {e}")
        return f"{self.spec.name} on {self.host.name}:\n" + "\n".join(parts)

    def info(self) -> dict[str, Any]:
        """`kemarictl info` where the guest runs: state, vCPUs, memory, uptime, pid."""
        return self.ctl("info")

    def console_text(self, timeout: float = 60) -> str:
        """The guest's console so far (also saved beside the virtual host's log)."""
        text = self.host.run(f"cat {self.console}", timeout=timeout).output
        (self.host.run_dir / f"{self.host.name}-{self.spec.name}.console").write_text(text)
        return text

    def wait_ready(self, timeout: float = 240) -> str:
        """Waits for KLAB-GUEST-READY; fails early if the VMM exits. Returns the console."""
        pattern = re.compile(f"{READY_RE.pattern}|{EXIT_RE.pattern}")
        try:
            m = self.host.wait_file_match(self.console, pattern, timeout, f"guest {self.spec.name} to be ready")
        except LabError as e:
            # A boot that stalls (a disk read never answered, say) shows here.
            raise LabError(f"{e}\ndiagnostics of {self.spec.name}:\n{self.diagnostics(console_chars=600)}") from None
        if m.group(0).startswith("KLAB-VMM-EXIT"):
            raise LabError(
                f"{self.host.name}: {self.spec.vmm} exited before guest {self.spec.name} was ready:\n"
                + self.console_text()[-3000:]
            )
        self.ready_seconds = time.monotonic() - self.started_at
        return self.console_text()

    def exited_silently(self) -> bool:
        """Whether the VMM exited with status 0 before the guest printed
        anything: with `-no-reboot`, how QEMU ends a guest that reset early in
        its boot."""
        return self.host.run(f"cat {self.console}").output.strip() == "KLAB-VMM-EXIT=0"

    def check_boot(self, console: str) -> None:
        """Checks the guest's boot report: CPUs, memory, disk and network."""
        name = self.host.name
        booted = BOOTED_RE.search(console)
        if booted is None or int(booted.group(1)) != self.spec.vcpus:
            raise LabError(f"{name}: guest did not report {self.spec.vcpus} CPUs:\n{console[-2000:]}")
        check_memory(name, self.spec.memory_mb, int(booted.group(2)))
        checks = [(NET_RE, "network")] + ([(DISK_RE, "disk")] if self.spec.disk or self.spec.pmem else [])
        for regex, what in checks:
            m = regex.search(console)
            if m is None or m.group(1) != "OK":
                raise LabError(f"{name}: guest {what} check failed: {m.group(0) if m else 'no report'}")

    def wait_exit(self, timeout: float = 120) -> int:
        """Waits for the VMM to exit and returns its exit status."""
        m = self.host.wait_file_match(self.console, EXIT_RE, timeout, f"{self.spec.vmm} of {self.spec.name} to exit")
        self.console_text()  # keep the whole console in the run dir
        return int(m.group(1))
