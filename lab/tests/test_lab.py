"""Acceptance: real Linux guests inside virtual hosts, under QEMU and kemari.

Each test boots its own lab and runs a scenario from kemari_lab.scenarios;
the measured times are printed (run pytest with -s to see them).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from kemari_lab import images, paths
from kemari_lab.errors import LabError
from kemari_lab.lab import Lab
from kemari_lab.platform_reset import platform_fault_in
from kemari_lab.scenarios import FT_TIMEOUT_MS, SCENARIOS


def kemari_boots_bzimage() -> bool:
    """True once the VMM core calls the bzImage loader (vmm::boot::bzimage::load)."""
    loader = paths.REPO_DIR / "crates" / "vmm" / "src" / "boot" / "bzimage.rs"
    for src in (paths.REPO_DIR / "crates").rglob("*.rs"):
        if src != loader and "bzimage::load(" in src.read_text(errors="replace"):
            return True
    return False


def kemari_skip_reason() -> str | None:
    """Why the kemari scenario cannot run yet, or None."""
    if not images.kemari_binaries():
        return "no kemari binary: run lab/setup.sh --kemari (cargo build --release -p kemari)"
    if os.environ.get("KLAB_FORCE_KEMARI") == "1":
        return None
    if not kemari_boots_bzimage():
        return (
            "kemari cannot boot a bzImage yet: nothing in crates/ calls vmm::boot::bzimage::load "
            "(KLAB_FORCE_KEMARI=1 tries anyway)"
        )
    return None


# Runs of a scenario at most, while each fails on the platform. Two were
# not enough in CI on 2026-11-27: guest-reboots lost its virtual host (the
# guest silent on ARP, the host's shell silent for minutes) in two runs in a
# row, and passed 4 of 4 runs outside CI that hour.
ATTEMPTS = 3


def run_scenario(name: str, vmm: str) -> dict[str, float]:
    """Runs scenario `name` in a fresh lab; again (said loudly), up to
    ATTEMPTS runs in all, while each run failed on a fault of the virtual
    hosts (a guest reset, a dead, locked-up or silent host: see
    kemari_lab/platform_reset.py), never for anything else."""
    sc = SCENARIOS[name]
    for attempt in range(1, ATTEMPTS + 1):
        lab = Lab(hosts=sc.hosts, **sc.lab_options)
        try:
            with lab:
                times = {f"{vh.name}_boot_s": vh.boot_seconds or 0.0 for vh in lab.hosts}
                times.update(sc.run(lab, vmm))
        except LabError as e:
            fault = platform_fault_in(lab.run_dir, str(e))
            if attempt == ATTEMPTS or fault is None:
                raise
            message = (
                f"{name} with {vmm} failed ({e}) on a fault of the virtual hosts: {fault}; "
                f"run {attempt + 1} of at most {ATTEMPTS} (consoles in {lab.run_dir}; docs/lab.md, 'Soak')"
            )
            print(f"\nLAB RETRY: {message}", file=sys.stderr)
            warnings.warn(message, stacklevel=1)
            continue
        print(f"\n{name} with {vmm}: " + ", ".join(f"{k}={v:.1f}" for k, v in times.items()))
        return times
    raise AssertionError("unreachable")


def test_two_hosts_with_qemu_guest(lab_images: images.Images) -> None:
    """QEMU -enable-kvm in virtual host A runs the guest: 2 vCPUs, 512 MiB, ext4
    disk written and read, reachable from the client over TCP, and from virtual
    host B; it powers off and QEMU exits 0."""
    run_scenario("two-hosts", "qemu")


def test_single_guest_with_kemari(lab_images: images.Images) -> None:
    """The acceptance scenario with kemari as the VMM."""
    reason = kemari_skip_reason()
    if reason:
        pytest.skip(reason)
    if not lab_images.has_kemari:
        pytest.skip("kemari is not in the virtual host image: run lab/setup.sh --kemari")
    run_scenario("single-guest", "kemari")


def test_guest_reboots_in_place_under_kemari(lab_images: images.Images) -> None:
    """Issue #26 (item 1): the Debian guest under kemari runs `reboot` 5 times
    while a writer syncs records to its ext4 disk; it comes back each time
    in the same kemari process (pid, API, `reboots` counting), its
    filesystem cleanly unmounted (superblock clean, no journal to replay)
    holding every synced record, disk and network checked again; then it
    powers off and kemari exits 0."""
    reason = kemari_skip_reason()
    if reason:
        pytest.skip(reason)
    names = {p.name for p in images.kemari_binaries()}
    if not lab_images.has_kemari or "kemarictl" not in names:
        pytest.skip("kemari/kemarictl are not in the virtual host image: run lab/setup.sh --kemari")
    times = run_scenario("guest-reboots", "kemari")
    assert all(times[f"records_after_reboot_{b}"] > 0 for b in range(1, 6))


def test_host_warm_reboot_keeps_a_guest_through_a_kexec(lab_images: images.Images) -> None:
    """Issue #26 (item 2): the virtual host kexecs into its kernel while a
    kemari guest's memory stays in persistent memory (memmap=…!…, ext4 -o
    dax): frozen (warm restart), memory checksummed before and after the
    kexec (equal), resumed; the client's byte-checked TCP connection
    survives, the guest's synced records and the client's acknowledged disk
    writes are all there; the resumed kemari exits 0 at the guest's poweroff."""
    reason = kemari_skip_reason()
    if reason:
        pytest.skip(reason)
    names = {p.name for p in images.kemari_binaries()}
    if not lab_images.has_kemari or "kemarictl" not in names:
        pytest.skip("kemari/kemarictl are not in the virtual host image: run lab/setup.sh --kemari")
    times = run_scenario("host-warm-reboot", "kemari")
    assert times["records_synced"] > 0 and times["client_disk_acks"] > 0 and times["client_echoes"] > 30


