"""A long-lived, byte-checked TCP exchange with an echo service.

Run by the harness in the client namespace (standard library only)::

    python3 echo_client.py HOST PORT [--interval S] [--stall-limit S] [--connect-timeout S] [--max-block N]

Opens ONE connection and keeps it: every `interval` seconds it sends a block
of 1–8192 (``--max-block``) random bytes and reads back exactly as many,
which must be the same bytes. It never reconnects: if the connection breaks,
stalls longer than `stall-limit`, or an echo differs, the exchanges stop and
the error is kept.

Protocol on stdin/stdout, one JSON line per line of input:

- on start, once connected (or failed): ``{"connected": true, "local": "ip:port", ...stats}``;
- ``stats``: the statistics below;
- ``stop``: closes the connection, answers with the final statistics and exits
  (status 0 if there was no error, 1 otherwise).

Statistics: ``exchanges`` (echoes verified), ``bytes`` (each way),
``max_gap_s`` (the longest time between two verified echoes — what an outage
looks like from here, interval included), ``max_gap_end_s`` (when it ended,
seconds since connecting), ``gaps`` (every gap over 1 s as ``[end_s, gap_s]``,
the first 100 — to tell one outage from another), ``since_last_s``,
``elapsed_s``, ``error`` (null or what went wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time

MAX_BLOCK = 8192
# Gaps longer than this are listed (when they ended, how long), up to MAX_GAPS.
LONG_GAP = 1.0
MAX_GAPS = 100


class Exchanger:
    def __init__(self, sock: socket.socket, interval: float, max_block: int = MAX_BLOCK) -> None:
        self.sock = sock
        self.interval = interval
        self.max_block = max_block
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.last_ok = self.t0
        self.exchanges = 0
        self.bytes = 0
        self.max_gap = 0.0
        self.max_gap_end = 0.0
        self.gaps: list[list[float]] = []
        self.error: str | None = None

    def run(self) -> None:
        rng = random.Random()
        try:
            while not self.stop.is_set():
                block = os.urandom(rng.randint(1, self.max_block))
                self.sock.sendall(block)
                got = bytearray()
                while len(got) < len(block):
                    part = self.sock.recv(len(block) - len(got))
                    if not part:
                        raise ConnectionError("the connection was closed by the peer")
                    got += part
                if bytes(got) != block:
                    at = next(i for i, (a, b) in enumerate(zip(got, block)) if a != b)
                    raise ValueError(
                        f"echo {self.exchanges + 1} differs from what was sent at byte {at} of {len(block)}"
                    )
                now = time.monotonic()
                with self.lock:
                    gap = now - self.last_ok
                    if gap > self.max_gap:
                        self.max_gap, self.max_gap_end = gap, now - self.t0
                    if gap > LONG_GAP and len(self.gaps) < MAX_GAPS:
                        self.gaps.append([round(now - self.t0, 3), round(gap, 3)])
                    self.last_ok = now
                    self.exchanges += 1
                    self.bytes += len(block)
                self.stop.wait(self.interval)
        except (OSError, ValueError) as e:
            if not self.stop.is_set():
                with self.lock:
                    self.error = f"after {self.exchanges} echoes: {type(e).__name__}: {e}"

    def stats(self) -> dict[str, object]:
        now = time.monotonic()
        with self.lock:
            return {
                "exchanges": self.exchanges,
                "bytes": self.bytes,
                "max_gap_s": round(self.max_gap, 3),
                "max_gap_end_s": round(self.max_gap_end, 3),
                "gaps": [list(g) for g in self.gaps],
                "since_last_s": round(now - self.last_ok, 3),
                "elapsed_s": round(now - self.t0, 3),
                "error": self.error,
            }


def say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Retries until the service accepts (it may be starting) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--max-block", type=int, default=MAX_BLOCK, help="blocks are 1..N random bytes")
    p.add_argument("--stall-limit", type=float, default=60)
    p.add_argument("--connect-timeout", type=float, default=30)
    args = p.parse_args()
    try:
        sock = connect(args.host, args.port, args.connect_timeout)
    except OSError as e:
        say({"connected": False, "error": f"cannot connect to {args.host}:{args.port}: {e}"})
        return 1
    sock.settimeout(args.stall_limit)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ex = Exchanger(sock, args.interval, args.max_block)
    worker = threading.Thread(target=ex.run, daemon=True)
    worker.start()
    host, port = sock.getsockname()[:2]
    say({"connected": True, "local": f"{host}:{port}", **ex.stats()})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            say(ex.stats())
        elif cmd == "stop":
            break
        else:
            say({"error": f"unknown command {cmd!r}"})
    # stdin closed or "stop": end the exchanges, then report.
    ex.stop.set()
    worker.join(timeout=args.stall_limit + 5)
    sock.close()
    final = ex.stats()
    say(final)
    return 0 if final["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
