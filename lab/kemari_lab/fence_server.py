"""The lab's STONITH device: powers virtual hosts off on request, over HTTP.

A fault-tolerance standby on another virtual host cannot share an ``flock``
with its primary, so kemari offers ``--ft-fence-cmd``: a command the standby
runs before it takes over, which must make sure the primary is off and exit 0.
In the lab the "power switch" of each virtual host is its QEMU process on this
machine; this server, run inside the lab namespace on the bridge address,
is the switch's network interface::

    python3 fence_server.py --listen 10.77.0.1:10810 --log FILE \\
        --target 10.77.0.10=<pid of vh0's QEMU> --target 10.77.0.11=<pid> …

    GET /fence?peer=10.77.0.10:40312
      -> 200 "KLAB-FENCED ip=10.77.0.10 action=killed|already-off"
         (SIGKILL to that QEMU if it still runs, then waits until it is gone)
      -> 404 for an address that is no virtual host's, 500 if it cannot kill

The standby's command (busybox in the virtual host)::

    printf 'GET /fence?peer=%s HTTP/1.0\\r\\n\\r\\n' "$KEMARI_FT_PEER" \\
        | nc -w 5 10.77.0.1 10810 | grep -q KLAB-FENCED

Each QEMU is identified by its PID *and* its start time (``/proc/PID/stat``
field 22, read when the server starts), so a reused PID is never killed.
Every request is logged as one JSON line (``time.monotonic()``, CLOCK_MONOTONIC,
comparable with the harness's clock).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: split after its closing ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie is off
    return int(fields[19])  # field 22 of the whole line


class Target:
    """One virtual host's power switch: its QEMU process."""

    def __init__(self, ip: str, pid: int) -> None:
        self.ip = ip
        self.pid = pid
        self.started = start_time(pid)

    def running(self) -> bool:
        return self.started is not None and start_time(self.pid) == self.started

    def power_off(self, patience: float = 5.0) -> str:
        """Kills the QEMU if it runs; returns what was done. Raises if it survives."""
        if not self.running():
            return "already-off"
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return "already-off"
        deadline = time.monotonic() + patience
        while self.running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"pid {self.pid} still runs {patience:.0f}s after SIGKILL")
            time.sleep(0.02)
        return "killed"


def make_handler(targets: dict[str, Target], log: object) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: str) -> None:
            data = (body + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            t = time.monotonic()
            url = urlparse(self.path)
            peer = parse_qs(url.query).get("peer", [""])[0]
            ip = peer.rsplit(":", 1)[0] if ":" in peer else peer
            event: dict[str, object] = {"t": t, "from": self.client_address[0], "peer": peer}
            target = targets.get(ip)
            if url.path != "/fence" or target is None:
                code, body = 404, f"KLAB-FENCE-UNKNOWN peer={peer!r}"
            else:
                try:
                    action = target.power_off()
                    code, body = 200, f"KLAB-FENCED ip={ip} action={action}"
                    event["action"] = action
                except (OSError, RuntimeError) as e:
                    code, body = 500, f"KLAB-FENCE-FAILED ip={ip}: {e}"
            event.update(code=code, done=time.monotonic())
            print(json.dumps(event), file=log, flush=True)  # type: ignore[call-overload]
            self._answer(code, body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one JSON line per request instead

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--target", action="append", default=[], help="IP=PID of a virtual host's QEMU")
    p.add_argument("--log", help="JSON lines, one per request (default stdout)")
    args = p.parse_args(argv)
    targets = {}
    for spec in args.target:
        ip, pid = spec.split("=", 1)
        targets[ip] = Target(ip, int(pid))
    host, port = args.listen.rsplit(":", 1)
    log = open(args.log, "a") if args.log else sys.stdout  # noqa: SIM115 (lives as long as the server)
    server = ThreadingHTTPServer((host, int(port)), make_handler(targets, log))
    print(json.dumps({"listening": args.listen, "targets": {ip: t.pid for ip, t in targets.items()}}), file=log, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
