"""Warm-VM Reboot of a virtual host (issue 26, item 2; docs/warm-reboot.md).

The virtual host boots with ``memmap=<n>G!4G``: the top <n> GiB of its RAM
become legacy persistent memory, /dev/pmem0, which the kernel does not use
and a kexec does not touch. An ext4 file system on it, mounted with
``-o dax`` at /pmem, holds each kemari VM's memory file, disk and
warm-restart state (``/pmem/vms/<name>/``). ``host-warm-reboot``
(scripts/, copied into the image) freezes the VMs, the host kexecs into its
kernel again (read from two read-only disks, serials klab-kernel and
klab-initrd), mounts /pmem again and resumes the VMs from their kept memory.
"""

from __future__ import annotations

import re
import time
from typing import Any

from kemari_lab.errors import LabError
from kemari_lab.guests import Guest, GuestSpec
from kemari_lab.vhost import READY_RE, VirtualHost

REGION = "/pmem"
# The region starts at 4 GiB: QEMU's pc machine puts the first 3 GiB of RAM
# below 4 GiB and the rest at 4 GiB, so RAM above 3 GiB is all region.
REGION_START_GIB = 4
BASE_HOST_MB = 3072
WARM = f"host-warm-reboot --region {REGION}"
TABLE = "/tmp/warm-reboot.table"
# The next kernel and initramfs, out of their disks (by serial) into /tmp/kexec.
FETCH = (
    "mkdir -p /tmp/kexec && for d in /sys/block/vd*; do"
    ' case "$(cat $d/serial)" in klab-kernel) cat /dev/${d##*/} > /tmp/kexec/vmlinuz ;;'
    " klab-initrd) cat /dev/${d##*/} > /tmp/kexec/initrd ;; esac; done;"
    " [ -s /tmp/kexec/vmlinuz ] && [ -s /tmp/kexec/initrd ]"
)
STEP_RE = re.compile(r"warm-reboot (frozen|resumed|freeze-all|resume-all)( name=(\S+))?( vms=\d+)? ms=(\d+)")


def lab_options(region_gib: int) -> dict[str, Any]:
    """Lab(...) options for a virtual host with a `region_gib` GiB region."""
    return {
        "host_memory_mb": BASE_HOST_MB + region_gib * 1024,
        "host_append": f"memmap={region_gib}G!{REGION_START_GIB}G",
        "kexec_media": True,
    }


def steps(output: str) -> dict[str, float]:
    """The script's step lines as seconds: ``frozen_<vm>_s``, ``freeze_all_s`` …"""
    out: dict[str, float] = {}
    for m in STEP_RE.finditer(output):
        kind, name, ms = m.group(1), m.group(3), int(m.group(5))
        key = f"{kind.replace('-', '_')}_{name}_s" if name else f"{kind.replace('-', '_')}_s"
        out[key] = ms / 1000
    return out


