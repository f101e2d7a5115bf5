"""Live migration of a QEMU guest between virtual hosts, QEMU's own way.

    report = qemu_live_migrate(guest, lab.hosts[1])

The reference for kemari's migration in the soak (soak_rounds.py). The guest
must run with its human monitor on a TCP port of its virtual host
(``GuestSpec.monitor_port``) and a shared disk (``GuestSpec.disk_url``: the
lab's NBD export, which QEMU's own NBD client opens). On the destination the
harness creates the guest's TAP in br0 and starts the *same* QEMU command line
plus ``-incoming tcp:<dest ip>:<port>`` (console in the same
/tmp/<name>.console there); on the source it sends ``migrate -d
tcp:<dest ip>:<port>`` to the monitor with busybox ``nc`` (the virtual host has
no socat or Python), polls ``info migrate`` until ``completed``, checks the
destination says ``running`` (QEMU resumes it at once: no ``-S``), then
``quit``s the paused source (exit status 0). QEMU announces the guest's MAC
itself after the switch-over (its announce-* defaults: RARP, several rounds).
"""

from __future__ import annotations

import re
import time
from typing import Any

from kemari_lab.errors import LabError
from kemari_lab.guests import Guest
from kemari_lab.migration import wait_listening
from kemari_lab.vhost import VirtualHost

QEMU_MIGRATION_PORT = 7790
# Terminal escapes HMP's readline sends over a socket.
_ESC_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\r")
STATUS_RE = re.compile(r"Migration status: (\S+)")
# `info migrate` figures: "total time: 1234 ms", "downtime: 56 ms", "transferred ram: 789 kbytes".
FIGURE_RE = re.compile(r"^(total time|downtime|setup|transferred ram|throughput): ([0-9.]+)", re.MULTILINE)


def parse_info_migrate(text: str) -> dict[str, Any]:
    """``info migrate`` as a dict: ``status`` (None if absent), and
    ``total_ms``, ``downtime_ms``, ``setup_ms``, ``transferred_kb``,
    ``throughput_mbps`` where QEMU printed them."""
    clean = _ESC_RE.sub("", text)
    m = STATUS_RE.search(clean)
    out: dict[str, Any] = {"status": m.group(1) if m else None}
    names = {
        "total time": "total_ms",
        "downtime": "downtime_ms",
        "setup": "setup_ms",
        "transferred ram": "transferred_kb",
        "throughput": "throughput_mbps",
    }
    for name, value in FIGURE_RE.findall(clean):
        out[names[name]] = float(value)
    return out


def hmp(host: VirtualHost, port: int, command: str, timeout: float = 30) -> str:
    """Sends one command to the QEMU monitor on 127.0.0.1:`port` of `host`
    and returns what the monitor printed (banner and prompts included)."""
    if "'" in command:
        raise LabError(f"monitor command with a quote: {command!r}")
    res = host.run(f"(echo '{command}'; sleep 1) | nc -w 3 127.0.0.1 {port}", timeout=timeout, check=False)
    if "QEMU" not in res.output:
        raise LabError(f"{host.name}: no QEMU monitor on port {port} (`{command}`): {res.output.strip()[-500:]}")
    return _ESC_RE.sub("", res.output)


def qemu_live_migrate(
    guest: Guest,
    dest: VirtualHost,
    port: int = QEMU_MIGRATION_PORT,
    downtime_limit_ms: int = 1000,
    timeout: float = 600,
) -> dict[str, Any]:
    """Moves the QEMU `guest` to `dest` by QEMU's pre-copy live migration;
    returns ``info migrate``'s figures plus ``wall_s``. Afterwards
    ``guest.host`` is `dest`. The downtime limit is 1 s (QEMU's default is
    300 ms): the virtual hosts are TCG machines, slower than real ones, and
    kemari's own default target is as lenient."""
    s = guest.spec
    source = guest.host
    if not s.vmm.startswith("qemu") or s.monitor_port is None:
        raise LabError(f"guest {s.name}: a QEMU live migration needs a QEMU guest with a monitor port")
    if s.disk and not s.disk_url:
        raise LabError(f"guest {s.name} has a private disk copy on {source.name}: a migrated guest needs a shared disk")
    if dest is source:
        raise LabError(f"{source.name}: cannot migrate guest {s.name} to its own host")
    guest.add_tap(dest)
    guest.launch(dest, f"{s.vmm_command()} -incoming tcp:{dest.ip}:{port}")
    wait_listening(guest, dest, port, "qemu -incoming", 60)
    mon = s.monitor_port
    hmp(source, mon, f"migrate_set_parameter downtime-limit {downtime_limit_ms}")
    t0 = time.monotonic()
    out = hmp(source, mon, f"migrate -d tcp:{dest.ip}:{port}")
    if "rror" in out:
        raise LabError(f"{source.name}: `migrate` of {s.name} refused: {out.strip()[-500:]}")
    deadline = t0 + timeout
    info: dict[str, Any] = {}
    while True:
        info = parse_info_migrate(hmp(source, mon, "info migrate"))
        if info["status"] == "completed":
            break
        if info["status"] in ("failed", "cancelled"):
            tail = dest.run(f"tail -c 2000 {guest.console}", timeout=30, check=False).output
            raise LabError(f"{source.name}: migration of {s.name} {info['status']}: {info}; destination:\n{tail}")
        if time.monotonic() > deadline:
            hmp(source, mon, "migrate_cancel")
            raise LabError(f"{source.name}: migration of {s.name} not completed after {timeout:.0f}s: {info}")
        time.sleep(2)
    info["wall_s"] = round(time.monotonic() - t0, 2)
    state = hmp(dest, mon, "info status")
    if "running" not in state:
        raise LabError(f"{dest.name}: the migrated QEMU guest {s.name} is not running: {state.strip()[-300:]}")
    hmp(source, mon, "quit")
    status = guest.wait_exit(timeout=60)  # the source QEMU; keeps its console in the run dir
    if status != 0:
        raise LabError(f"{source.name}: QEMU exited with status {status} after migrating out")
    guest.host = dest
    return info
