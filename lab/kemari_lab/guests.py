"""Guests inside a virtual host, run by kemari or by QEMU (-enable-kvm).

Both VMMs boot the same images (/lab/guest/ in the virtual host: the Debian
kernel, the guest initramfs, a fresh copy of the ext4 disk) with the same
command line, a virtio-blk disk and a virtio-net device on a TAP in the
virtual host's br0. The guest's console goes to /tmp/<name>.console in the
virtual host; when the VMM exits, ``KLAB-VMM-EXIT=<status>`` is appended.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from kemari_lab.errors import LabError
from kemari_lab.netns import PREFIX_LEN, guest_ip
from kemari_lab.vhost import VirtualHost

GUEST_DIR = "/lab/guest"
# qemu: QEMU -M pc, virtio-pci devices; qemu-microvm: QEMU -M microvm with
# virtio-mmio devices described in ACPI, the same drivers kemari's guest uses.
VMMS = ("qemu", "qemu-microvm", "kemari")

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
    net: bool = True
    ip: str = field(init=False)
    mac: str = field(init=False)
    tap: str = field(init=False)

    def __post_init__(self) -> None:
        if self.vmm not in VMMS:
            raise LabError(f"unknown VMM {self.vmm!r} (one of {', '.join(VMMS)})")
        self.ip = guest_ip(self.host_index, self.index)
        self.mac = f"52:54:00:77:{1 + self.host_index:02x}:{self.index:02x}"
        self.tap = f"g{self.index}"

    @property
    def cmdline(self) -> str:
        return f"console=ttyS0 quiet panic=-1 klab.ip={self.ip}/{PREFIX_LEN} {self.extra_cmdline}".strip()

    @property
    def disk_path(self) -> str:
        return f"/tmp/{self.name}.disk"

    def vmm_command(self) -> str:
        """The VMM's shell command line inside the virtual host."""
        if self.vmm.startswith("qemu"):
            microvm = self.vmm == "qemu-microvm"
            machine = "microvm,acpi=on,pit=off,pic=off,rtc=off" if microvm else "pc"
            bus = "device" if microvm else "pci"
            cmd = (
                f"qemu-system-x86_64 -enable-kvm -cpu host -M {machine} -nodefaults -display none -no-reboot"
                f" -smp {self.vcpus} -m {self.memory_mb} -serial stdio -monitor none"
                f" -kernel {GUEST_DIR}/vmlinuz -initrd {GUEST_DIR}/initrd.cpio -append '{self.cmdline}'"
            )
            if self.disk:
                cmd += f" -drive file={self.disk_path},format=raw,if=none,id=d0 -device virtio-blk-{bus},drive=d0"
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
        )
        if self.disk:
            cmd += f" --disk {self.disk_path}"
        if self.net:
            cmd += f" --net tap={self.tap},mac={self.mac}"
        return cmd


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
        if s.disk:
            h.run(f"cp {GUEST_DIR}/disk.ext4 {s.disk_path}")
        if s.net:
            h.run(f"/sbin/ip tuntap add {s.tap} mode tap && /sbin/ip link set {s.tap} master br0 up")
        self.started_at = time.monotonic()
        h.run(
            f"( {s.vmm_command()} > {self.console} 2>&1; echo KLAB-VMM-EXIT=$? >> {self.console} ) >/dev/null 2>&1 &"
        )

    def console_text(self) -> str:
        """The guest's console so far (also saved beside the virtual host's log)."""
        text = self.host.run(f"cat {self.console}").output
        (self.host.run_dir / f"{self.host.name}-{self.spec.name}.console").write_text(text)
        return text

    def wait_ready(self, timeout: float = 240) -> str:
        """Waits for KLAB-GUEST-READY; fails early if the VMM exits. Returns the console."""
        pattern = re.compile(f"{READY_RE.pattern}|{EXIT_RE.pattern}")
        m = self.host.wait_file_match(self.console, pattern, timeout, f"guest {self.spec.name} to be ready")
        if m.group(0).startswith("KLAB-VMM-EXIT"):
            raise LabError(
                f"{self.host.name}: {self.spec.vmm} exited before guest {self.spec.name} was ready:\n"
                + self.console_text()[-3000:]
            )
        self.ready_seconds = time.monotonic() - self.started_at
        return self.console_text()

    def wait_exit(self, timeout: float = 120) -> int:
        """Waits for the VMM to exit and returns its exit status."""
        m = self.host.wait_file_match(self.console, EXIT_RE, timeout, f"{self.spec.vmm} of {self.spec.name} to exit")
        self.console_text()  # keep the whole console in the run dir
        return int(m.group(1))