class WarmHost:
    """A virtual host prepared for a Warm-VM Reboot."""

    def __init__(self, host: VirtualHost) -> None:
        self.host = host
        self.guests: list[Guest] = []
        self.kexecs = 0

    def prepare(self) -> None:
        """Makes the DAX file system on the region (this once)."""
        h = self.host
        h.run("grep -q 'memmap=' /proc/cmdline && [ -b /dev/pmem0 ]")
        h.run(f"{WARM} format && {WARM} mount && grep ' {REGION} ' /proc/mounts", timeout=120)

    def fetch_kernel(self) -> None:
        """Copies the next kernel and initramfs out of their disks into /tmp
        (kexec -s reads files; /tmp is gone after each kexec)."""
        self.host.run(FETCH, timeout=300)

    def timed(self, command: str, timeout: float = 600) -> float:
        """Runs `command` on the host and returns its duration as the host
        measured it (/proc/uptime, 10 ms), without the console's overhead."""
        res = self.host.run(
            f"a=$(cut -d' ' -f1 /proc/uptime); {command}; s=$?;"
            f" b=$(cut -d' ' -f1 /proc/uptime); echo KLAB-TIMED $a $b; exit $s",
            timeout=timeout,
        )
        m = re.search(r"KLAB-TIMED ([\d.]+) ([\d.]+)", res.output)
        if m is None:
            raise LabError(f"{self.host.name}: no timing from `{command}`: {res.output!r}")
        return float(m.group(2)) - float(m.group(1))

    def spec(self, name: str, index: int, memory_mb: int, vcpus: int = 2) -> GuestSpec:
        """A kemari guest whose memory file and disk live on the region."""
        d = f"{REGION}/vms/{name}"
        return GuestSpec(
            name=name,
            vmm="kemari",
            index=index,
            memory_mb=memory_mb,
            vcpus=vcpus,
            host_index=self.host.index,
            disk_dir=d,
            vmm_args=f"--memory-file {d}/memory",
        )

    def start(self, spec: GuestSpec) -> Guest:
        """Starts the guest (returns at once; wait with Guest.wait_ready)."""
        self.host.run(f"mkdir -p {REGION}/vms/{spec.name}")
        guest = Guest(self.host, spec)
        guest.start()
        self.guests.append(guest)
        return guest

    def load(self, fast: bool = False) -> float:
        """kexec -l of the next kernel (before the freeze: not downtime),
        fetched again from its disks: a kexec since left an empty /tmp.
        `fast`: `load --fast` (kexec_load below the region, no purgatory
        checksum)."""
        t0 = time.monotonic()
        opt = " --fast" if fast else ""
        self.host.run(f"{FETCH} && {WARM} load{opt} /tmp/kexec/vmlinuz /tmp/kexec/initrd", timeout=300)
        return time.monotonic() - t0

    def load_in_background(self) -> None:
        """Fetches and loads the next kernel in the background (while a
        guest boots); :meth:`wait_loaded` waits for it."""
        self.host.run(
            f"( {FETCH} && {WARM} load /tmp/kexec/vmlinuz /tmp/kexec/initrd;"
            " echo KLAB-LOADED=$? ) > /tmp/kexec-load.log 2>&1 &"
        )

    def wait_loaded(self, timeout: float = 300) -> None:
        m = self.host.wait_file_match(
            "/tmp/kexec-load.log", re.compile(r"KLAB-LOADED=(\d+)"), timeout, "the next kernel to be loaded"
        )
        if m.group(1) != "0":
            raise LabError(f"{self.host.name}: loading the next kernel failed: see /tmp/kexec-load.log")

    def write_table(self, guests: list[Guest]) -> None:
        # The resumed kemari logs as the first one did (log_args: none, or
        # --log-level … --log-json, a word each: no spaces in the level).
        lines = "\n".join(
            f"{g.spec.name} {g.spec.api_socket} br0:{g.spec.tap} {g.console}{g.spec.log_args}" for g in guests
        )
        self.host.run(f"cat > {TABLE} <<'EOF'\n{lines}\nEOF")

    def save_consoles(self, suffix: str) -> None:
        for g in self.guests:
            text = self.host.run(f"cat {g.console}").output
            (self.host.run_dir / f"{self.host.name}-{g.spec.name}-{suffix}.console").write_text(text)

    def freeze(self, guests: list[Guest] | None = None) -> dict[str, float]:
        """Freezes every guest, or those given (in parallel); per-VM and whole times."""
        self.write_table(self.guests if guests is None else guests)
        self.save_consoles(f"before-kexec-{self.kexecs + 1}")
        res = self.host.run(f"{WARM} freeze {TABLE}", timeout=300, check=False)
        if not res.ok:
            raise LabError(f"{self.host.name}: host-warm-reboot freeze failed:\n{res.output}")
        return steps(res.output)

    def checksums(self, sample_every_mb: int = 1) -> dict[str, str]:
        """sha256 of each frozen guest's memory file (the pages that must
        come through the kexec unchanged): all of it, or 1 MiB out of every
        `sample_every_mb` (hashing 512 MiB takes minutes on TCG)."""
        out = {}
        for g in self.guests:
            f = f"{REGION}/vms/{g.spec.name}/memory"
            if sample_every_mb <= 1:
                cmd = f"sha256sum {f}"
            else:
                last = g.spec.memory_mb - 1
                cmd = (
                    f"for i in $(seq 0 {sample_every_mb} {last}); do"
                    f" dd if={f} bs=1M skip=$i count=1 2>/dev/null; done | sha256sum"
                )
            out[g.spec.name] = self.host.run(cmd, timeout=600).output.split()[0]
        return out

    def kexec(self, timeout: float = 300) -> float:
        """`host-warm-reboot kexec`; waits until the new kernel's init is up.
        Returns the seconds from the command to KLAB-HOST-READY."""
        t0 = time.monotonic()
        start = self.host.send(f"{WARM} kexec")
        self.host.wait_for(re.compile(r"warm-reboot kexec\n"), 60, "the kexec", start=start)
        self.host.wait_for(READY_RE, timeout, "the host's new kernel to boot", start=start)
        self.kexecs += 1
        return time.monotonic() - t0

    def mount(self) -> None:
        self.host.run(f"{WARM} mount && grep ' {REGION} ' /proc/mounts", timeout=120)

    def resume(self) -> dict[str, float]:
        """Resumes every frozen guest (in parallel); per-VM and whole times."""
        res = self.host.run(f"{WARM} resume", timeout=600, check=False)
        if not res.ok:
            tails = "".join(self.host.run(f"tail -20 {g.console}", check=False).output for g in self.guests)
            raise LabError(f"{self.host.name}: host-warm-reboot resume failed:\n{res.output}\n{tails}")
        return steps(res.output)


CLOCK_RE = re.compile(r"KLAB-CLOCK uptime=([\d.]+) realtime=(\d+)")


def guest_clock(lab: Any, ip: str, timeout: float = 10) -> tuple[float, float, float]:
    """(client's time.time(), guest uptime, guest wall clock) from GET /cgi-bin/clock."""
    # Retried until `timeout`: a new connection can fail at once ("No route
    # to host": the client's ARP entry lapsed while the host was busy; bench
    # run 9 ended there with the guest's echo connection going on).
    deadline = time.monotonic() + timeout
    while True:
        t = time.time()
        try:
            body = lab.client_http_get(ip, "/cgi-bin/clock", timeout=max(1.0, deadline - time.monotonic()))
            break
        except LabError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    m = CLOCK_RE.search(body)
    if m is None:
        raise LabError(f"guest {ip}: /cgi-bin/clock answered {body!r}")
    return t, float(m.group(1)), float(m.group(2))
