"""A guest that may run on any virtual host: shared disk, one long-lived client connection.

The common ground of the scenarios in which a guest changes hosts — live
live migration, failover to a standby (kemari_lab/fault_tolerance.py)::

    with roaming_guest(lab, home=0) as rg:     # kemari guest on vh0, disk on NBD,
        rg.check_disk("before")                #   client connection open
        report = rg.migrate_to(1)              # live migration vh0 -> vh1
        rg.conn.expect_progress(20)            # the same connection still echoes
        rg.check_disk("after")
        measures = rg.finish()                 # poweroff where it runs, final checks

What it sets up:

- the shared disk (kemari_lab/shared_disk.py): the guest's ext4 image served
  by kemari-nbd in the lab namespace, opened by kemari as ``--disk nbd://…``
  on whichever host runs the guest;
- the same random migration key on every virtual host (kemari_lab/migration.py);
- a kemari guest on the ``home`` host with an API socket, its boot report
  checked (CPUs, memory, disk, network);
- :class:`LongConnection`: one TCP connection from the client namespace to
  the guest's echo service, byte-checked, kept open until :meth:`finish`.

The fault-tolerance scenario uses the same pieces: the standby's TAP on
vh1 (``start_standby`` calls ``guest.add_tap``, like ``rg.prepare(1)``),
``lab.hosts[0].power_fail()`` as the power failure (SIGKILL to the virtual
host's QEMU), and ``rg.conn`` must keep echoing.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kemari_lab import images
from kemari_lab.connection import LongConnection
from kemari_lab.errors import LabError, step
from kemari_lab.guests import Guest, GuestSpec
from kemari_lab.lab import Lab
from kemari_lab.migration import install_key, live_migrate
from kemari_lab.shared_disk import SharedDisk
from kemari_lab.vhost import VirtualHost

TOKEN_FILE = "/klab-token.txt"  # written by the guest's /cgi-bin/disk


@dataclass
class RoamingGuest:
    """A running kemari guest with a shared disk and an open client connection."""

    lab: Lab
    disk: SharedDisk
    guest: Guest
    conn: LongConnection
    # The last token the guest wrote to its disk through /cgi-bin/disk.
    last_token: str | None = None
    measures: dict[str, float] = field(default_factory=dict)

    @property
    def host(self) -> VirtualHost:
        """Where the guest runs now."""
        return self.guest.host

    def prepare(self, index: int) -> VirtualHost:
        """Makes virtual host `index` ready to run the guest (its TAP in br0)."""
        host = self.lab.hosts[index]
        self.guest.add_tap(host)
        return host

    def migrate_to(self, index: int, **limits: int) -> dict[str, Any]:
        """Live-migrates the guest to virtual host `index`; returns kemari's report."""
        return live_migrate(self.guest, self.lab.hosts[index], **limits)

    def check_disk(self, label: str, timeout: float = 90) -> str:
        """The guest writes a fresh token to its disk, syncs, drops its caches and
        reads it back (GET /cgi-bin/disk from the client); returns the token.
        It takes 0.5-5 s; the timeout leaves room for the virtual host's
        stalls (its CPUs held by the nested guest for tens of seconds at
        times), and a failure prints the VMM's queues and console."""
        token = f"{label}-{secrets.token_hex(8)}"
        try:
            body = self.lab.client_http_get(self.guest.spec.ip, f"/cgi-bin/disk?{token}", timeout=timeout)
        except LabError as e:
            raise LabError(f"{e}\n{self.guest.diagnostics()}") from None
        if f"KLAB-DISK-OK {token}" not in body:
            raise LabError(f"{self.host.name}: guest {self.guest.spec.name} disk write/read-back failed: {body!r}")
        self.last_token = token
        return token

    def finish(self) -> dict[str, float]:
        """Closes the client connection (raises if any echo failed), powers the
        guest off where it runs (its kemari must exit 0), and checks that the
        last token the guest wrote is in the shared image. Returns measures."""
        final = self.conn.close()
        self.measures.update(
            client_echoes=float(final["exchanges"]),
            client_mb_each_way=final["bytes"] / 1e6,
            client_max_gap_s=float(final["max_gap_s"]),
        )
        t0 = time.monotonic()
        self.lab.client_http_get(self.guest.spec.ip, "/cgi-bin/poweroff")
        status = self.guest.wait_exit()
        if status != 0:
            raise LabError(f"{self.host.name}: kemari exited with status {status} after the guest's poweroff")
        self.measures["poweroff_s"] = time.monotonic() - t0
        self.disk.check_serving()
        self.disk.stop()
        if self.last_token is not None:
            on_disk = self.disk.read_file(TOKEN_FILE).strip()
            if on_disk != self.last_token:
                raise LabError(
                    f"shared disk {self.disk.image}: {TOKEN_FILE} holds {on_disk!r}, "
                    f"the guest last wrote {self.last_token!r}"
                )
        return self.measures


@contextmanager
def roaming_guest(
    lab: Lab, home: int = 0, name: str = "roam", memory_mb: int = 512, vcpus: int = 2, vmm_args: str = ""
) -> Iterator[RoamingGuest]:
    """Starts the shared disk, the guest on virtual host `home` and the client
    connection; on exit (normal or not) stops the client and the disk server.
    The guest's IP and MAC are those of guest 0 of `home` wherever it moves."""
    host = lab.hosts[home]
    with step(f"setting up the shared disk for a guest on {host.name}"):
        disk = SharedDisk(lab).start()
    conn: LongConnection | None = None
    try:
        with step(f"starting the roaming guest {name} on {host.name} and its client connection"):
            install_key(lab.hosts)
            spec = GuestSpec(
                name=name,
                vmm="kemari",
                host_index=home,
                memory_mb=memory_mb,
                vcpus=vcpus,
                disk_url=disk.url,
                log_level="info",  # kemari's state changes (paused, committed, restore_ms) in the console
                vmm_args=vmm_args,
            )
            guest = Guest(host, spec)
            guest.start()
            guest.check_boot(guest.wait_ready())
            conn = LongConnection(lab, spec.ip)
            conn.open()
            conn.expect_progress(10)
        rg = RoamingGuest(lab, disk, guest, conn)
        rg.measures["guest_ready_s"] = guest.ready_seconds or 0.0
        try:
            yield rg
        except BaseException:
            # Keep the log of the kemari that runs the guest now (after a
            # migration or failover, on another host) for the post-mortem.
            try:
                guest.console_text()
            except Exception as e:  # noqa: BLE001 - best effort, the first error matters
                images.log(f"could not save {guest.spec.name}'s console from {guest.host.name}: {e}")
            raise
    finally:
        if conn is not None:
            conn.abort()
        disk.stop()
