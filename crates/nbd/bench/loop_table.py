#!/usr/bin/env python3
"""Tables of run.sh's loopback runs.

    loop_table.py RUNS PORT=NAME...

RUNS has one line per fio run: "CASE PORT IOPS MBPS CPU_US_PER_REQUEST ROUND",
CASE being "RW:BS:QD:CONNS". The first PORT=NAME is kemari-nbd; a server
named "baseline" (an older kemari-nbd) is shown but is not one of the
others it is compared with. Prints, per case, each server's median IOPS
with the spread (min-max) over the rounds, kemari-nbd's median divided by
the best other median, the same ratio per round (min-max), and the median
server CPU time per request.
"""
import statistics
import sys
from collections import defaultdict


def main():
    runs, names = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
    ports = [p for p, _ in names]
    name = dict(names)
    iops = defaultdict(list)  # (case, port) -> [iops]
    cpu = defaultdict(list)
    per_round = defaultdict(dict)  # (case, round) -> {port: iops}
    cases = []
    for line in open(runs):
        f = line.split()
        if len(f) != 6:
            continue
        case, port, v, _mbps, c, rnd = f
        if case not in cases:
            cases.append(case)
        iops[case, port].append(float(v))
        cpu[case, port].append(float(c))
        per_round[case, rnd][port] = float(v)
    me = ports[0]
    others = [p for p in ports[1:] if name[p] != "baseline"]
    head = ["case"] + [name[p] for p in ports] + ["÷ best other", "per round", "CPU µs/request"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for case in cases:
        rw, bs, qd, conns = case.split(":")
        label = f"{bs} {rw} QD{qd}" + (f" ×{conns} conns" if conns != "1" else "")
        med = {p: statistics.median(iops[case, p]) for p in ports if iops[case, p]}
        cells = [
            f"{med[p]:,.0f} ({min(iops[case, p]):,.0f}–{max(iops[case, p]):,.0f})" if p in med else "–"
            for p in ports
        ]
        best = max((med[p] for p in others if p in med), default=0)
        ratio = f"**{med[me] / best:.2f}**" if best and me in med else "–"
        rounds = [
            r[me] / max(r[p] for p in others if p in r)
            for (c, _), r in per_round.items()
            if c == case and me in r and any(p in r for p in others)
        ]
        spread = f"{min(rounds):.2f}–{max(rounds):.2f}" if rounds else "–"
        cpus = " / ".join(
            f"{statistics.median(cpu[case, p]):.1f}" if cpu[case, p] else "–" for p in ports
        )
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio} | {spread} | {cpus} |")


if __name__ == "__main__":
    main()
