"""Measurements of a host's Warm-VM Reboot (docs/warm-reboot.md, "Measured").

One virtual host with a 5 GiB persistent-memory region and a scratch disk
(its own disk, ext4 at /disk). Four kemari guests (1 vCPU each): s0, s1,
s2 of 512 MiB and b0 of 2 GiB, memory and disks on the region. In one run:

1. flat in memory size: freeze then resume s0 alone, then b0 alone,
   alternated, ROUNDS times each (`host-warm-reboot freeze` / `resume`:
   the same commands as around a kexec, without the kexec between them);
2. three VMs at once: s0, s1, s2 frozen and resumed together, ROUNDS times;
3. the whole thing: every guest with a client TCP connection (byte-checked
   echoes), frozen, the host kexecs, every guest resumed: each client's
   stall and each guest's time from the freeze to running again;
4. (b) suspend to disk: `kemarictl snapshot DIR --exit` of s0 and of b0 to
   /disk, the host's caches dropped, `kemari --restore DIR`;
5. (a) the guests rebooted with the host: each guest powers off, the host
   kexecs, each guest boots again; time from the poweroff request until
   each serves HTTP again.
"""

from __future__ import annotations

import re
import time
from typing import Any

from kemari_lab.connection import LongConnection
from kemari_lab.errors import LabError, step
from kemari_lab.guests import Guest
from kemari_lab.lab import Lab
from kemari_lab.warm_reboot import REGION, WarmHost
from kemari_lab.warm_reboot import lab_options as warm_lab_options

ROUNDS = 3
SMALL_MB = 512
BIG_MB = 2048


def lab_options() -> dict[str, Any]:
    return dict(warm_lab_options(region_gib=5), scratch_disk_gb=8)


def _running_after_restore(wh: WarmHost, g: Guest, directory: str) -> float:
    """`kemari --restore DIR` in the background; the host-measured seconds
    until `kemarictl info` says running."""
    s = g.spec
    log = f"{g.console}.from-disk"  # its own: the console holds earlier exits
    return wh.timed(
        f"rm -f {s.api_socket}; ( kemari --restore {directory} --api-socket {s.api_socket} > {log} 2>&1;"
        f" echo KEMARI-EXIT=$? >> {log} ) >/dev/null 2>&1 &"
        f" until kemarictl -s {s.api_socket} info 2>/dev/null | grep -q '\"state\": *\"running\"'; do"
        f" grep -q KEMARI-EXIT= {log} 2>/dev/null && exit 1; sleep 0.02; done"
    )


