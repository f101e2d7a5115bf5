"""Measurements of a host's Warm-VM Reboot (docs/warm-reboot.md, "Measured").

One virtual host (3 GiB of RAM + a 6 GiB persistent-memory region, 9 GiB
in all) and a scratch disk (its own disk, ext4 at /disk). Seven kemari
guests of 1 vCPU, memory and disks on the region: s0–s5 of 512 MiB and b0
of 2 GiB. Each guest first fills most of its memory with non-zero data
(``/cgi-bin/fill``: a tmpfs file, 320 MiB and 1664 MiB), so that both the
warm path and suspend-to-disk have the same, full, memory to keep; each has
a client TCP connection (byte-checked echoes) open all along and a disk
writer (synced records, one a second). In one run:

1. warm vs disk, 512 MiB vs 2 GiB, alternated, ROUNDS times: freeze then
   resume s0 (`host-warm-reboot freeze` / `resume`, the commands around a
   kexec, without the kexec), the same for b0; then (b) suspend to disk:
   `kemarictl snapshot DIR --exit` of s0 to /disk and `sync`, the host's
   caches dropped, `kemari --restore DIR` into its memory file again; b0
   the same; then KEMARI_WARM_BENCH_WARM_ROUNDS (default 0) more rounds of
   the warm freeze/resume alone, the size going first alternating (cheap
   samples for the flatness ratio);
2. 1, 3 and 6 VMs (s0; s0–s2; s0–s5) frozen and resumed together,
   KEMARI_WARM_BENCH_N_ROUNDS (default 2) times, alternated;
3. (unless KEMARI_WARM_BENCH_KEXEC=0) all seven through a kexec of the host;
4. then (unless KEMARI_WARM_BENCH_COLD=0) (a), the same guests rebooted with
   the host: each powers off, the host kexecs, each boots again; the time
   from the poweroff request until each serves HTTP again, against the
   warm kexec's worst client stall.

Both kexecs load the next kernel the same way: `host-warm-reboot load
--fast` (no purgatory checksum), or with KEMARI_WARM_BENCH_FAST_LOAD=0 the
default `load` (kexec_file_load).

For every freeze/resume (and suspend/restore) each guest's downtime as it
sees it: its clock gap (the client's wall time passed minus the guest's
uptime passed, across the step) and its client's stall (the longest gap
between echoes). At the end every connection must still be the same one
(no reset, every echo byte-exact) and every guest's disk must hold every
record its writer synced. The figures so far are also written, after each
step, to ``warm-bench.json`` in the run directory.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kemari_lab.connection import LongConnection
from kemari_lab.errors import LabError, step
from kemari_lab.guests import Guest, GuestSpec, vmm_log
from kemari_lab.lab import Lab
from kemari_lab.warm_reboot import REGION, WarmHost, guest_clock
from kemari_lab.warm_reboot import lab_options as warm_lab_options

ROUNDS = 3
# KEMARI_WARM_BENCH_PART: all, or one half (the whole takes longer than a
# lab run should on a loaded machine): disk (s0 and b0 filled, warm vs
# suspend to disk) or vms (s0–s5 unfilled: 1/3/6 VMs and the kexec).
PARTS = ("all", "disk", "vms")
N_ROUNDS = 2
FAST_LOAD = os.environ.get("KEMARI_WARM_BENCH_FAST_LOAD", "1") != "0"
SMALL_MB = 512
BIG_MB = 2048
N_SMALL = 6
# Most of each guest's memory (MemTotal is ~470 MiB and ~1.95 GiB): in use.
FILL_MB = {SMALL_MB: 320, BIG_MB: 1664}
REGION_GIB = 6
# Suspend to disk of a filled 2 GiB guest writes (and restore reads) ~1.8 GB
# through the virtual host's emulated disk at ~4-7 MB/s (run 5): minutes
# each way, more than the 600 s a timed host command gets by default.
DISK_STEP_TIMEOUT = 1800
# kemari logs its own set-up time of each (re)start at this level: what of
# a resume is kemari's (KVM, memory slots, devices, vCPUs) and what is the
# script's (process start, polling `kemarictl info`).
LOG_LEVEL = "info,vmm::machine::builder=debug"
FILL_RE = re.compile(r"KLAB-FILL mb=(\d+) avail_kb=(\d+) start=([\d.]+) end=([\d.]+)")
RECORDS_NOW_RE = re.compile(r"KLAB-RECORDS-NOW lines=(\d+) synced=(\d+) bad=(\d+)")


def lab_options() -> dict[str, Any]:
    return dict(warm_lab_options(region_gib=REGION_GIB), scratch_disk_gb=8)


class Watch:
    """One guest's view of a step: its clock gap and its client's stall."""

    def __init__(self, lab: Lab, guest: Guest) -> None:
        self.lab = lab
        self.guest = guest
        self.conn = LongConnection(lab, guest.spec.ip, interval=0.2, stall_limit=900)
        self._clock: tuple[float, float, float] | None = None
        self._stats: dict[str, Any] = {}

    def before(self) -> None:
        self._stats = self.conn.check()
        self._clock = self._guest_clock()

    def _guest_clock(self) -> tuple[float, float, float]:
        # A guest that stopped answering says why, if kemari can (bench run
        # 12: s5 unreachable right before the kexec, nothing recorded).
        try:
            return guest_clock(self.lab, self.guest.spec.ip, timeout=180)
        except LabError as e:
            raise LabError(f"{e}\ndiagnostics of {self.guest.spec.name}:\n{self.guest.diagnostics()}") from None

    def after(self) -> tuple[float, float]:
        """(guest clock gap, client stall) since :meth:`before`, in seconds."""
        assert self._clock is not None
        try:
            self.conn.expect_progress(3, timeout=600)
        except LabError as e:
            raise LabError(f"{e}\ndiagnostics of {self.guest.spec.name}:\n{self.guest.diagnostics()}") from None
        # A guest just restored from disk answers slowly (every page of it
        # faults in again): run 5 timed out at 10 s here.
        clock = self._guest_clock()
        stats = self.conn.check()
        gap = (clock[0] - self._clock[0]) - (clock[1] - self._clock[1])
        stall = LongConnection.max_gap_in(
            stats, self._stats["elapsed_s"], stats["elapsed_s"]
        )
        return gap, stall


def _record_watch(out: dict[str, float], prefix: str, watches: list[Watch]) -> None:
    for w in watches:
        gap, stall = w.after()
        out[f"{prefix}_{w.guest.spec.name}_clock_gap_s"] = gap
        out[f"{prefix}_{w.guest.spec.name}_stall_s"] = stall


def _warm_cycle(
    wh: WarmHost, out: dict[str, float], prefix: str, watches: list[Watch]
) -> None:
    """Freezes and resumes the watched guests together (no kexec)."""
    for w in watches:
        w.before()
    f = wh.freeze([w.guest for w in watches])
    res = wh.resume()
    out[f"{prefix}_freeze_all_s"] = f["freeze_all_s"]
    out[f"{prefix}_resume_all_s"] = res["resume_all_s"]
    for w in watches:
        n = w.guest.spec.name
        out[f"{prefix}_{n}_freeze_s"] = f[f"frozen_{n}_s"]
        out[f"{prefix}_{n}_resume_s"] = res[f"resumed_{n}_s"]
    _record_watch(out, prefix, watches)
    for w in watches:
        out.update(setup_times(w.guest.console_text(), f"{prefix}_{w.guest.spec.name}"))


def setup_times(console: str, prefix: str) -> dict[str, float]:
    """kemari's own timing of its last (re)start in a console (LOG_LEVEL):
    from its start of the set-up to the memory mapped, the KVM memory slots
    made, the devices, the vCPUs, and running (``machine set-up timing``,
    µs) as ``{prefix}_kemari_<part>_s``; nothing without that log line."""
    events = vmm_log(console, "machine set-up timing")
    if not events:
        return {}
    fields = events[-1].get("fields", {})
    parts = {
        "memory": "memory_us",
        "memslots": "memslots_done_us",
        "devices": "devices_done_us",
        "vcpus": "vcpus_done_us",
        "started": "started_us",
    }
    return {
        f"{prefix}_kemari_{part}_s": int(fields[key]) / 1e6
        for part, key in parts.items()
        if key in fields
    }


def _running_after_restore(wh: WarmHost, g: Guest, directory: str) -> float:
    """`kemari --restore DIR` into the guest's memory file on the region, in
    the background; the host-measured seconds until `kemarictl info` says running."""
    s = g.spec
    log = f"{g.console}.from-disk"  # its own: the console holds earlier exits
    return wh.timed(
        f"rm -f {s.api_socket} {log}; ( kemari --restore {directory} --api-socket {s.api_socket}"
        f" --memory-file {REGION}/vms/{s.name}/memory > {log} 2>&1;"
        f" echo KEMARI-EXIT=$? >> {log} ) >/dev/null 2>&1 &"
        f' until kemarictl -s {s.api_socket} info 2>/dev/null | grep -q \'"state": *"running"\'; do'
        f" grep -q KEMARI-EXIT= {log} 2>/dev/null && exit 1; sleep 0.02; done",
        timeout=DISK_STEP_TIMEOUT,
    )


def _disk_cycle(wh: WarmHost, out: dict[str, float], prefix: str, w: Watch) -> None:
    """(b) suspend to the host's disk and restore, caches dropped."""
    g, h = w.guest, wh.host
    d = f"/disk/snap-{g.spec.name}"
    h.run(f"rm -rf {d}", timeout=300)
    w.before()
    out[f"{prefix}_snapshot_exit_s"] = wh.timed(
        f"kemarictl -s {g.spec.api_socket} snapshot {d} --exit >/dev/null 2>&1 && sync",
        timeout=DISK_STEP_TIMEOUT,
    )
    out[f"{prefix}_image_mb"] = float(
        h.run(f"du -sm {d} | cut -f1").output.strip() or 0
    )
    h.run("sync; echo 3 > /proc/sys/vm/drop_caches")
    try:
        out[f"{prefix}_restore_s"] = _running_after_restore(wh, g, d)
    except LabError:
        log = h.run(f"tail -30 {g.console}.from-disk", check=False).output
        raise LabError(
            f"{h.name}: restoring {g.spec.name} from {d} failed:\n{log}"
        ) from None
    gap, stall = w.after()
    out[f"{prefix}_clock_gap_s"] = gap
    out[f"{prefix}_stall_s"] = stall


