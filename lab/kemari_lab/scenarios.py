"""Lab scenarios: each takes a started :class:`Lab` and returns measurements.

A scenario raises :class:`LabError` (naming the host and the step) on failure.
To add one, write a function here taking ``(lab, vmm)`` and add it to
``SCENARIOS`` with the number of virtual hosts it needs (see docs/lab.md).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kemari_lab import images, warm_bench, warm_cache
from kemari_lab.connection import LongConnection
from kemari_lab.errors import LabError, step
from kemari_lab.exit_rates import exit_rates
from kemari_lab.fault_tolerance import (
    FenceService,
    ft_status,
    log_status,
    protect,
    start_standby,
    wait_ft_state,
)
from kemari_lab.fleet import fleet
from kemari_lab.guests import BOOTED_RE, Guest, GuestSpec, check_memory
from kemari_lab.kernel_nbd import kernel_nbd
from kemari_lab.lab import Lab
from kemari_lab.roaming import roaming_guest
from kemari_lab.soak import DiskWriter, soak
from kemari_lab.soak_rounds import soak_round
from kemari_lab.vhost import VirtualHost
from kemari_lab.warm_reboot import WarmHost, guest_clock
from kemari_lab.warm_reboot import lab_options as warm_lab_options


@dataclass
class Scenario:
    """A named scenario and how many virtual hosts it needs."""

    name: str
    hosts: int
    run: Callable[[Lab, str], dict[str, float]]
    doc: str
    # More Lab(...) options (host memory, kernel command line, kexec media).
    lab_options: dict[str, Any] = field(default_factory=dict)


def _boot_checked_guest(lab: Lab, host_index: int, vmm: str) -> tuple[Guest, dict[str, float]]:
    """Starts a 2-vCPU 512 MiB guest and checks CPUs, memory, disk and network."""
    host = lab.hosts[host_index]
    guest = Guest(host, GuestSpec(name=f"{vmm}{host_index}", vmm=vmm, host_index=host_index))
    guest.start()
    try:
        console = guest.wait_ready()
    except LabError:
        # The reference QEMU's guest once reset before its first console line
        # (QEMU, run with -no-reboot, exited 0 with an empty console: nested
        # KVM on the virtual hosts' emulated AMD-V). It gets one more start,
        # logged; kemari gets none: an early exit of ours is a failure.
        if vmm != "qemu" or not guest.exited_silently():
            raise
        images.log(f"{host.name}: QEMU exited 0 before guest {guest.spec.name} printed anything; starting it once more")
        host.run(f"/sbin/ip link del {guest.spec.tap} 2>/dev/null; true", check=False)
        guest.start()
        console = guest.wait_ready()
    guest.check_boot(console)
    return guest, {"guest_ready_s": guest.ready_seconds or 0.0}


def _power_off(lab: Lab, guest: Guest) -> dict[str, float]:
    """Asks the guest to power off (over HTTP from the client) and checks the VMM exits 0."""
    t0 = time.monotonic()
    lab.client_http_get(guest.spec.ip, "/cgi-bin/poweroff")
    status = guest.wait_exit()
    if status != 0:
        raise LabError(f"{guest.host.name}: {guest.spec.vmm} exited with status {status} after guest poweroff")
    return {"poweroff_s": time.monotonic() - t0}


def single_guest(lab: Lab, vmm: str) -> dict[str, float]:
    """One guest on vh0: disk, TCP from the client namespace, clean poweroff."""
    guest, times = _boot_checked_guest(lab, 0, vmm)
    body = lab.wait_client_reach(guest.spec.ip)
    if "kemari lab guest" not in body:
        raise LabError(f"client: unexpected page from the guest: {body!r}")
    times.update(_power_off(lab, guest))
    return times


def two_hosts(lab: Lab, vmm: str) -> dict[str, float]:
    """A guest on vh0 reachable from the client; vh1 reaches vh0 and the guest."""
    guest, times = _boot_checked_guest(lab, 0, vmm)
    lab.wait_client_reach(guest.spec.ip)
    a, b = lab.hosts[0], lab.hosts[1]
    b.run(f"ping -c 1 -W 5 {a.ip}", timeout=30)
    # busybox nc, not wget (this busybox's wget crashes).
    out = b.run(f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 10 {guest.spec.ip} 80", timeout=30).output
    if "kemari lab guest" not in out:
        raise LabError(f"{b.name}: unexpected page from the guest on {a.name}: {out!r}")
    times.update(_power_off(lab, guest))
    return times


def boot_poweroff(lab: Lab, vmm: str, action: str = "poweroff", vmm_args: str = "") -> dict[str, float]:
    """A device-less guest on vh0 (2 vCPUs, 512 MiB) boots to its init and
    powers itself off; the VMM must exit 0. The smallest test of a VMM's Linux
    boot (bzImage, ACPI, SMP, poweroff)."""
    host = lab.hosts[0]
    arg = "1" if action == "poweroff" else action
    marker = "KLAB-GUEST-POWEROFF" if action == "poweroff" else "KLAB-GUEST-REBOOT"
    guest = Guest(
        host,
        GuestSpec(
            name=f"{vmm}-{action}",
            vmm=vmm,
            disk=False,
            net=False,
            extra_cmdline=f"klab.poweroff={arg}",
            vmm_args=vmm_args,
        ),
    )
    guest.start()
    status = guest.wait_exit(timeout=300)
    console = guest.console_text()
    booted = BOOTED_RE.search(console)
    if booted is None:
        raise LabError(f"{host.name}: the guest never reached its init under {vmm}:\n{console[-3000:]}")
    if int(booted.group(1)) != guest.spec.vcpus:
        raise LabError(f"{host.name}: guest saw {booted.group(1)} CPUs, expected {guest.spec.vcpus}")
    check_memory(host.name, guest.spec.memory_mb, int(booted.group(2)))
    if marker not in console or status != 0:
        raise LabError(
            f"{host.name}: {vmm} exited with status {status} after the guest's {action} "
            f"(requested: {marker in console}):\n{console[-3000:]}"
        )
    return {"boot_to_exit_s": time.monotonic() - guest.started_at}


def boot_reboot(lab: Lab, vmm: str) -> dict[str, float]:
    """Like boot-poweroff, but the guest reboots (ACPI reset register, then
    i8042): kemari with --on-reboot exit ends the VM on a reset and exits 0,
    QEMU too (-no-reboot). (guest-reboots has kemari reboot it in place.)"""
    return boot_poweroff(lab, vmm, action="reboot", vmm_args="--on-reboot exit" if vmm == "kemari" else "")


GUEST_REBOOTS = 5
REBOOT_RE = re.compile(r"KLAB-GUEST-REBOOT lines=(\d+)")
FS_RE = re.compile(r"KLAB-FS (clean|dirty)[^\n]*")
RECORDS_RE = re.compile(r"KLAB-RECORDS lines=(\d+) bad=(\d+)")


# How long a request to a guest whose disk writer runs may take (connect included).
REBOOT_REQUEST_S = 60


def guest_reboots(lab: Lab, vmm: str) -> dict[str, float]:
    """A kemari guest on vh0 runs `reboot` 5 times while writing its disk (a
    writer appending synced records and rewriting a file with fsync): it
    comes back each time in the same kemari process (same pid, API answering,
    `reboots` counting), its ext4 cleanly unmounted (superblock clean, no
    journal to replay) with every record the writer synced, disk and network
    checked again; then it powers off and kemari exits 0."""
    if vmm != "kemari":
        raise LabError(f"guest-reboots reboots a guest inside its kemari (--vmm kemari), not {vmm}")
    guest, times = _boot_checked_guest(lab, 0, vmm)
    host, ip = guest.host, guest.spec.ip
    first = guest.info()
    pid = first["pid"]
    for boot in range(1, GUEST_REBOOTS + 1):
        with step(f"reboot {boot} of {GUEST_REBOOTS}"):
            # A guest whose writer syncs on a loaded TCG host may take more
            # than the default 10 s to accept a connection (seen in CI: the
            # reboot request's connect timed out; it passed when re-run on a
            # quiet host): these requests are about the reboot, not latency.
            try:
                if "writer started" not in lab.client_http_get(ip, "/cgi-bin/writer", timeout=REBOOT_REQUEST_S):
                    raise LabError(f"{host.name}: the guest's disk writer did not start")
                time.sleep(3)  # under load: the writer syncs records meanwhile
                t0 = time.monotonic()
                lab.client_http_get(ip, "/cgi-bin/reboot", timeout=REBOOT_REQUEST_S)
            except LabError as e:
                raise LabError(f"{e}\n{guest.diagnostics()}") from None
            deadline = t0 + 240
            while True:
                # The wait's deadline bounds each read too: a booting nested
                # guest can hold the virtual host's CPUs for tens of seconds.
                console = guest.console_text(timeout=max(60.0, deadline - time.monotonic()))
                if console.count("KLAB-GUEST-READY") > boot:
                    break
                if "KLAB-VMM-EXIT" in console or time.monotonic() > deadline:
                    raise LabError(
                        f"{host.name}: the guest did not come back from reboot {boot}:\n{console[-3000:]}\n"
                        f"{guest.diagnostics(console_chars=0)}"
                    )
                time.sleep(2)
            times[f"reboot_{boot}_to_ready_s"] = time.monotonic() - t0
            # This boot's part of the console: from the reboot on.
            before, _, after = console.rpartition("KLAB-GUEST-REBOOT")
            synced = REBOOT_RE.search("KLAB-GUEST-REBOOT" + after)
            if synced is None or "KLAB-UMOUNT-FAIL" in before[-2000:]:
                raise LabError(f"{host.name}: the guest's reboot {boot} did not stop its writer and unmount:\n{console[-3000:]}")
            fs = FS_RE.search(after)
            records = RECORDS_RE.search(after)
            if fs is None or fs.group(1) != "clean":
                raise LabError(f"{host.name}: after reboot {boot} the filesystem is not clean: {fs.group(0) if fs else 'no report'}")
            if records is None or records.group(1) != synced.group(1) or records.group(2) != "0":
                raise LabError(
                    f"{host.name}: after reboot {boot} the disk holds "
                    f"{records.group(0) if records else 'no records report'}, "
                    f"the writer had synced {synced.group(1)} records"
                )
            guest.check_boot(after)
            info = guest.info()
            if info.get("pid") != pid or info.get("reboots") != boot or info.get("state") != "running":
                raise LabError(f"{host.name}: after reboot {boot} kemari answers {info} (pid was {pid})")
            lab.wait_client_reach(ip)
            times[f"records_after_reboot_{boot}"] = float(records.group(1))
    times.update(_power_off(lab, guest))
    return times


def live_migration(lab: Lab, vmm: str) -> dict[str, float]:
    """A kemari guest (shared NBD disk) migrates live from vh0 to vh1 while the
    client keeps one TCP connection to it, byte-checked before, during and after;
    then vh0 loses power and the connection carries on."""
    if vmm != "kemari":
        raise LabError(f"live-migration is a kemari scenario (--vmm kemari), not {vmm}")
    with roaming_guest(lab, home=0) as rg:
        with step("before the migration"):
            rg.check_disk("before")
            before = rg.conn.expect_progress(20)
        with step("migrating vh0 -> vh1"):
            report = rg.migrate_to(1)
        images.log("migration report: " + json.dumps(report, sort_keys=True))
        with step("after the migration to vh1"):
            during = rg.conn.check()
            if during["exchanges"] <= before["exchanges"]:
                raise LabError(f"{rg.conn}: no echo verified while the guest was migrating ({during})")
            after = rg.conn.expect_progress(20)
            source = lab.hosts[0]
            still = source.run("pidof kemari", check=False)
            if still.ok:
                raise LabError(f"{source.name}: kemari still runs after migrating out (pids {still.output.strip()})")
        with step("after the power failure of vh0"):
            # Nothing of the guest is left on the source: cutting its power must
            # not disturb the connection (what a failover test does to a primary).
            source.power_fail()
            rg.conn.expect_progress(20)
            rg.check_disk("after")
        times = dict(rg.measures)
        times.update(
            migration_wall_s=report["wall_s"],
            migration_total_ms=float(report["total_ms"]),
            migration_downtime_ms=float(report["downtime_ms"]),
            migration_rounds=float(report["round"]),
            migration_mb=report["bytes_sent"] / 1e6,
            migration_rate_mb_s=float(report["rate_mb_s"]),
            migration_final_pages=float(report.get("final_pages", -1)),
            migration_restore_ms=float(report.get("restore_ms", -1)),
            client_echoes_during_migration=float(during["exchanges"] - before["exchanges"]),
            client_echoes_after_migration=float(after["exchanges"] - during["exchanges"]),
        )
        with step("closing the connection, powering off on vh1"):
            times.update(rg.finish())
    return times


def time_fence_command(host: VirtualHost, command: str, peer_ip: str) -> float:
    """Runs the standby's fence command once more on `host` (the primary is off
    by now: the answer is "already-off") and returns how long it took there, ms."""
    quoted = "'" + command.replace("'", "'\\''") + "'"
    # /proc/uptime: this busybox's date has no %N (10 ms resolution is enough).
    out = host.run(
        f"read a x < /proc/uptime; KEMARI_FT_PEER={peer_ip}:1 sh -c {quoted}; s=$?; read b x < /proc/uptime; echo $s $a $b"
    ).output.split()
    if len(out) != 3 or out[0] != "0":
        raise LabError(f"{host.name}: the fence command failed when run by hand: {out}")
    return (float(out[2]) - float(out[1])) * 1000


# The sync link's timeout for TCG virtual hosts: a sync (pause, capture, transfer,
# acknowledgement) takes tens of milliseconds there and a busy TCG vCPU can
# hold a thread for hundreds; 3 s keeps the primary from degrading spuriously.
FT_TIMEOUT_MS = 3000


def fault_tolerance(lab: Lab, vmm: str, failure: str = "power") -> dict[str, float]:
    """A kemari guest on vh0 (shared NBD disk) is protected by a standby on vh1;
    vh0 loses power while the client holds one TCP connection to the guest; the
    standby fences vh0 (the lab's power switch), fails over, and the same
    connection keeps echoing byte-exact; the disk still works.

    With ``failure="partition"`` vh0 keeps running but loses its network
    (``ip link set eth0 down``): the standby must power it off through the
    fence ("killed", not "already-off") before it runs the guest."""
    if vmm != "kemari":
        raise LabError(f"fault-tolerance is a kemari scenario (--vmm kemari), not {vmm}")
    primary, standby = lab.hosts[0], lab.hosts[1]
    with roaming_guest(lab, home=0) as rg, FenceService(lab) as fence:
        guest = rg.guest
        with step("before protection"):
            t = time.monotonic()
            rg.check_disk("before")
            disk_unprotected_s = time.monotonic() - t
            rg.conn.expect_progress(10)
        with step(f"starting the standby on {standby.name} and protecting the guest"):
            start_standby(guest, standby, fence_cmd=fence.command)
            unprotected_conn = rg.conn.check()
            report = protect(guest, standby, timeout_ms=FT_TIMEOUT_MS)
            log_status("primary after ft start", report)
        with step("under protection"):
            first = ft_status(guest)
            protected_conn = rg.conn.check()
            t = time.monotonic()
            rg.check_disk("protected")  # disk requests wait for the standby's acknowledgements
            disk_protected_s = time.monotonic() - t
            after_disk = ft_status(guest)
            disk_conn = rg.conn.check()
            rg.conn.expect_progress(30)
            p = ft_status(guest)
            s = ft_status(guest, standby)
            log_status(f"primary {primary.name}", p)
            log_status(f"standby {standby.name}", s)
            if p.get("state") != "protected" or p.get("role") != "primary":
                raise LabError(f"{primary.name}: the guest is not protected: {p}")
            if p["syncs"] <= first["syncs"] or p["epoch"] <= first["epoch"]:
                raise LabError(f"{primary.name}: no sync while the client echoed and the guest wrote: {first} -> {p}")
            if s.get("state") != "standby" or s.get("epoch", 0) < first["epoch"]:
                raise LabError(f"{standby.name}: the standby does not follow the primary: {s}")
            before_kill = rg.conn.check()
        with step(f"{failure} failure of the primary {primary.name}"):
            if failure == "power":
                killed_at = primary.power_fail()
                images.log(f"{primary.name} powered off (SIGKILL to its QEMU)")
            else:
                killed_at = time.monotonic()
                primary.run("/sbin/ip link set eth0 down")
                images.log(f"{primary.name} cut off the network (eth0 down); it runs on")
            guest.host = standby
            over = wait_ft_state(guest, standby, {"failed_over"}, timeout=FT_TIMEOUT_MS / 1000 + 60)
            log_status(f"standby {standby.name} after the failover", over)
            seen_failed_over_s = over["seen_at"] - killed_at
            after = rg.conn.expect_progress(20, timeout=120)
            info = guest.info()
            if info.get("state") != "running":
                raise LabError(f"{standby.name}: the failed-over guest is not running: {info}")
            fenced = fence.events()
            action = "already-off" if failure == "power" else "killed"
            if len(fenced) != 1 or fenced[0].get("action") != action or not str(
                fenced[0].get("peer", "")
            ).startswith(primary.ip + ":"):
                raise LabError(f"fence requests: expected one for {primary.ip} ({action}), got {fenced}")
            if primary.alive():
                raise LabError(f"{primary.name}: still running after the standby fenced it")
            primary.kill()  # forgets the fenced host (its console stays logged)
            t = time.monotonic()
            rg.check_disk("after")
            disk_after_failover_s = time.monotonic() - t
            fence_cmd_ms = time_fence_command(standby, fence.command, primary.ip)

        def gap_in(start_s: float, end_s: float) -> float:
            return float(rg.conn.max_gap_in(after, start_s, end_s))

        times = dict(rg.measures)
        times.update(
            ft_start_wall_s=report["wall_s"],
            ft_initial_sync_ms=float(report.get("initial_sync_ms") or -1),
            ft_initial_link_mb=report.get("link_bytes", 0) / 1e6,
            ft_syncs=float(p["syncs"]),
            ft_epoch_at_kill=float(p["epoch"]),
            ft_syncs_per_s=float(p["syncs_per_s"]),
            ft_pages_per_sync=float(p["pages_per_sync"]),
            ft_kb_per_sync=p["bytes_per_sync"] / 1e3,
            ft_pause_ms_p50=p["pause_us_p50"] / 1e3,
            ft_pause_ms_p99=p["pause_us_p99"] / 1e3,
            ft_sync_ms_p50=p["sync_us_p50"] / 1e3,
            ft_sync_ms_p99=p["sync_us_p99"] / 1e3,
            # The guest writing, syncing and re-reading a token (GET /cgi-bin/disk),
            # without and with protection: each disk request waits for one sync.
            disk_write_unprotected_s=disk_unprotected_s,
            disk_write_protected_s=disk_protected_s,
            disk_write_protected_syncs=float(after_disk["syncs"] - first["syncs"]),
            disk_write_protected_outputs=float(after_disk["outputs"] - first["outputs"]),
            disk_write_after_failover_s=disk_after_failover_s,
            ft_standby_epoch=float(s["epoch"]),
            ft_failover_epoch=float(over["epoch"]),
            ft_failover_ms=float(over.get("failover_ms") or -1),  # kemari: primary declared lost -> VM running
            ft_kill_to_fence_s=fenced[0]["t"] - killed_at,
            ft_fence_cmd_ms=fence_cmd_ms,
            ft_kill_to_failed_over_seen_s=seen_failed_over_s,
            client_echoes_protected=float(before_kill["exchanges"] - protected_conn["exchanges"]),
            # The client's longest wait for an echo in each phase (gaps over 1 s):
            # while ft start copied the guest, under protection, across the failover.
            client_max_gap_unprotected_s=gap_in(0, unprotected_conn["elapsed_s"]),
            client_max_gap_ft_start_s=gap_in(unprotected_conn["elapsed_s"], protected_conn["elapsed_s"]),
            client_max_gap_protected_disk_s=gap_in(protected_conn["elapsed_s"], disk_conn["elapsed_s"]),
            client_max_gap_protected_echo_s=gap_in(disk_conn["elapsed_s"], before_kill["elapsed_s"]),
            client_failover_gap_s=gap_in(before_kill["elapsed_s"], after["elapsed_s"]),
            client_echoes_after_failover=float(after["exchanges"] - before_kill["exchanges"]),
        )
        if over.get("failovers") != 1:
            raise LabError(f"{standby.name}: expected one failover, status {over}")
        with step(f"closing the connection, powering off on {standby.name}"):
            times.update(rg.finish())
    return times


def fault_tolerance_partition(lab: Lab, vmm: str) -> dict[str, float]:
    """Like fault-tolerance, but vh0 only loses its network; the standby powers
    it off through the fence before taking over (never two copies)."""
    return fault_tolerance(lab, vmm, failure="partition")


# The CI scenario hashes 1 MiB of every 16 of the guest's memory before and
# after the kexec (all of it took 2 min per hash on TCG; a full hash was
# equal in the runs of 2026-11-26, docs/warm-reboot.md).
CHECKSUM_SAMPLE_MB = 16
RECORDS_NOW_RE = re.compile(r"KLAB-RECORDS-NOW lines=(\d+) synced=(\d+) bad=(\d+)")


def host_warm_reboot(lab: Lab, vmm: str) -> dict[str, float]:
    """vh0 kexecs into its kernel while a kemari guest's memory stays in
    persistent memory (memmap=…!…, ext4 -o dax): the guest is frozen
    (warm restart), its memory checksummed, the host kexecs, the memory is
    checked unchanged and the guest resumed; its client TCP connection
    (byte-checked echoes) survives, no synced record or acknowledged disk
    write is lost; guest clock gap and client stalls measured"""
    if vmm != "kemari":
        raise LabError(f"host-warm-reboot freezes kemari guests (--vmm kemari), not {vmm}")
    wh = WarmHost(lab.hosts[0])
    with step("preparing the persistent-memory region"):
        wh.prepare()
    guest = wh.start(wh.spec("warm0", 0, 512))
    wh.load_in_background()  # the next kernel, while the guest boots
    console = guest.wait_ready()
    guest.check_boot(console)
    times: dict[str, float] = {"guest_ready_s": guest.ready_seconds or 0.0}
    ip = guest.spec.ip
    conn = LongConnection(lab, ip, stall_limit=300).open()
    disk = None
    try:
        conn.expect_progress(10)
        if "writer started" not in lab.client_http_get(ip, "/cgi-bin/writer"):
            raise LabError(f"{guest.host.name}: the guest's disk writer did not start")
        disk = DiskWriter(lab, ip, interval=0.5, stall_limit=300)
        wh.wait_loaded()
        before_clock = guest_clock(lab, ip)
        before = conn.check()
        t0 = time.monotonic()
        with step("freezing"):
            times.update(wh.freeze())
        t_frozen = time.monotonic()
        with step("checksumming the frozen memory"):
            sums = wh.checksums(CHECKSUM_SAMPLE_MB)
        t_sums = time.monotonic()
        with step("kexec"):
            times["kexec_to_host_ready_s"] = wh.kexec()
        with step("after the kexec"):
            t_mount = time.monotonic()
            wh.mount()
            after_sums = wh.checksums(CHECKSUM_SAMPLE_MB)
            if after_sums != sums:
                raise LabError(f"{guest.host.name}: guest memory changed across the kexec: {sums} -> {after_sums}")
            times["checksum_s"] = (t_sums - t_frozen) + (time.monotonic() - t_mount)
            times.update(wh.resume())
        t_resumed = time.monotonic()
        times["freeze_to_resumed_s"] = t_resumed - t0
        times["downtime_without_checksums_s"] = times["freeze_to_resumed_s"] - times["checksum_s"]
        with step("after the resume"):
            conn.expect_progress(20, timeout=300)
            after = conn.check()
            times["client_echo_stall_s"] = LongConnection.max_gap_in(after, before["elapsed_s"], after["elapsed_s"])
            after_clock = guest_clock(lab, ip)
            real = after_clock[0] - before_clock[0]
            times["guest_uptime_behind_s"] = real - (after_clock[1] - before_clock[1])
            times["guest_realtime_behind_s"] = real - (after_clock[2] - before_clock[2])
            # Two more writes acknowledged after the resume.
            acks_at_resume = int(disk.stats()["acks"])
            deadline = time.monotonic() + 120
            while int(disk.stats()["acks"]) < acks_at_resume + 2 and time.monotonic() < deadline:
                time.sleep(1)
            ds = disk.stats()  # (stop() reports the client's own exit as an error)
            disk.stop()
            disk = None
            if ds.get("error"):
                raise LabError(f"client disk writes to {ip} failed: {ds['error']}")
            times["client_disk_acks"] = float(ds["acks"])
            times["client_disk_stall_s"] = float(ds["max_ack_gap_s"])
            # A new connection from the client: its ARP entry for the guest
            # may have lapsed while the virtual host stalled (seen in CI:
            # "No route to host" right after the disk writer's last request);
            # reach the guest first, then ask.
            try:
                lab.wait_client_reach(ip, timeout=120)
                body = lab.client_http_get(ip, "/cgi-bin/records", timeout=60)
            except LabError as e:
                raise LabError(f"{e}\n{guest.diagnostics()}") from None
            rec = RECORDS_NOW_RE.search(body)
            if rec is None or rec.group(1) != rec.group(2) or rec.group(3) != "0" or int(rec.group(2)) == 0:
                raise LabError(f"{guest.host.name}: the guest's record log after the host's kexec: {body.strip()!r}")
            times["records_synced"] = float(rec.group(2))
            info = guest.info()
            if info.get("state") != "running":
                raise LabError(f"{guest.host.name}: the resumed kemari answers {info}")
        final = conn.close()
        times["client_echoes"] = float(final["exchanges"])
    finally:
        if disk is not None:
            disk.stop()
        conn.abort()
    t_off = time.monotonic()
    lab.client_http_get(ip, "/cgi-bin/poweroff")
    guest.host.wait_file_match(guest.console, re.compile(r"KEMARI-EXIT=(\d+)"), 120, "the resumed kemari to exit")
    status = guest.host.run(f"grep -o 'KEMARI-EXIT=[0-9]*' {guest.console}").output.strip()
    if status != "KEMARI-EXIT=0":
        raise LabError(f"{guest.host.name}: the resumed kemari ended with {status} after the guest's poweroff")
    times["poweroff_s"] = time.monotonic() - t_off
    return times


# Three virtual hosts at once (docs/fleet.md): 2.5 GiB each.
FLEET_HOST_MB = 2560

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("single-guest", 1, single_guest, single_guest.__doc__ or ""),
        Scenario("two-hosts", 2, two_hosts, two_hosts.__doc__ or ""),
        Scenario("boot-poweroff", 1, boot_poweroff, (boot_poweroff.__doc__ or "").split(".")[0]),
        Scenario("boot-reboot", 1, boot_reboot, (boot_reboot.__doc__ or "").split(":")[0]),
        Scenario("guest-reboots", 1, guest_reboots, (guest_reboots.__doc__ or "").split(":")[0]),
        Scenario("live-migration", 2, live_migration, (live_migration.__doc__ or "").split(",")[0]),
        Scenario("fault-tolerance", 2, fault_tolerance, (fault_tolerance.__doc__ or "").split(";")[0]),
        Scenario(
            "fault-tolerance-partition",
            2,
            fault_tolerance_partition,
            (fault_tolerance_partition.__doc__ or "").split(";")[0],
        ),
        Scenario("fleet", 3, fleet, (fleet.__doc__ or "").split(":")[0], {"host_memory_mb": FLEET_HOST_MB}),
        Scenario("kernel-nbd", 1, kernel_nbd, (kernel_nbd.__doc__ or "").split(":")[0]),
        Scenario(
            "host-warm-reboot",
            1,
            host_warm_reboot,
            (host_warm_reboot.__doc__ or "").split(":")[0],
            warm_lab_options(region_gib=1),
        ),
        Scenario(
            "host-warm-reboot-bench",
            1,
            warm_bench.bench,
            (warm_bench.bench.__doc__ or "").split(",")[0],
            warm_bench.lab_options(),
        ),
        Scenario(
            "warm-cache-bench",
            1,
            warm_cache.bench,
            (warm_cache.bench.__doc__ or "").split(":")[0],
            warm_cache.lab_options(),
        ),
        Scenario("soak", 2, soak, "kemari and qemu-microvm guests side by side under load; crashes per VMM"),
        Scenario(
            "exit-rates",
            1,
            exit_rates,
            "KVM exits per second of kemari's, QEMU pc's and QEMU microvm's guests under the soak's load",
        ),
        Scenario(
            "soak-moves",
            2,
            soak_round,
            "one round of the soak after live migrations and an FT failover (kemari vs QEMU); rounds add up",
        ),
    )
}
