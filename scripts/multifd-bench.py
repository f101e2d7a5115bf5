#!/usr/bin/env python3
"""Live migration over several streams, kemari vs QEMU (issue 28, goal 3).

A 1 GiB test guest (`counter=100 dirty=10000,900`) runs in kemari or in
QEMU (Debian's qemu-system-x86, microvm, the same guest ELF); each
migration starts once the guest's dirtier has written every page of its
900 MiB once (its `dirty:` report shows total >= ws_pages): both VMMs'
guests fill the same memory. Variants, alternated within each run:

  kemari-1 / kemari-N          encrypted (Noise), --connections 1 / N
  kemari-1-plain / kemari-N-plain   --plaintext-link
  qemu / qemu-multifd-N        QEMU over TCP, plain / with the multifd
                               capability and N channels (max-bandwidth
                               unlimited: QEMU 7.2 defaults to 32 MiB/s)

Per migration: total (request to completion, as the VMM reports it),
downtime, bytes, kemari's round-1 bandwidth (its `pre-copy round sent`
debug line), and the CPU seconds each side's process used outside its
vCPU threads from the request until 0.5 s after the end (/proc/PID/task/*/
stat, polled every 20 ms; the source's last poll before it exits).

  flock /work/bench.lock scripts/multifd-bench.py [--runs 3] [--connections 4]
  ... --capped 1gbit      both VMMs in two network namespaces joined by a
                          veth pair whose source end is shaped by `tc tbf`
  ... --max-bandwidth 60  kemari (and QEMU) capped by their own setting
  ... --variants kemari-1,kemari-1-plain --runs 9   (round-1 stability)

Needs root (namespaces), /dev/kvm, target/release/{kemari,kemarictl}, the
test guest, and qemu-system-x86_64 for the QEMU variants.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("BIN", os.path.join(ROOT, "target/release"))
ELF = os.environ.get("ELF", os.path.join(ROOT, "target/x86_64-unknown-none/release/guest"))
QEMU = os.environ.get("QEMU", "qemu-system-x86_64")
QEMU_CPU = "host,-arch-capabilities"  # crates/bench/src/lib.rs
CMDLINE = "counter=100 dirty=10000,900"
MEMORY = "1G"
CLK = os.sysconf("SC_CLK_TCK")
KEY = b"kemari-multifd-bench-key-0123456789"


def sh(*args, check=True):
    return subprocess.run(args, check=check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------------ CPU


def non_vcpu_ticks(pid):
    """CPU ticks `pid` used outside its vCPU threads (kemari names them
    vcpuN, QEMU `CPU n/KVM`): the process's utime + stime, which keeps the
    time of threads that ended (a stream's sender), less its vCPU threads',
    and how many vCPU threads it has; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        whole = int(fields[11]) + int(fields[12])
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return None
    vcpu, vcpus = 0, 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                comm = f.read().strip()
            if not (comm.startswith("vcpu") or comm.startswith("CPU ")):
                continue
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                tf = f.read().rsplit(")", 1)[1].split()
            vcpu += int(tf[11]) + int(tf[12])
            vcpus += 1
        except (FileNotFoundError, ProcessLookupError):
            continue
    return whole - vcpu, vcpus


def runq_wait_ns(pid):
    """{tid: ns waited on a run queue} of `pid`'s threads other than its
    vCPUs (/proc/PID/task/TID/schedstat, second field)."""
    out = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                if f.read().startswith(("vcpu", "CPU ")):
                    continue
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[t] = int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return out


class CpuPoll:
    """Polls a process's non-vCPU CPU from now on (every 20 ms); `used()`
    is the CPU seconds since the start, up to the last poll that saw the
    process."""

    def __init__(self, pid):
        self.pid = pid
        first = non_vcpu_ticks(pid)
        self.first = first and first[0]
        self.last = self.first
        self.vcpus = first[1] if first else 0
        self.wait0 = runq_wait_ns(pid)
        self.wait = dict(self.wait0)
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            v = non_vcpu_ticks(self.pid)
            if v is None:
                return
            # An exiting process's vCPU threads go first, their time into
            # the process's: a sample with fewer vCPUs than before would
            # count the guest's CPU. (A destination's vCPUs appear later.)
            if v[1] >= self.vcpus:
                self.last, self.vcpus = v
            self.wait.update(runq_wait_ns(self.pid))
            time.sleep(0.02)

    def waited(self):
        """Seconds the process's non-vCPU threads waited on a run queue
        (ready to run, another task on the CPU) since the start."""
        return round(sum(v - self.wait0.get(t, 0) for t, v in self.wait.items()) / 1e9, 2)

    def used(self):
        self.stop = True
        self.t.join(2)
        if self.first is None or self.last is None:
            return None
        return round((self.last - self.first) / CLK, 2)


# ------------------------------------------------------------------ guests


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def filled(console):
    """Whether the guest's dirtier has written its whole working set once."""
    for m in re.finditer(r"dirty: rate=\d+ ws_pages=(\d+) total=(\d+) bad=(\d+)", read(console)):
        if int(m.group(3)) != 0:
            raise RuntimeError(f"the guest found a lost write: {m.group(0)}")
        if int(m.group(2)) >= int(m.group(1)):
            return True
    return False


def wait(what, cond, limit=120, step=0.05):
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(step)


class Netns:
    """Two namespaces (src, dst) joined by a veth pair 10.204.0.1/.2 whose
    source end sends through `tc tbf rate RATE`."""

    def __init__(self, rate):
        tag = os.getpid() % 10000
        self.ns = [f"kmfs{tag}", f"kmfd{tag}"]
        self.rate = rate
        for n in self.ns:
            sh("ip", "netns", "del", n, check=False)
            sh("ip", "netns", "add", n)
            sh("ip", "-n", n, "link", "set", "lo", "up")
        sh("ip", "link", "add", "kmfa", "netns", self.ns[0], "type", "veth", "peer", "kmfb", "netns", self.ns[1])
        for n, dev, ip in ((self.ns[0], "kmfa", "10.204.0.1/24"), (self.ns[1], "kmfb", "10.204.0.2/24")):
            sh("ip", "-n", n, "addr", "add", ip, "dev", dev)
            sh("ip", "-n", n, "link", "set", dev, "up")
        # burst >= rate / HZ; a 50 ms queue.
        sh("ip", "netns", "exec", self.ns[0], "tc", "qdisc", "add", "dev", "kmfa", "root", "tbf",
           "rate", rate, "burst", "1mb", "latency", "50ms")
        self.dst_ip = "10.204.0.2"

    def wrap(self, side, argv):
        return ["ip", "netns", "exec", self.ns[side]] + argv

    def close(self):
        for n in self.ns:
            sh("ip", "netns", "del", n, check=False)


class Local:
    dst_ip = "127.0.0.1"

    def wrap(self, side, argv):
        return argv

    def close(self):
        pass


def rate_bits(rate):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    if not m:
        raise SystemExit(f"--capped {rate}: write it as tc does, e.g. 1gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


# ------------------------------------------------------------------ kemari


def kemari_one(w, net, conns, plain, port, max_bw):
    key = os.path.join(w, "key")
    with open(key, "wb") as f:
        f.write(KEY)
    os.chmod(key, 0o600)
    pl = ["--plaintext-link"] if plain else []
    for s in ("src.sock", "dst.sock", "src.log", "dst.log"):
        if os.path.exists(os.path.join(w, s)):
            os.unlink(os.path.join(w, s))
    src_log = open(os.path.join(w, "src.out"), "w")
    dst_log = open(os.path.join(w, "dst.out"), "w")
    src = subprocess.Popen(net.wrap(0, [os.path.join(BIN, "kemari"), "--kernel", ELF, "--memory", MEMORY,
                                        "--cmdline", CMDLINE, "--serial", f"file:{w}/src.log",
                                        "--api-socket", f"{w}/src.sock",
                                        "--log-level", "warn,transfer=debug"]),
                           stdout=src_log, stderr=subprocess.STDOUT)
    dst = subprocess.Popen(net.wrap(1, [os.path.join(BIN, "kemari"), "--incoming", f"{net.dst_ip}:{port}",
                                        "--migration-key-file", key, "--serial", f"file:{w}/dst.log",
                                        "--api-socket", f"{w}/dst.sock"] + pl),
                           stdout=dst_log, stderr=subprocess.STDOUT)
    try:
        wait("the guest to fill its 900 MiB", lambda: filled(f"{w}/src.log") or src.poll() is not None, 180, 0.2)
        if src.poll() is not None:
            raise RuntimeError(f"the source kemari exited: {read(w + '/src.out')[-400:]}")
        # `ip netns exec` execs the VMM: the same pid.
        cs, cd = CpuPoll(src.pid), CpuPoll(dst.pid)
        argv = [os.path.join(BIN, "kemarictl"), "--api-socket", f"{w}/src.sock", "migrate",
                "--to", f"{net.dst_ip}:{port}", "--key-file", key, "--connections", str(conns)] + pl
        if max_bw:
            argv += ["--max-bandwidth", str(max_bw)]
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"kemarictl migrate: {r.stderr.strip()}")
        rep = json.loads(r.stdout)
        try:
            src.wait(30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
        src_cpu, dst_cpu = cs.used(), cd.used()
        src_wait, dst_wait = cs.waited(), cd.waited()
        rounds = [{k: float(v) for k, v in re.findall(r"\b(round|bytes|ms|mb_s|cpu_ms)=([\d.]+)", line)}
                  for line in read(f"{w}/src.out").splitlines() if "pre-copy round sent" in line]
        r1 = next((x for x in rounds if x.get("round") == 1), None)
        return {
            "total_ms": float(rep["total_ms"]), "downtime_ms": float(rep["downtime_ms"]),
            "bytes": int(rep["bytes_sent"]), "round1_mb_s": r1 and round(r1["mb_s"], 1),
            "round1_bytes": r1 and int(r1["bytes"]), "round1_ms": r1 and round(r1["ms"], 1),
            "src_cpu_s": src_cpu, "dst_cpu_s": dst_cpu, "src_runq_wait_s": src_wait,
            "dst_runq_wait_s": dst_wait, "rounds": rounds, "report": rep,
        }
    finally:
        for p in (src, dst):
            if p.poll() is None:
                p.kill()
            p.wait()
        src_log.close()
        dst_log.close()


# ------------------------------------------------------------------ QEMU


class Qmp:
    def __init__(self, path, limit=30):
        deadline = time.monotonic() + limit
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                self.s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.f = self.s.makefile("rw")
        json.loads(self.f.readline())
        self.cmd("qmp_capabilities")

    def cmd(self, name, args=None):
        msg = {"execute": name}
        if args is not None:
            msg["arguments"] = args
        self.f.write(json.dumps(msg) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise RuntimeError(f"QMP {name}: {r['error'].get('desc')}")


def qemu_argv(w, name, incoming=None):
    a = [QEMU, "-accel", "kvm", "-M", "microvm,x-option-roms=off,rtc=off,isa-serial=on", "-cpu", QEMU_CPU,
         "-m", MEMORY, "-nodefaults", "-no-user-config", "-display", "none",
         "-serial", f"file:{w}/{name}.log", "-device", "isa-debug-exit,iobase=0xf4,iosize=4",
         "-qmp", f"unix:{w}/{name}.qmp,server=on,wait=off", "-append", CMDLINE, "-kernel", ELF]
    if incoming:
        a += ["-incoming", incoming]
    return a


def qemu_one(w, net, channels, port, max_bw):
    for f in ("q1.qmp", "q2.qmp", "q1.log", "q2.log"):
        if os.path.exists(os.path.join(w, f)):
            os.unlink(os.path.join(w, f))
    out1, out2 = open(f"{w}/q1.out", "w"), open(f"{w}/q2.out", "w")
    src = subprocess.Popen(net.wrap(0, qemu_argv(w, "q1")), stdout=out1, stderr=subprocess.STDOUT)
    dst = subprocess.Popen(net.wrap(1, qemu_argv(w, "q2", "defer")), stdout=out2, stderr=subprocess.STDOUT)
    try:
        q1, q2 = Qmp(f"{w}/q1.qmp"), Qmp(f"{w}/q2.qmp")
        caps = [{"capability": "multifd", "state": True}] if channels else []
        for q in (q1, q2):
            if caps:
                q.cmd("migrate-set-capabilities", {"capabilities": caps})
                q.cmd("migrate-set-parameters", {"multifd-channels": channels})
        q1.cmd("migrate-set-parameters", {"max-bandwidth": (max_bw << 20) if max_bw else 100 << 30})
        q2.cmd("migrate-incoming", {"uri": f"tcp:{net.dst_ip}:{port}"})
        wait("the guest to fill its 900 MiB", lambda: filled(f"{w}/q1.log") or src.poll() is not None, 180, 0.2)
        if src.poll() is not None:
            raise RuntimeError(f"the source QEMU exited: {read(w + '/q1.out')[-400:]}")
        cs, cd = CpuPoll(src.pid), CpuPoll(dst.pid)
        q1.cmd("migrate", {"uri": f"tcp:{net.dst_ip}:{port}"})
        deadline = time.monotonic() + 600
        while True:
            st = q1.cmd("query-migrate")
            if st.get("status") == "completed":
                break
            if st.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
                raise RuntimeError(f"QEMU migration {st.get('status')}: {st.get('error-desc', '')}")
            time.sleep(0.01)
        time.sleep(0.5)
        src_cpu, dst_cpu = cs.used(), cd.used()
        wait("the destination to run", lambda: q2.cmd("query-status")["status"] == "running", 30)
        ram = st.get("ram", {})
        return {
            "total_ms": float(st["total-time"]), "downtime_ms": float(st.get("downtime", 0)),
            "bytes": int(ram.get("transferred", 0)), "round1_mb_s": None,
            "mbps": ram.get("mbps"), "src_cpu_s": src_cpu, "dst_cpu_s": dst_cpu, "report": st,
        }
    finally:
        for p in (src, dst):
            if p.poll() is None:
                p.kill()
            p.wait()
        out1.close()
        out2.close()


# ------------------------------------------------------------------ main


def variants_of(n):
    return [f"kemari-1", f"kemari-{n}", "kemari-1-plain", f"kemari-{n}-plain", "qemu", f"qemu-multifd-{n}"]


def run_variant(v, w, net, port, max_bw):
    m = re.fullmatch(r"kemari-(\d+)(-plain)?", v)
    if m:
        return kemari_one(w, net, int(m.group(1)), bool(m.group(2)), port, max_bw)
    m = re.fullmatch(r"qemu(?:-multifd-(\d+))?", v)
    if m:
        return qemu_one(w, net, int(m.group(1)) if m.group(1) else 0, port, max_bw)
    raise SystemExit(f"unknown variant {v}")


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--variants", help="comma-separated (default: kemari-1,kemari-N and -plain, qemu, qemu-multifd-N)")
    ap.add_argument("--capped", metavar="RATE", help="run across a veth pair shaped by tc tbf at RATE (e.g. 1gbit)")
    ap.add_argument("--max-bandwidth", type=int, metavar="MIB_S", help="each VMM's own cap")
    ap.add_argument("--json", help="write the results here (report schema)")
    a = ap.parse_args()
    variants = a.variants.split(",") if a.variants else variants_of(a.connections)
    if os.geteuid() != 0 and a.capped:
        sys.exit("--capped needs root (network namespaces)")
    need = [ELF] + ([os.path.join(BIN, "kemari"), os.path.join(BIN, "kemarictl")]
                    if any(v.startswith("kemari") for v in variants) else [])
    for p in need:
        if not os.path.exists(p):
            sys.exit(f"{p} not found: cargo build --release -p kemari, and the test guest")
    if any(v.startswith("qemu") for v in variants) and not shutil.which(QEMU):
        sys.exit(f"{QEMU} not found: apt-get install qemu-system-x86, or leave the qemu variants out")
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()
    thp = huge_page_settings()
    # kemari's memory is a memfd (shmem), QEMU's anonymous: recorded with
    # the results (alternated runs found no effect on kemari's destination,
    # which writes its pages through the file: docs/benchmarks.md).
    print(f"transparent huge pages: anonymous (QEMU) {thp['anonymous']}, shmem (kemari) {thp['shmem']}",
          flush=True)
    w = tempfile.mkdtemp(prefix="multifd-bench.")
    net = Netns(a.capped) if a.capped else Local()
    results, failures = [], []
    port = 47300 + os.getpid() % 200
    try:
        for run in range(1, a.runs + 1):
            for v in variants:
                port += 1
                try:
                    r = run_variant(v, w, net, port, a.max_bandwidth)
                    r.update(variant=v, run=run)
                    results.append(r)
                    print(json.dumps({k: x for k, x in r.items() if k not in ("report", "rounds")}), flush=True)
                except Exception as e:
                    failures.append({"variant": v, "run": run, "error": str(e)})
                    print(json.dumps(failures[-1]), file=sys.stderr, flush=True)
    finally:
        net.close()
        shutil.rmtree(w, ignore_errors=True)
    rows = []
    for v in variants:
        rs = [r for r in results if r["variant"] == v]
        if not rs:
            continue
        gib = [r["bytes"] / (1 << 30) for r in rs]
        rows.append([v, len(rs), med([r["total_ms"] for r in rs]), med([r["downtime_ms"] for r in rs]),
                     med([r["bytes"] / r["total_ms"] / 1e3 for r in rs]),
                     med([r.get("round1_mb_s") for r in rs]),
                     min((r["round1_mb_s"] for r in rs if r.get("round1_mb_s")), default=None),
                     med([r["src_cpu_s"] / g for r, g in zip(rs, gib) if r["src_cpu_s"] is not None]),
                     med([r["dst_cpu_s"] / g for r, g in zip(rs, gib) if r["dst_cpu_s"] is not None])])
    cols = ["variant", "runs", "total ms", "downtime ms", "MB/s end to end", "round-1 MB/s median",
            "round-1 MB/s min", "source CPU s/GiB", "destination CPU s/GiB"]
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        print("| " + " | ".join("" if c is None else str(c) for c in r) + " |")
    if a.json:
        doc = {
            "schema": 1, "bench": "multifd",
            "command": "flock /work/bench.lock scripts/multifd-bench.py " + " ".join(sys.argv[1:]),
            "started": started.isoformat(timespec="seconds"),
            "git_commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True).stdout.strip(),
            "host": {"cpus": os.cpu_count(), "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
                     "transparent_hugepage": thp},
            "params": {"runs": a.runs, "variants": variants, "capped": a.capped, "max_bandwidth": a.max_bandwidth,
                       "guest": f"{MEMORY}, {CMDLINE}"},
            "tables": [{"title": "live migration, medians" + (f", across a tbf {a.capped} veth link" if a.capped else ", loopback"),
                        "columns": cols, "rows": rows}],
            "notes": [f"failed: {f['variant']} run {f['run']}: {f['error']}" for f in failures],
            "raw": results,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    sys.exit(1 if failures else 0)


def huge_page_settings():
    """The host's transparent huge page modes (the bracketed word), anonymous and shmem."""
    out = {}
    for key, name in (("anonymous", "enabled"), ("shmem", "shmem_enabled")):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                text = f.read()
            out[key] = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            out[key] = "unknown"
    return out


if __name__ == "__main__":
    main()
