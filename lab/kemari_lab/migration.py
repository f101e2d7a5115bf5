"""Live migration of a kemari guest between virtual hosts (docs/migration-protocol.md).

    install_key(lab.hosts)                  # the same pre-shared key on each host
    report = live_migrate(guest, lab.hosts[1])

On the destination the harness creates the guest's TAP in br0 and starts
``kemari --incoming <dest ip>:7777 --migration-key-file … --net tap=<tap>``
(console in the same /tmp/<name>.console there, API on the same socket path);
on the source it runs ``kemarictl migrate --to <dest ip>:7777``, which blocks
until the migration is committed and prints the report. Migration traffic
crosses the lab bridge (vh0's eth0 → klbr → vh1's eth0). The guest's disk must
be shared (``GuestSpec.disk_url``): kemari reopens disks by name on the
destination.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterable
from typing import Any

from kemari_lab.errors import LabError
from kemari_lab.guests import EXIT_RE, Guest, vmm_log
from kemari_lab.vhost import VirtualHost

MIGRATION_PORT = 7777
KEY_PATH = "/tmp/klab-migration.key"
# KEMARI_LAB_PLAINTEXT_LINK=1: both ends with --plaintext-link (authenticated,
# not encrypted), to tell the cipher's cost on the virtual hosts' emulated CPUs.
PLAINTEXT = os.environ.get("KEMARI_LAB_PLAINTEXT_LINK") == "1"


def install_key(hosts: Iterable[VirtualHost]) -> None:
    """Writes one fresh random pre-shared key to KEY_PATH on every host."""
    key = secrets.token_hex(32)
    for h in hosts:
        h.run(f"umask 077; echo {key} > {KEY_PATH}")


def listening(host: VirtualHost, port: int) -> bool:
    """Whether something listens on TCP `port` on `host`."""
    # /proc/net/tcp rather than a probe connection: kemari --incoming (and
    # --ft-standby) accepts exactly one connection, which must be the peer's.
    out = host.run("cat /proc/net/tcp", timeout=30).output
    return any(f":{port:04X} 00000000:0000 0A" in line for line in out.splitlines())


def wait_listening(guest: Guest, host: VirtualHost, port: int, what: str, timeout: float) -> None:
    """Waits until the kemari `guest` launched on `host` listens on `port`;
    fails at once if it exited first. `what` names it in errors."""
    deadline = time.monotonic() + timeout
    while not listening(host, port):
        console = host.run(f"cat {guest.console}", timeout=30).output
        if EXIT_RE.search(console):
            raise LabError(f"{host.name}: {what} exited before listening:\n{console[-2000:]}")
        if time.monotonic() > deadline:
            raise LabError(f"{host.name}: {what} not listening on port {port} after {timeout:.0f}s")
        time.sleep(0.5)


def start_incoming(guest: Guest, dest: VirtualHost, port: int = MIGRATION_PORT, timeout: float = 30) -> None:
    """Starts a kemari on `dest` waiting for `guest` and returns once it listens."""
    s = guest.spec
    if s.vmm != "kemari":
        raise LabError(f"live migration needs a kemari guest, not {s.vmm}")
    if s.disk and not s.disk_url:
        raise LabError(
            f"guest {s.name} has a private disk copy on {guest.host.name}: "
            "a migrated guest needs a shared disk (GuestSpec.disk_url)"
        )
    guest.add_tap(dest)
    cmd = (
        f"kemari --incoming {dest.ip}:{port} --migration-key-file {KEY_PATH} --serial stdout"
        f" --api-socket {s.api_socket}"
    )
    if PLAINTEXT:
        cmd += " --plaintext-link"
    if s.net:
        cmd += f" --net tap={s.tap}"
    guest.launch(dest, cmd + s.log_args)
    wait_listening(guest, dest, port, "kemari --incoming", timeout)


def live_migrate(
    guest: Guest,
    dest: VirtualHost,
    port: int = MIGRATION_PORT,
    max_downtime_ms: int | None = None,
    max_rounds: int | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Moves `guest` to `dest` by pre-copy live migration; returns kemari's
    report (downtime_ms, total_ms, bytes_sent, pages_sent, round, stop_reason,
    rate_mb_s …) plus ``wall_s`` as the harness saw it and, if the guest logs
    at info level, the source's ``final_pages`` and the destination's
    ``restore_ms`` (from kemari's "live migration committed" log line). Checks that the source
    kemari exited 0 and that the destination's answers ``kemarictl info`` as
    running; afterwards ``guest.host`` is `dest`."""
    source = guest.host
    if dest is source:
        raise LabError(f"{source.name}: cannot migrate guest {guest.spec.name} to its own host")
    start_incoming(guest, dest, port)
    args = f"migrate --to {dest.ip}:{port} --key-file {KEY_PATH}"
    if PLAINTEXT:
        args += " --plaintext-link"
    if max_downtime_ms is not None:
        args += f" --max-downtime-ms {max_downtime_ms}"
    if max_rounds is not None:
        args += f" --max-rounds {max_rounds}"
    t0 = time.monotonic()
    try:
        report = guest.ctl(args, timeout=timeout)
    except LabError as e:
        dest_console = dest.run(f"cat {guest.console}", timeout=30, check=False).output
        raise LabError(f"{e}\ndestination {dest.name} console:\n{dest_console[-2000:]}") from None
    report["wall_s"] = time.monotonic() - t0
    if report.get("status") != "completed" or report.get("downtime_ms") is None:
        raise LabError(f"{source.name}: migration of {guest.spec.name} did not complete: {report}")
    status = guest.wait_exit(timeout=60)  # the source kemari; keeps its console in the run dir
    if status != 0:
        raise LabError(f"{source.name}: kemari exited with status {status} after migrating out")
    source_console = guest.console_text()
    for event in vmm_log(source_console, "live migration committed"):
        report.update({k: event["fields"][k] for k in ("final_pages", "restore_ms") if k in event["fields"]})
    guest.host = dest
    if os.environ.get("KEMARI_LAB_MEMORY_DIGEST") == "1":
        report["digest_mismatch_chunks"] = compare_digests(guest, source_console, guest.console_text())
    info = guest.info()
    if info.get("state") != "running":
        raise LabError(f"{dest.name}: the migrated guest is not running: {info}")
    return report


