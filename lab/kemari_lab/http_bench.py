"""An HTTP load against a lab guest, run in the client namespace.

    python3 http_bench.py IP PATH_PREFIX COUNT [--concurrency N] [--timeout S]

GETs ``http://IP/PATH_PREFIX<i>`` for i in 0..COUNT-1 (``%03d``), each
once, from N threads, and prints one JSON line: ``requests``, ``bytes``,
``seconds`` (the first request's start to the last one's end), ``mb_s``,
``errors`` (requests that failed or came back empty) and ``first_error``.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ip")
    p.add_argument("prefix")
    p.add_argument("count", type=int)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    todo: queue.Queue[int] = queue.Queue()
    for i in range(args.count):
        todo.put(i)
    lock = threading.Lock()
    totals = {"requests": 0, "bytes": 0, "errors": 0}
    first_error: list[str] = []

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            url = f"http://{args.ip}/{args.prefix}{i:03d}"
            try:
                with urllib.request.urlopen(url, timeout=args.timeout) as r:
                    n = len(r.read())
                err = None if n > 0 else f"{url}: empty"
            except OSError as e:
                n, err = 0, f"{url}: {e}"
            with lock:
                totals["requests"] += 1
                totals["bytes"] += n
                if err:
                    totals["errors"] += 1
                    first_error.append(err)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    print(
        json.dumps(
            dict(
                totals,
                seconds=seconds,
                mb_s=totals["bytes"] / seconds / 1e6 if seconds else 0.0,
                first_error=first_error[0] if first_error else None,
            )
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
