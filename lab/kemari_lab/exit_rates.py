"""How often each VMM's guest leaves the CPU, under the soak's load (issue 24).

The soak's resets look like the emulated platform's: a guest dies in a
page-fault storm in its own exception entry, the same signature the virtual
hosts' kernels die with inside KVM_RUN, and QEMU's guests reset too. Such a
fault would strike per VM entry and exit, so a VMM whose guest exits more
often would see more of them. This scenario measures that rate side by side:
one virtual host, a kemari guest, a QEMU `-M pc` guest and a QEMU microvm
guest (2 vCPUs, 512 MiB, the soak's echo stream and disk writer on each),
then the virtual host's KVM counters per VM (debugfs,
`/sys/kernel/debug/kvm/<pid>-<fd>/`) read twice, `EXIT_RATES_SECONDS`
apart (default 60); `EXIT_RATES_VMMS` picks the guests (default
`kemari,qemu,qemu-microvm`). Printed per VMM: exits, I/O and MMIO exits,
interrupt injections, emulated instructions, page faults fixed, per second.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kemari_lab import images
from kemari_lab.lab import Lab
from kemari_lab.soak import Slot

COUNTERS = (
    "exits",
    "io_exits",
    "mmio_exits",
    "irq_exits",
    "halt_exits",
    "irq_injections",
    "insn_emulation",
    "pf_fixed",
    "tlb_flush",
    "irq_window_exits",
)


def _vm_dirs(host: Any) -> dict[str, str]:
    """Each KVM VM's debugfs directory, by its process's command line."""
    script = (
        "mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug;"
        " for d in /sys/kernel/debug/kvm/*-*; do p=${d##*/}; p=${p%%-*};"
        ' echo "$d $(tr "\\0" " " < /proc/$p/cmdline)"; done'
    )
    dirs: dict[str, str] = {}
    for line in host.run(script, timeout=60).output.splitlines():
        if line.startswith("/sys/kernel/debug/kvm/"):
            d, _, cmdline = line.partition(" ")
            dirs[d] = cmdline
    return dirs


def _read_counters(host: Any, d: str) -> dict[str, int]:
    """The KVM debugfs counters in VM directory `d`."""
    script = f'for f in {" ".join(COUNTERS)}; do echo "$f $(cat {d}/$f 2>/dev/null || echo -1)"; done'

    out = host.run(script, timeout=60).output
    counters: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in COUNTERS:
            counters[parts[0]] = int(parts[1])
    return counters


def exit_rates(lab: Lab, vmm: str = "", seconds: float | None = None) -> dict[str, float]:
    """kemari, QEMU pc and QEMU microvm guests under the soak's load on one
    virtual host: their KVM exits per second, side by side."""
    seconds = seconds or float(os.environ.get("EXIT_RATES_SECONDS", "60"))
    host = lab.hosts[0]
    thp = host.run("cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled")
    images.log(f"exit-rates: THP (anonymous, shmem): {' | '.join(thp.output.split(chr(10)))}")
    vmms = os.environ.get("EXIT_RATES_VMMS", "kemari,qemu,qemu-microvm").split(",")
    slots = [Slot(lab, host, v, i) for i, v in enumerate(vmms)]
    for s in slots:
        s.boot()
        if s.guest is None:
            raise RuntimeError(f"{s.label}: no guest booted ({s.given_up})")
    time.sleep(20)  # clients under way
    # A VM's process is the one whose command line names its guest's disk.
    dirs = _vm_dirs(host)
    pids: dict[str, str] = {}
    for s in slots:
        assert s.guest is not None
        found = [d for d, cmd in dirs.items() if s.guest.spec.disk_path in cmd]
        if not found:
            # Or the one its launcher's pid made (kemari's).
            pid = host.run(f"cat {s.guest.pidfile}").output.strip()
            found = [d for d in dirs if d.rsplit("/", 1)[-1].startswith(f"{pid}-")]
        if len(found) != 1:
            raise RuntimeError(f"{s.label}: {len(found)} KVM VMs name {s.guest.spec.disk_path}: {dirs}")
        pids[s.vmm] = found[0]
    before = {v: _read_counters(host, d) for v, d in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {v: _read_counters(host, d) for v, d in pids.items()}
    dt = time.monotonic() - t0
    out: dict[str, float] = {"seconds": round(dt, 1)}
    for v in pids:
        for c in COUNTERS:
            if before[v].get(c, -1) >= 0 and after[v].get(c, -1) >= 0:
                out[f"{v}_{c}_per_s"] = round((after[v][c] - before[v][c]) / dt, 1)
    for s in slots:
        if s.conn is not None:
            out[f"{s.vmm}_echo_bytes"] = float(s.conn.stats().get("bytes", 0))
        if s.disk is not None:
            out[f"{s.vmm}_disk_acks"] = float(s.disk.stats().get("acks", 0))
    lines = [f"exit rates over {dt:.0f} s (per second):"]
    for c in COUNTERS:
        row = "  ".join(f"{v} {out.get(f'{v}_{c}_per_s', float('nan')):>9.1f}" for v in pids)
        lines.append(f"  {c:<16} {row}")
    images.log("\n".join(lines))
    for s in slots:
        s._close_clients()
    return out