def kemari_roaming_skip_reason(lab_images: images.Images) -> str | None:
    """Why a scenario whose kemari guest changes hosts cannot run, or None."""
    reason = kemari_skip_reason()
    if reason:
        return reason
    names = {p.name for p in images.kemari_binaries()}
    if not lab_images.has_kemari or "kemarictl" not in names:
        return "kemari/kemarictl are not in the virtual host image: run lab/setup.sh --kemari"
    if images.kemari_nbd_binary() is None:
        return "no kemari-nbd binary for the shared disk: run lab/setup.sh --kemari"
    return None


def test_live_migration_keeps_client_connection(lab_images: images.Images) -> None:
    """Issue #6: a Debian guest under kemari migrates live from virtual host A
    to B while a client in the client namespace keeps one TCP connection open
    to it. The disk is shared (NBD export from the lab namespace). Checked: the
    connection's echoes are byte-exact before, during and after the move; the
    guest writes its disk after it; kemari on A has exited, kemari on B
    answers `kemarictl info` as running; the migration report (downtime,
    total, bytes, rounds) is printed."""
    reason = kemari_roaming_skip_reason(lab_images)
    if reason:
        pytest.skip(reason)
    times = run_scenario("live-migration", "kemari")
    assert times["migration_rounds"] >= 2  # at least one full copy and a final round
    assert times["client_echoes_during_migration"] > 0 and times["client_echoes_after_migration"] >= 20


def test_fault_tolerance_survives_primary_power_failure(lab_images: images.Images) -> None:
    """Issue #7: a Debian guest under kemari on virtual host A (shared NBD
    disk) is protected by a standby on B (`kemari --ft-standby`, `kemarictl ft
    start`); A loses power (SIGKILL of its QEMU) while a client in the client
    namespace holds one TCP connection to the guest. Checked: syncs happen
    and the epoch grows under protection (client echoes, a disk write); B
    fences A through the lab's power switch (--ft-fence-cmd), fails over
    within the sync timeout plus a few seconds, and the *same* connection
    keeps echoing byte-exact; the guest writes its disk on B and powers off
    there, and the image holds what it wrote."""
    reason = kemari_roaming_skip_reason(lab_images)
    if reason:
        pytest.skip(reason)
    times = run_scenario("fault-tolerance", "kemari")
    assert times["ft_syncs"] > 0 and times["ft_epoch_at_kill"] > 1
    assert times["client_echoes_protected"] >= 30 and times["client_echoes_after_failover"] >= 20
    # The standby notices within the timeout; fencing and restoring add a little
    # (the margin covers TCG and polling kemarictl through the console).
    assert times["ft_kill_to_fence_s"] < FT_TIMEOUT_MS / 1000 + 5
    assert times["ft_kill_to_failed_over_seen_s"] < FT_TIMEOUT_MS / 1000 + 10


def test_fault_tolerance_partition_fences_the_primary(lab_images: images.Images) -> None:
    """The split-brain case: virtual host A keeps running but loses its network
    (eth0 down). The standby on B must not run a second copy while A lives: its
    --ft-fence-cmd asks the lab's power switch, which powers A off ("killed"),
    and only then does B fail over; the client connection survives as above.
    Adds ~2 min: runs with KLAB_SLOW=1."""
    reason = kemari_roaming_skip_reason(lab_images)
    if reason:
        pytest.skip(reason)
    if os.environ.get("KLAB_SLOW") != "1":
        pytest.skip("the partition variant of the fault-tolerance scenario adds ~2 min: KLAB_SLOW=1 runs it")
    times = run_scenario("fault-tolerance-partition", "kemari")
    assert times["client_echoes_after_failover"] >= 20


def test_kernel_nbd_client_against_target_and_proxy(lab_images: images.Images) -> None:
    """Issue #8: the Linux kernel's NBD client (nbd-client and the nbd module
    in virtual host vh0) against `kemari-nbd serve` and against a `kemari-nbd
    proxy` in front of a target, both in the lab namespace. For each: the
    device has the export's size to the byte; writes through the page cache
    and with O_DIRECT (inside a 4 KiB block, across 16 MiB, the last block)
    read back with the pattern's checksums; and on this machine the image — the
    target's file, the proxy's cache after cut-over — holds exactly those bytes
    and the original ones elsewhere; the proxy's upstream image is unchanged.
    Then ext4 mounted through a proxy mid-copy: written, unmounted, and found
    clean (e2fsck) with the written files in the proxy's cache after cut-over."""
    if images.kemari_nbd_binary() is None:
        pytest.skip("no kemari-nbd binary: run lab/setup.sh --kemari")
    times = run_scenario("kernel-nbd", "none")
    assert times["proxy_ondemand_mb"] > 0