def env_rounds(name: str, default: int) -> int:
    """A round count from the environment (0 or more)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise LabError(f"{name}={text}: a number of rounds (0 or more)")
    return int(text)


def warm_order(r: int, pair: list[Watch]) -> list[Watch]:
    """The warm-only rounds alternate which size goes first (no order bias)."""
    return pair if r % 2 else pair[::-1]


def _save(lab: Lab, out: dict[str, float]) -> None:
    (lab.run_dir / "warm-bench.json").write_text(
        json.dumps({k: round(v, 3) for k, v in out.items()}, indent=1)
    )


def bench(lab: Lab, vmm: str) -> dict[str, float]:
    """Warm-VM Reboot figures with guests whose memory is in use: warm vs
    suspend to disk at 512 MiB and 2 GiB, 1/3/6 VMs, a kexec with seven"""
    if vmm != "kemari":
        raise LabError(
            f"host-warm-reboot-bench measures kemari guests (--vmm kemari), not {vmm}"
        )
    wh = WarmHost(lab.hosts[0])
    h = wh.host
    out: dict[str, float] = {}
    with step("preparing the region and the host's disk"):
        wh.prepare()
        h.run(
            'for d in /sys/block/vd*; do [ "$(cat $d/serial)" = klab-scratch ] && dev=/dev/${d##*/}; done;'
            " mkfs.ext4 -q -F $dev && mkdir -p /disk && mount $dev /disk",
            timeout=300,
        )
    part = os.environ.get("KEMARI_WARM_BENCH_PART", "all")
    if part not in PARTS:
        raise LabError(f"KEMARI_WARM_BENCH_PART={part}: one of {', '.join(PARTS)}")
    rounds = env_rounds("KEMARI_WARM_BENCH_ROUNDS", ROUNDS)
    warm_rounds = env_rounds("KEMARI_WARM_BENCH_WARM_ROUNDS", 0)
    n_small = N_SMALL if part != "disk" else 1
    specs = [wh.spec(f"s{i}", i, SMALL_MB, vcpus=1) for i in range(n_small)]
    if part != "vms":
        specs.append(wh.spec("b0", N_SMALL, BIG_MB, vcpus=1))
    for spec in specs:
        spec.log_level = LOG_LEVEL
    guests = {spec.name: wh.start(spec) for spec in specs}
    with step("booting the guests"):
        for g in guests.values():
            g.check_boot(g.wait_ready(timeout=900))
            out[f"boot_{g.spec.name}_s"] = g.ready_seconds or 0.0
    with step("filling the guests' memory"):
        to_fill = guests if part != "vms" else {}
        for g in to_fill.values():
            lab.wait_client_reach(g.spec.ip, timeout=120)

        def fill(g: Guest) -> str:
            return lab.client_http_get(
                g.spec.ip, f"/cgi-bin/fill?{FILL_MB[g.spec.memory_mb]}", timeout=1200
            )

        with ThreadPoolExecutor(max_workers=len(guests)) as pool:
            bodies = dict(zip(to_fill, pool.map(fill, to_fill.values())))
        for name, body in bodies.items():
            want = FILL_MB[guests[name].spec.memory_mb]
            m = FILL_RE.search(body)
            if m is None or int(m.group(1)) < want:
                raise LabError(
                    f"guest {name}: filling its memory answered {body.strip()!r}"
                )
            out[f"fill_{name}_mb"] = float(m.group(1))
            out[f"fill_{name}_avail_after_mb"] = int(m.group(2)) / 1024
            out[f"fill_{name}_s"] = float(m.group(4)) - float(m.group(3))
        for g in guests.values():
            out[f"memory_file_{g.spec.name}_mb"] = float(
                h.run(
                    f"du -sm {REGION}/vms/{g.spec.name}/memory | cut -f1"
                ).output.strip()
                or 0
            )
    _save(lab, out)
    watches = {n: Watch(lab, g) for n, g in guests.items()}
    try:
        for w in watches.values():
            try:
                w.conn.open()
                w.conn.expect_progress(3, timeout=120)
            except LabError as e:
                raise LabError(f"{e}\ndiagnostics of {w.guest.spec.name}:\n{w.guest.diagnostics()}") from None
        for g in guests.values():
            if "writer" not in lab.client_http_get(g.spec.ip, "/cgi-bin/writer?pace=1", timeout=120):
                raise LabError(f"guest {g.spec.name}: its disk writer did not start")
        for r in range(1, rounds + 1 if part != "vms" else 1):
            s0, b0 = watches["s0"], watches["b0"]
            with step(f"warm vs disk, round {r}"):
                for w in (s0, b0):
                    _warm_cycle(wh, out, f"warm_r{r}", [w])
                for w in (s0, b0):
                    _disk_cycle(wh, out, f"disk_r{r}_{w.guest.spec.name}", w)
            _save(lab, out)
        for r in range(rounds + 1, rounds + 1 + warm_rounds if part != "vms" else 1):
            with step(f"warm only, round {r}"):
                for w in warm_order(r, [watches["s0"], watches["b0"]]):
                    _warm_cycle(wh, out, f"warm_r{r}", [w])
            _save(lab, out)
        small = [watches[f"s{i}"] for i in range(n_small)]
        n_rounds = env_rounds("KEMARI_WARM_BENCH_N_ROUNDS", N_ROUNDS)
        for r in range(1, n_rounds + 1 if part != "disk" else 1):
            for n in (1, 3, N_SMALL):
                with step(f"{n} VMs at once, round {r}"):
                    _warm_cycle(wh, out, f"vms{n}_r{r}", small[:n])
            _save(lab, out)
        if part != "disk" and os.environ.get("KEMARI_WARM_BENCH_KEXEC", "1") != "0":
            with step("a kexec with every VM"):
                wh.fetch_kernel()
                wh.load(fast=FAST_LOAD)
                for w in watches.values():
                    w.before()
                t0 = time.monotonic()
                f = wh.freeze()
                out["kexec_freeze_all_s"] = f["freeze_all_s"]
                out["kexec_kexec_to_host_ready_s"] = wh.kexec()
                res = wh.resume()  # (mounts the region first)
                out["kexec_resume_all_s"] = res["resume_all_s"]
                out["kexec_freeze_to_all_resumed_s"] = time.monotonic() - t0
                # The same probe as (a)'s: a new HTTP request from the client
                # until it is answered, timed from the operator's first step.
                with ThreadPoolExecutor(max_workers=len(guests)) as pool:
                    for name, probe in _serving_again(pool, lab, guests, t0).items():
                        out[f"kexec_{name}_serving_again_s"] = probe.result()
                for name in guests:
                    out[f"kexec_{name}_freeze_s"] = f[f"frozen_{name}_s"]
                    out[f"kexec_{name}_resume_s"] = res[f"resumed_{name}_s"]
                _record_watch(out, "kexec", list(watches.values()))
            _save(lab, out)
        with step("checking every record and every connection"):
            # Every guest is checked (not only up to the first failure), and
            # each failure comes with its kemari's device queues and console.
            failed = []
            for g in guests.values():
                try:
                    body = lab.client_http_get(g.spec.ip, "/cgi-bin/records", timeout=120)
                except LabError as e:
                    failed.append(f"guest {g.spec.name}: {e}\n{g.diagnostics()}")
                    continue
                rec = RECORDS_NOW_RE.search(body)
                if (
                    rec is None
                    or rec.group(1) != rec.group(2)
                    or rec.group(3) != "0"
                    or rec.group(2) == "0"
                ):
                    failed.append(
                        f"guest {g.spec.name}: its record log at the end: {body.strip()!r}"
                    )
                    continue
                out[f"records_{g.spec.name}"] = float(rec.group(2))
            _save(lab, out)
            if failed:
                raise LabError("\n".join(failed))
            for name, w in watches.items():
                final = w.conn.close()
                out[f"echoes_{name}"] = float(final["exchanges"])
    finally:
        for w in watches.values():
            w.conn.abort()
    if "kexec_freeze_all_s" in out and os.environ.get("KEMARI_WARM_BENCH_COLD", "1") != "0":
        with step("(a) the guests rebooted with the host"):
            _cold_reboot(lab, wh, specs, out)
        _save(lab, out)
    for g in wh.guests:
        lab.client_http_get(g.spec.ip, "/cgi-bin/poweroff")
    out.update(summary(out))
    _save(lab, out)
    return out


def _wait_gone(wh: WarmHost, timeout: float = 180) -> None:
    """Waits until no kemari runs on the host (the guests powered off)."""
    deadline = time.monotonic() + timeout
    while wh.host.run("pidof kemari", check=False).ok:  # (busybox has no pgrep)
        if time.monotonic() > deadline:
            raise LabError(f"{wh.host.name}: kemari still runs {timeout:.0f}s after the guests' poweroff")
        time.sleep(1)


def _cold_reboot(lab: Lab, wh: WarmHost, specs: list[GuestSpec], out: dict[str, float]) -> None:
    """(a), right after the warm kexec and on the same guests: each guest
    powers off, the host kexecs into the same kernel, each guest boots
    again from its disk; each guest's service downtime is the time from the
    poweroff request until it serves HTTP to the client again."""
    h = wh.host
    wh.load(fast=FAST_LOAD)
    t0 = time.monotonic()
    for g in wh.guests:
        lab.client_http_get(g.spec.ip, "/cgi-bin/poweroff")
    _wait_gone(wh)
    out["cold_guests_off_s"] = time.monotonic() - t0
    out["cold_kexec_to_host_ready_s"] = wh.kexec()
    wh.mount()
    wh.guests = []
    h.run(f"rm -f {REGION}/vms/*/memory")
    started = {spec.name: wh.start(spec) for spec in specs}
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=len(started)) as pool:
        probes = _serving_again(pool, lab, started, t0, stop, timeout=900)
        try:
            for g in started.values():
                # Fails early, with the console, if a guest's kemari exits.
                g.wait_ready(timeout=900)
        except BaseException:
            stop.set()  # (the pool waits for its probes before this raises)
            raise
        for name, probe in probes.items():
            out[f"cold_{name}_serving_again_s"] = probe.result()


def _serving_again(
    pool: ThreadPoolExecutor,
    lab: Lab,
    guests: dict[str, Guest],
    t0: float,
    stop: threading.Event | None = None,
    timeout: float = 120,
) -> dict[str, Future[float]]:
    """Probes every guest at once, each until it answers a new HTTP request
    from the client ("serving again": the same probe after a warm resume and
    a cold boot), `timeout` passes or `stop` is set; the seconds from `t0` at
    which each did."""

    def probe(g: Guest) -> float:
        deadline = time.monotonic() + timeout
        while True:
            try:
                body = lab.client_http_get(g.spec.ip, "/", timeout=5)
            except LabError:
                if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                    raise
                time.sleep(0.5)
                continue
            if "hello" not in body:
                raise LabError(f"guest {g.spec.name}: its web server answered without its page: {body[:200]!r}")
            return time.monotonic() - t0

    return {name: pool.submit(probe, g) for name, g in guests.items()}


def summary(times: dict[str, float]) -> dict[str, float]:
    """Medians and ratios of the figures above."""

    def med(pattern: str) -> float:
        vals = [v for k, v in times.items() if re.fullmatch(pattern, k)]
        return statistics.median(vals) if vals else float("nan")

    def worst(pattern: str) -> float:
        return max(
            (v for k, v in times.items() if re.fullmatch(pattern, k)),
            default=float("nan"),
        )

    s: dict[str, float] = {}
    for name, size in (("s0", "512m"), ("b0", "2g")):
        for part in ("freeze", "resume"):
            s[f"warm_{part}_{size}_median_s"] = med(rf"warm_r\d+_{name}_{part}_s")
        s[f"warm_{size}_median_s"] = (
            s[f"warm_freeze_{size}_median_s"] + s[f"warm_resume_{size}_median_s"]
        )
        s[f"disk_snapshot_{size}_median_s"] = med(rf"disk_r\d+_{name}_snapshot_exit_s")
        s[f"disk_restore_{size}_median_s"] = med(rf"disk_r\d+_{name}_restore_s")
        s[f"disk_{size}_median_s"] = (
            s[f"disk_snapshot_{size}_median_s"] + s[f"disk_restore_{size}_median_s"]
        )
        s[f"disk_over_warm_{size}"] = (
            s[f"disk_{size}_median_s"] / s[f"warm_{size}_median_s"]
        )
        s[f"warm_kemari_started_{size}_median_s"] = med(
            rf"warm_r\d+_{name}_kemari_started_s"
        )
        s[f"warm_stall_{size}_median_s"] = med(rf"warm_r\d+_{name}_stall_s")
        s[f"disk_stall_{size}_median_s"] = med(rf"disk_r\d+_{name}_stall_s")
        s[f"warm_clock_gap_{size}_median_s"] = med(rf"warm_r\d+_{name}_clock_gap_s")
        s[f"disk_clock_gap_{size}_median_s"] = med(rf"disk_r\d+_{name}_clock_gap_s")
    for part in ("freeze", "resume", "kemari_started"):
        s[f"warm_{part}_2g_over_512m"] = (
            s[f"warm_{part}_2g_median_s"] / s[f"warm_{part}_512m_median_s"]
        )
    for n in (1, 3, N_SMALL):
        s[f"vms{n}_freeze_all_median_s"] = med(rf"vms{n}_r\d+_freeze_all_s")
        s[f"vms{n}_resume_all_median_s"] = med(rf"vms{n}_r\d+_resume_all_s")
        s[f"vms{n}_clock_gap_max_s"] = worst(rf"vms{n}_r\d+_s\d_clock_gap_s")
        s[f"vms{n}_stall_max_s"] = worst(rf"vms{n}_r\d+_s\d_stall_s")
    if "kexec_freeze_all_s" in times:
        s["kexec_clock_gap_max_s"] = worst(r"kexec_\w+_clock_gap_s")
        s["kexec_stall_max_s"] = worst(r"kexec_\w+_stall_s")
    if any(k.startswith("cold_") for k in times):
        # The paper's headline: warm service downtime vs rebooting the
        # guests with the host, the same guests and host in one run.
        # Service downtime: the operator's first step (freeze, or the
        # poweroff request) until a new request is answered, the same probe
        # both ways; and the stall of a connection held open across it,
        # which adds the client's TCP retransmission back-off.
        s["cold_service_downtime_max_s"] = worst(r"cold_\w+_serving_again_s")
        s["warm_service_downtime_max_s"] = worst(r"kexec_\w+_serving_again_s")
        s["warm_over_cold_downtime"] = s["warm_service_downtime_max_s"] / s["cold_service_downtime_max_s"]
        s["warm_stall_over_cold_downtime"] = s["kexec_stall_max_s"] / s["cold_service_downtime_max_s"]
    return s
