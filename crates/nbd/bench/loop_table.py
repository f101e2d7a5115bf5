#!/usr/bin/env python3
"""Tables of run.sh's loopback runs.

    loop_table.py RUNS PORT=NAME...

RUNS has one line per fio run: "CASE PORT IOPS MBPS CPU_US_PER_REQUEST ROUND",
CASE being "RW:BS:QD:CONNS". The first PORT=NAME is kemari-nbd; a server
named "baseline" (an older kemari-nbd) is shown but is not one of the
others it is compared with. Prints, per case, each server's median IOPS
with the spread (min-max) over the rounds, kemari-nbd's median divided by
the best other median, the same ratio per round (min-max), and the median
server CPU time per request. `summarize` gives the same figures as data
(run.sh's JSON, to_json.py).
"""
import statistics
import sys
from collections import defaultdict


def read_runs(path):
    """The runs as dicts: case fields, port, iops, mb_s, cpu_us, round."""
    runs = []
    for line in open(path):
        f = line.split()
        if len(f) != 6:
            continue
        case, port, v, mbps, c, rnd = f
        rw, bs, qd, conns = case.split(":")
        runs.append({"case": case, "rw": rw, "bs": bs, "qd": int(qd), "conns": int(conns),
                     "port": port, "iops": float(v), "mb_s": float(mbps),
                     "cpu_us_per_request": float(c), "round": int(rnd)})
    return runs


def label(case):
    rw, bs, qd, conns = case.split(":")
    return f"{bs} {rw} QD{qd}" + (f" ×{conns} conns" if conns != "1" else "")


def summarize(runs, names):
    """One dict per case: label, per-server median/min/max IOPS and median MB/s
    and CPU, kemari-nbd ÷ best other (median) and its per-round min-max."""
    ports = [p for p, _ in names]
    name = dict(names)
    iops, mbs, cpu = defaultdict(list), defaultdict(list), defaultdict(list)
    per_round = defaultdict(dict)  # (case, round) -> {port: iops}
    cases = []
    for r in runs:
        case, port = r["case"], r["port"]
        if case not in cases:
            cases.append(case)
        iops[case, port].append(r["iops"])
        mbs[case, port].append(r["mb_s"])
        cpu[case, port].append(r["cpu_us_per_request"])
        per_round[case, r["round"]][port] = r["iops"]
    me = ports[0]
    others = [p for p in ports[1:] if name[p] != "baseline"]
    out = []
    for case in cases:
        servers = {}
        for p in ports:
            if iops[case, p]:
                servers[name[p]] = {
                    "iops": statistics.median(iops[case, p]),
                    "iops_min": min(iops[case, p]),
                    "iops_max": max(iops[case, p]),
                    "mb_s": statistics.median(mbs[case, p]),
                    "cpu_us_per_request": statistics.median(cpu[case, p]),
                }
        best = max((servers[name[p]]["iops"] for p in others if name[p] in servers), default=0)
        rounds = [
            r[me] / max(r[p] for p in others if p in r)
            for (c, _), r in per_round.items()
            if c == case and me in r and any(p in r for p in others)
        ]
        out.append({
            "case": case, "label": label(case), "servers": servers,
            "ratio": servers[name[me]]["iops"] / best if best and name[me] in servers else None,
            "ratio_min": min(rounds) if rounds else None,
            "ratio_max": max(rounds) if rounds else None,
        })
    return out


def main():
    names = [a.split("=", 1) for a in sys.argv[2:]]
    servers = [n for _, n in names]
    rows = summarize(read_runs(sys.argv[1]), names)
    head = ["case"] + servers + ["÷ best other", "per round", "CPU µs/request"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        s = r["servers"]
        cells = [
            f"{s[n]['iops']:,.0f} ({s[n]['iops_min']:,.0f}–{s[n]['iops_max']:,.0f})" if n in s else "–"
            for n in servers
        ]
        ratio = f"**{r['ratio']:.2f}**" if r["ratio"] is not None else "–"
        spread = f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f}" if r["ratio_min"] is not None else "–"
        cpus = " / ".join(f"{s[n]['cpu_us_per_request']:.1f}" if n in s else "–" for n in servers)
        print(f"| {r['label']} | " + " | ".join(cells) + f" | {ratio} | {spread} | {cpus} |")


if __name__ == "__main__":
    main()
