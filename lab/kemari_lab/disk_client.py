"""A disk writer against a lab guest, run in the client namespace.

    python3 disk_client.py IP [--interval S] [--timeout S] [--stall-limit S]

Every `interval` seconds it asks the guest for ``GET /cgi-bin/disk?TOKEN``
(the guest writes TOKEN to its ext4 disk, syncs, drops its page cache and
reads it back) with a fresh token, and counts the requests acknowledged with
``KLAB-DISK-OK TOKEN``. After each request it prints one JSON line: ``acks``,
``failures`` (requests that failed, e.g. timed out), ``last_failure``,
``since_last_ack_s``, ``max_ack_gap_s`` (the longest wait between two
acknowledgements so far: the client's stall), ``elapsed_s``, ``error``. It ends, with ``error`` set,
when the guest answers ``KLAB-DISK-FAIL`` (its disk lost the write) or when no
request was acknowledged for `stall_limit` seconds; or when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ip")
    p.add_argument("--interval", type=float, default=1.5)
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--stall-limit", type=float, default=90)
    args = p.parse_args()
    stop = threading.Event()

    def watch_stdin() -> None:
        for _ in sys.stdin:
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    t0 = time.monotonic()
    last_ack = t0
    acks = failures = 0
    max_ack_gap = 0.0
    last_failure: str | None = None
    error: str | None = None
    while not stop.is_set():
        token = f"soak-{acks + failures + 1}-{secrets.token_hex(6)}"
        try:
            url = f"http://{args.ip}/cgi-bin/disk?{token}"
            with urllib.request.urlopen(url, timeout=args.timeout) as r:
                body = r.read().decode(errors="replace")
            if f"KLAB-DISK-OK {token}" in body:
                acks += 1
                now = time.monotonic()
                if acks > 1:
                    max_ack_gap = max(max_ack_gap, now - last_ack)
                last_ack = now
            elif "KLAB-DISK-FAIL" in body:
                error = f"the guest failed to write and read back {token}: {body.strip()!r}"
            else:
                failures += 1
                last_failure = f"unexpected answer {body.strip()[:200]!r}"
        except (OSError, ValueError) as e:
            failures += 1
            last_failure = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        if error is None and now - last_ack > args.stall_limit:
            error = f"no write acknowledged for {now - last_ack:.0f}s (last failure: {last_failure})"
        line = {
            "acks": acks,
            "failures": failures,
            "last_failure": last_failure,
            "since_last_ack_s": round(now - last_ack, 3),
            "max_ack_gap_s": round(max_ack_gap, 3),
            "elapsed_s": round(now - t0, 3),
            "error": error,
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        if error is not None:
            return 1
        stop.wait(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