def _wait_gone(wh: WarmHost, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while wh.host.run("pidof kemari", check=False).ok:  # (busybox has no pgrep)
        if time.monotonic() > deadline:
            raise LabError(f"{wh.host.name}: kemari still runs {timeout:.0f}s after the guests' poweroff")
        time.sleep(1)


def bench(lab: Lab, vmm: str) -> dict[str, float]:
    """Warm-VM Reboot figures: freeze/resume of 512 MiB vs 2 GiB, 3 VMs,
    a kexec with 4 VMs, vs suspend to disk and vs rebooting the guests"""
    if vmm != "kemari":
        raise LabError(f"host-warm-reboot-bench measures kemari guests (--vmm kemari), not {vmm}")
    wh = WarmHost(lab.hosts[0])
    h = wh.host
    out: dict[str, float] = {}
    with step("preparing the region and the host's disk"):
        wh.prepare()
        wh.fetch_kernel()
        h.run(
            "for d in /sys/block/vd*; do [ \"$(cat $d/serial)\" = klab-scratch ] && dev=/dev/${d##*/}; done;"
            " mkfs.ext4 -q -F $dev && mkdir -p /disk && mount $dev /disk",
            timeout=300,
        )
    specs = [wh.spec(f"s{i}", i, SMALL_MB, vcpus=1) for i in range(3)] + [wh.spec("b0", 3, BIG_MB, vcpus=1)]
    guests = {}
    for spec in specs:
        guests[spec.name] = wh.start(spec)
    for g in guests.values():
        g.check_boot(g.wait_ready(timeout=600))
        out[f"boot_{g.spec.name}_s"] = g.ready_seconds or 0.0
    s0, b0 = guests["s0"], guests["b0"]
    small3 = [guests["s0"], guests["s1"], guests["s2"]]

    with step("freeze and resume, 512 MiB vs 2 GiB"):
        for r in range(1, ROUNDS + 1):
            for g in (s0, b0):
                f = wh.freeze([g])
                res = wh.resume()
                out[f"flat_{g.spec.name}_r{r}_freeze_s"] = f[f"frozen_{g.spec.name}_s"]
                out[f"flat_{g.spec.name}_r{r}_resume_s"] = res[f"resumed_{g.spec.name}_s"]
    with step("three VMs at once"):
        for r in range(1, ROUNDS + 1):
            f = wh.freeze(small3)
            res = wh.resume()
            out[f"three_r{r}_freeze_all_s"] = f["freeze_all_s"]
            out[f"three_r{r}_resume_all_s"] = res["resume_all_s"]
    with step("kexec with four VMs"):
        for g in guests.values():
            lab.wait_client_reach(g.spec.ip)
        conns = {n: LongConnection(lab, g.spec.ip, stall_limit=400).open() for n, g in guests.items()}
        try:
            for c in conns.values():
                c.expect_progress(5)
            before = {n: c.check() for n, c in conns.items()}
            wh.load()
            t0 = time.monotonic()
            f = wh.freeze()
            out["kexec4_freeze_all_s"] = f["freeze_all_s"]
            out["kexec4_kexec_to_host_ready_s"] = wh.kexec()
            wh.mount()
            res = wh.resume()
            out["kexec4_resume_all_s"] = res["resume_all_s"]
            out["kexec4_freeze_to_all_resumed_s"] = time.monotonic() - t0
            for n, c in conns.items():
                c.expect_progress(10, timeout=300)
                after = c.check()
                out[f"kexec4_client_stall_{n}_s"] = LongConnection.max_gap_in(
                    after, before[n]["elapsed_s"], after["elapsed_s"]
                )
            for c in conns.values():
                c.close()
        finally:
            for c in conns.values():
                c.abort()
    with step("(b) suspend to disk and resume"):
        for g in (s0, b0):
            d = f"/disk/snap-{g.spec.name}"
            out[f"disk_{g.spec.name}_snapshot_exit_s"] = wh.timed(
                f"kemarictl -s {g.spec.api_socket} snapshot {d} --exit >/dev/null 2>&1 && sync"
            )
            out[f"disk_{g.spec.name}_image_mb"] = float(
                h.run(f"du -sm {d} | cut -f1").output.strip() or 0
            )
            h.run("sync; echo 3 > /proc/sys/vm/drop_caches")
            out[f"disk_{g.spec.name}_restore_s"] = _running_after_restore(wh, g, d)
            lab.wait_client_reach(g.spec.ip, timeout=120)
    with step("(a) the guests rebooted with the host"):
        wh.fetch_kernel()
        wh.load()
        t0 = time.monotonic()
        for g in guests.values():
            lab.client_http_get(g.spec.ip, "/cgi-bin/poweroff")
        _wait_gone(wh)
        out["cold_guests_off_s"] = time.monotonic() - t0
        out["cold_kexec_to_host_ready_s"] = wh.kexec()
        wh.mount()
        wh.guests = []
        h.run(f"rm -f {REGION}/vms/*/memory")
        started = {}
        for spec in specs:
            started[spec.name] = wh.start(spec)
        for n, g in started.items():
            g.wait_ready(timeout=600)
            lab.wait_client_reach(g.spec.ip, timeout=120)
            out[f"cold_{n}_serving_again_s"] = time.monotonic() - t0
    for g in wh.guests:
        lab.client_http_get(g.spec.ip, "/cgi-bin/poweroff")
    _wait_gone(wh)
    out.update(summary(out))
    return out


def summary(times: dict[str, float]) -> dict[str, float]:
    """Medians and ratios of the figures above."""

    def med(keys: list[str]) -> float:
        vals = sorted(times[k] for k in keys if k in times)
        return vals[len(vals) // 2] if vals else float("nan")

    s: dict[str, float] = {}
    for part in ("freeze", "resume"):
        small = med([f"flat_s0_r{r}_{part}_s" for r in range(1, ROUNDS + 1)])
        big = med([f"flat_b0_r{r}_{part}_s" for r in range(1, ROUNDS + 1)])
        s[f"{part}_512m_median_s"], s[f"{part}_2g_median_s"] = small, big
        s[f"{part}_2g_over_512m"] = big / small if small else float("nan")
    stalls = [v for k, v in times.items() if re.match(r"kexec4_client_stall_", k)]
    s["warm_service_downtime_max_s"] = max(stalls, default=float("nan"))
    cold = [v for k, v in times.items() if re.match(r"cold_.*_serving_again_s", k)]
    s["cold_service_downtime_max_s"] = max(cold, default=float("nan"))
    return s
