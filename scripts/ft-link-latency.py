#!/usr/bin/env python3
"""Fault tolerance over a sync link with latency: epochs in flight (issue 28).

Runs `kemari-bench ft` (event-driven mode, 256 MiB test guest) for each
link delay — 0: the direct loopback link; D: a relay delaying every chunk
D µs each way between primary and standby (`--link-delay-us`) — once with
each `--epochs-in-flight` value, alternated round by round, and writes one
table: the medians and each value's ratio to the first (the default, 1).

  flock /work/bench.lock scripts/ft-link-latency.py [--delay-us 0,250] \
      [--in-flight 1,4] [--rounds 3] [--json docs/bench/ft-link-latency.json]

Needs what `kemari-bench ft` needs (root, /dev/kvm, TAP devices) and
target/release/kemari-bench with the test guest built.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "target/release/kemari-bench")
# (column, how to read it from an event-mode `network` or disk run)
FIGURES = [
    ("rr/s x1", lambda runs: med(runs["network"]["rr_per_s"]["1"])),
    ("rr/s x8", lambda runs: med(runs["network"]["rr_per_s"]["8"])),
    ("stream MB/s x1", lambda runs: runs["network"]["stream_mb_s"]["1"]),
    ("stream MB/s x8", lambda runs: runs["network"]["stream_mb_s"]["8"]),
    ("osync w/s", lambda runs: runs["osync"]["blocks_per_s"]),
    ("sync p50 us", lambda runs: runs["network"]["sync_us_p50"]),
]


def med(values):
    return statistics.median(values) if isinstance(values, list) else values


def one_run(delay_us, in_flight, out):
    argv = [BENCH, "ft", "--sizes", "256M", "--modes", "event", "--connections", "1,8",
            "--rounds", "1", "--link-delay-us", str(delay_us),
            "--epochs-in-flight", str(in_flight), "--json", out]
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"kemari-bench ft failed ({done.returncode}):\n{done.stderr}")
    with open(out) as f:
        return figures(json.load(f))


def figures(doc):
    """The table's figures from one `kemari-bench ft --json` document (its
    event-mode runs)."""
    runs = {r["job"]: r for r in doc["runs"] if r.get("mode") == "event"}
    return {name: get(runs) for name, get in FIGURES}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-us", default="0,250")
    ap.add_argument("--in-flight", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    values = [int(v) for v in args.in_flight.split(",")]
    delays = [int(d) for d in args.delay_us.split(",")]
    cases = [(d, v) for d in delays for v in values]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = list(os.getloadavg())
    results = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            # Alternated, the first case rotated per round.
            order = cases[r % len(cases):] + cases[:r % len(cases)]
            for d, v in order:
                fig = one_run(d, v, os.path.join(tmp, f"{r}-{d}-{v}.json"))
                results[(d, v)].append(fig)
                print(f"round {r + 1} delay {d} us, epochs-in-flight {v}: " +
                      ", ".join(f"{k} {x:.1f}" for k, x in fig.items()), file=sys.stderr)
    names = [n for n, _ in FIGURES]
    medians = {c: {n: statistics.median(f[n] for f in results[c]) for n in names} for c in cases}
    rows = []
    for d, v in cases:
        m = medians[(d, v)]
        rows.append([d, v, "median"] + [round(m[n], 1) for n in names])
        base = medians[(d, values[0])]
        if v != values[0]:
            rows.append([d, v, f"÷ {values[0]} in flight"] +
                        [round(m[n] / base[n], 2) if base[n] else None for n in names])
    notes = [
        "delay 0: the direct loopback link; otherwise a relay delaying each chunk that many us each way "
        f"(plus its own thread hand-offs: see sync p50); {args.rounds} rounds, the cases alternated, medians",
        "single-connection request/response gains nothing by construction (each request waits for its "
        "own epoch); concurrent connections and streams get more epochs out per round trip",
    ]
    doc = {
        "schema": 1,
        "bench": "ft-link-latency",
        "command": " ".join(["flock /work/bench.lock", "scripts/ft-link-latency.py"] + sys.argv[1:]),
        "started": started,
        "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip(),
        "host": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())},
        "params": {"delay_us": delays, "in_flight": values, "rounds": args.rounds},
        "runs": [{"delay_us": d, "in_flight": v, **f} for (d, v) in cases for f in results[(d, v)]],
        "tables": [{
            "title": "event-driven fault tolerance, 256 MiB test guest, sync link with latency: "
                     "`ft start --epochs-in-flight N`",
            "columns": ["link delay us", "epochs in flight", "figure"] + names,
            "rows": rows,
        }],
        "notes": notes,
    }
    text = json.dumps(doc, indent=1) + "\n"
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