def last_digests(console: str, side: str) -> list[str] | None:
    """The chunk digests of kemari's last `memory digest` line of `side`."""
    found = None
    for event in vmm_log(console, "memory digest"):
        if event["fields"].get("side") == side:
            found = str(event["fields"].get("digests", "")).split(",")
    # Plain-text logs (no --log-json): `memory digest side="source" … digests="…"`.
    for m in re.finditer(r'memory digest side="(\w+)".*?digests="([0-9a-f,]+)"', console):
        if m.group(1) == side:
            found = m.group(2).split(",")
    return found


def compare_digests(guest: Guest, source_console: str, dest_console: str) -> int:
    """Compares the two ends' memory digests of the last migration (logged
    with KEMARI_DEBUG_MEMORY_DIGEST=1); logs and returns how many 2 MiB chunks
    differ (-1 when a side logged none)."""
    from kemari_lab import images

    src, dst = last_digests(source_console, "source"), last_digests(dest_console, "destination")
    if src is None or dst is None or len(src) != len(dst):
        images.log(f"{guest.spec.name}: memory digests missing (source {src is not None}, destination {dst is not None})")
        return -1
    differ = [i for i, (a, b) in enumerate(zip(src, dst)) if a != b]
    images.log(
        f"{guest.spec.name}: memory digests of {len(src)} chunks of 2 MiB: "
        + (f"{len(differ)} DIFFER at MiB {[i * 2 for i in differ][:32]}" if differ else "all equal")
    )
    return len(differ)
