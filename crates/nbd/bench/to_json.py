#!/usr/bin/env python3
"""run.sh's results as one JSON document (the envelope kemari-bench --json
writes: schema, bench, command, dates, host, params, runs, tables, notes).

    to_json.py WORK OUT COMMAND STARTED PARAMS_JSON [PORT=NAME...]

Reads what run.sh left in WORK: loop-runs.txt (loopback fio runs),
proxy.jsonl (proxy vs target), wan.jsonl (remote reference, Table 4 with
its per-second timelines, the background copy, the relocation check).
OUT "-" is standard output.
"""
import datetime
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loop_table  # noqa: E402


def loadavg():
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


def host(load_start):
    model = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // 1024
    except OSError:
        pass
    kvm = next((m for m in ("kvm_pvm", "kvm_intel", "kvm_amd") if os.path.exists(f"/sys/module/{m}")), None)
    return {"hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpu_model": model, "memory_mib": mem, "kvm_module": kvm,
            "loadavg_start": load_start, "loadavg_end": loadavg()}


def jsonl(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def build(work, command, started, params, names, load_start=None):
    doc = {"schema": 1, "bench": "nbd", "command": command, "argv": command.split(),
           "version": None, "started": started,
           "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "host": host(load_start), "params": params, "runs": [], "tables": [], "notes": []}
    try:
        doc["git_commit"] = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                           capture_output=True, text=True).stdout.strip() or None
    except OSError:
        doc["git_commit"] = None
    name = dict(names)
    runs_path = os.path.join(work, "loop-runs.txt")
    if names and os.path.exists(runs_path):
        runs = loop_table.read_runs(runs_path)
        for r in runs:
            r["server"] = name.get(r["port"], r["port"])
            r["job"] = "loopback"
        doc["runs"] += runs
        servers = [n for _, n in names]
        rows = []
        for s in loop_table.summarize(runs, names):
            rows.append([s["label"]] + [s["servers"].get(n, {}).get("iops") for n in servers]
                        + [s["ratio"], s["ratio_min"], s["ratio_max"]]
                        + [s["servers"].get(n, {}).get("cpu_us_per_request") for n in servers])
        doc["tables"].append({
            "title": "loopback, fio nbd engine: IOPS (median of the rounds), kemari-nbd ÷ best other",
            "columns": ["case"] + servers + ["kemari-nbd ÷ best", "per round min", "per round max"]
                       + [f"CPU µs/req {n}" for n in servers],
            "rows": rows})
    proxy = jsonl(os.path.join(work, "proxy.jsonl"))
    if proxy:
        doc["runs"] += [dict(p, job="proxy") for p in proxy]
        doc["tables"].append({
            "title": "proxy fully cached (after cut-over) vs direct target, IOPS (median)",
            "columns": ["case", "target", "proxy", "proxy ÷ target"],
            "rows": [[p["case"], p["target_iops"], p["proxy_iops"], p["ratio"]] for p in proxy]})
    wan = jsonl(os.path.join(work, "wan.jsonl"))
    doc["runs"] += wan
    t4 = [w for w in wan if w.get("job") == "table4"]
    if t4:
        doc["tables"].append({
            "title": "Table 4: uncached 4 KiB random reads (QD1) through the proxy over the emulated WAN",
            "columns": ["case", "ops/s", "last 10 s ops/s", "cached %", "knee s", "link use % until knee"],
            "rows": [[w["case"], w["ops_per_sec"], w["last10"], w["cached_percent"], w["knee_s"],
                      w["link_util_pct"]] for w in t4]})
    for w in wan:
        if w.get("job") == "remote":
            doc["notes"].append(
                f"remote (no proxy): 4k randread QD1 {w['qd1_iops']:.0f} IOPS, QD16 {w['qd16_iops']:.0f} IOPS; "
                f"1M seq read QD16 {w['seq_mb_s']:.1f} MB/s")
        elif w.get("job") == "background_copy":
            doc["notes"].append(
                f"background copy of 1 GiB over the WAN: {w['secs']:.1f} s, {w['util_pct']:.1f}% of the "
                f"100 Mbit/s line rate excluding the first and last 2 s ({w['whole_util_pct']:.1f}% whole)")
        elif w.get("job") == "relocation":
            doc["notes"].append(
                f"relocation: {'OK' if w['ok'] else 'FAILED'}: proxy SIGKILLed at {w['killed_at_blocks']} cached "
                f"blocks, {w['persisted_blocks']} persisted, {w['after_restart_blocks']} after restart; "
                f"every byte checked after the target was stopped")
    return doc


def main():
    work, out, command, started, params = sys.argv[1:6]
    names = [a.split("=", 1) for a in sys.argv[6:]]
    load_start = os.environ.get("KNBD_LOAD_START")
    load_start = [float(x) for x in load_start.split()[:3]] if load_start else None
    doc = build(work, command, started, json.loads(params), names, load_start)
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if out == "-":
        sys.stdout.write(text)
    else:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
