#!/usr/bin/env python3
"""Warm-cache Reboot with the test guest (docs/warm-cache.md): how fast a
guest reads its disk right after an in-place reboot, with kemari's warm
cache on (--disk nbd://...,cache=SIZE) and off, and before the reboot.

The disk is a raw image served by `kemari-nbd serve` on 127.0.0.1 over TCP
(with --delay-ms N, behind `kemari-nbd relay` holding each chunk N ms each
way: a distant network disk). Each round boots
the test guest with `disk=verify,BLOCKS` (the guest reads BLOCKS 4 KiB
blocks, 32 in flight, and prints `disk: job took ms=`), asks it to reboot
(`GET /reboot` over a TAP) and reads the second boot's figure. Rounds
alternate cache off / on. Needs root (TAP), the release binaries and the
guest ELF:

    cargo build --release -p kemari -p kemari-nbd
    cargo build -p guest --target x86_64-unknown-none --release
    flock /work/bench.lock python3 scripts/warm-cache-bench.py --rounds 3 --json out.json
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = os.path.join(ROOT, "target", os.environ.get("PROFILE", "release"))
GUEST = os.path.join(ROOT, "target", "x86_64-unknown-none", "release", "guest")
TAP = f"kwcb{os.getpid() % 10000}"
SUBNET = "10.201.73"


def sh(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def wait(what, pred, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def job_ms(console, nth):
    """The nth `disk: job took ms=` figure in the console, or None."""
    found = re.findall(r"disk: job took ms=(\d+)", text(console))
    return int(found[nth - 1]) if len(found) >= nth else None


def round_(work, blocks, cache, port):
    console = os.path.join(work, f"console-{cache}.log")
    api = os.path.join(work, f"api-{cache}.sock")
    for p in (console, api):
        if os.path.exists(p):
            os.remove(p)
    disk = f"nbd://127.0.0.1:{port}/disk"
    if cache != "off":
        disk += f",cache={cache}"
    vmm = subprocess.Popen(
        [os.path.join(REL, "kemari"), "--kernel", GUEST, "--memory", "256M",
         "--cmdline", f"ip={SUBNET}.2/24 disk=verify,{blocks}",
         "--disk", disk, "--net", f"tap={TAP}",
         "--serial", f"file:{console}", "--api-socket", api],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        before = wait("the first boot's read", lambda: job_ms(console, 1))
        if "verify ok" not in text(console):
            raise SystemExit(f"verify failed:\n{text(console)}")
        wait("the guest's HTTP server", lambda: _reboot())
        after = wait("the read after the reboot", lambda: job_ms(console, 2))
        metrics = json.loads(subprocess.run(
            [os.path.join(REL, "kemarictl"), "-s", api, "metrics"],
            check=True, capture_output=True, text=True).stdout or "{}")
    finally:
        vmm.send_signal(signal.SIGTERM)
        vmm.wait(timeout=60)
    blk = [d for d in metrics.get("devices", []) if d.get("kind") == "virtio-blk"]
    return {"cache": cache, "before_ms": before, "after_ms": after,
            "cache_counters": blk[0]["counters"].get("cache") if blk else None}


def _reboot():
    try:
        with urllib.request.urlopen(f"http://{SUBNET}.2/reboot", timeout=5) as r:
            return b"rebooting" in r.read()
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=65536, help="4 KiB blocks read (65536: 256 MiB)")
    ap.add_argument("--delay-ms", type=int, default=0,
                    help="relay delay each way (0: no relay, the guest's kemari talks to the server directly)")
    ap.add_argument("--cache", default="512M")
    ap.add_argument("--json")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kemari-warm-cache-bench-")
    image = os.path.join(work, "disk.img")
    with open(image, "wb") as f:
        f.truncate(a.blocks * 4096 + (16 << 20))
    procs = []
    sh("ip", "tuntap", "add", TAP, "mode", "tap")
    try:
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", TAP)
        sh("ip", "link", "set", TAP, "up")
        nbd = os.path.join(REL, "kemari-nbd")
        procs.append(subprocess.Popen([nbd, "serve", "--export", f"disk={image}",
                                       "--listen", "127.0.0.1:10899"]))
        if a.delay_ms > 0:
            procs.append(subprocess.Popen([nbd, "relay", "--listen", "127.0.0.1:10898",
                                           "--to", "127.0.0.1:10899",
                                           "--delay-ms", str(a.delay_ms)]))
        time.sleep(1)
        fill = subprocess.run(
            [os.path.join(REL, "kemari"), "--kernel", GUEST, "--memory", "256M",
             "--cmdline", f"disk=write,{a.blocks},seq poweroff=done",
             "--disk", "nbd://127.0.0.1:10899/disk"], capture_output=True, text=True)
        if "write done" not in fill.stdout:
            raise SystemExit(f"prefill failed:\n{fill.stdout}\n{fill.stderr}")
        results = []
        for r in range(a.rounds):
            for cache in ("off", a.cache):
                res = round_(work, a.blocks, cache, 10898 if a.delay_ms > 0 else 10899)
                res["round"] = r + 1
                print(json.dumps(res), flush=True)
                results.append(res)
    finally:
        for p in procs:
            p.terminate()
        subprocess.run(["ip", "link", "del", TAP], stderr=subprocess.DEVNULL)
    mib = a.blocks * 4096 / (1 << 20)
    summary = {}
    for cache in ("off", a.cache):
        rs = [x for x in results if x["cache"] == cache]
        summary[cache] = {
            "before_mib_s": [round(mib / (x["before_ms"] / 1000), 1) for x in rs],
            "after_reboot_mib_s": [round(mib / (x["after_ms"] / 1000), 1) for x in rs],
        }
    out = {"blocks": a.blocks, "mib": mib, "delay_ms_each_way": a.delay_ms,
           "rounds": results, "summary": summary,
           "load_average": os.getloadavg()}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
