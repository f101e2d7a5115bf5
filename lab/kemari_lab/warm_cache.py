"""Warm-cache Reboot with the lab's Debian guest (docs/warm-cache.md, "Measured").

Two kemari guests on vh0 (1 vCPU, 1 GiB each), each with its own copy of a
512 MiB ext4 disk served over NBD by ``kemari-nbd serve`` in the lab
namespace (this machine, across the virtual host's network): ``warm`` opens
it with ``--disk nbd://…,cache=512M``, ``cold`` without a cache. The disk
holds ``big.bin`` (256 MiB of random data) and ``www/f000``…``f063`` (1 MiB
each, served by the guest's httpd as ``/data/…``). Alternated, ROUNDS times,
each guest in turn:

1. reads big.bin once (``/cgi-bin/read``, dd in the guest, timed with its
   clock), so that the guest's page cache holds it;
2. the client GETs the 64 files twice (``http_bench.py``, 4 at a time): the
   second pass is *before*;
3. reads big.bin again: *before*, the guest's page cache warm, right before
   the reboot (the pair then sees the same load on the machine);
4. ``reboot`` in the guest (in place: same kemari, checked by pid and
   ``reboots``), then at once the same read (*after*), once more
   (*after_again*: what a read gets once the reboot is behind it) and the
   same HTTP pass (*after*).

Goals (issue 26): warm after ≥ 10x cold after and ≥ 90% of before for the
read; HTTP after ≥ 90% of before. Besides the ratios of the medians, the
summary gives the median of each round's own after ÷ before
(``…_paired_median``): the machine's load drifts between rounds, much less
within one pair.

``KEMARI_WARM_CACHE_ALONE=1`` runs the warm (or dax) guest without the
other one: twice the rounds in the same time for its after ÷ before, no
ratio against the cold guest.

``KEMARI_WARM_CACHE_FLOOR=1`` measures the lab's floor instead of the cold
guest: a ``ram`` guest whose disk is a file in the virtual host's RAM
(tmpfs; copied there from its export with the kernel's NBD client), so
every read after its reboot is served from host memory by the shortest path
kemari has. If the cached guest reads as fast as that one, the cache is at
what the nested guest's request path allows here. Run by hand (not in CI):
``python3 -m kemari_lab run warm-cache-bench --vmm kemari``
(KEMARI_WARM_CACHE_ROUNDS and KEMARI_WARM_CACHE_HTTP_FILES shorten it: on
a loaded machine one HTTP pass of 64 MiB took 5 minutes).
``KEMARI_WARM_CACHE_HTTP_EXTRA=1`` adds two HTTP passes to each guest's
round: ``dropped`` (at the round's start, the guest's page cache dropped: the
disk path alone) and ``after_again`` (right after *after*: what the reboot
leaves behind once the files are cached again).

``KEMARI_WARM_CACHE_PMEM=1`` replaces the cached guest with a ``dax`` guest:
the virtual host's kernel NBD client connects its export to /dev/nbd1
(4 KiB blocks) and kemari gets ``--pmem /dev/nbd1`` instead of a disk — a
virtio-pmem window that is a MAP_SHARED mapping of that device, so the
virtual host's page cache of the export. The guest (``klab.disk=pmem0``)
mounts /dev/pmem0 at /mnt with ``-o dax``: big.bin is read, and www/
served, by plain copies out of the window, which the in-place reboot keeps
mapped. Every boot and every read must show the mount with ``dax`` in its
options (:func:`dax_problem`), or the run fails: a silent fallback to the
guest's page cache would make the figures meaningless. Its ratios are
``read_dax_after_over_cold_after`` (goal ≥ 10), ``read_dax_after_over_before``
(≥ 0.9) and ``http_dax_after_over_before``; ``…_after_reboot_nbd_read_mb``
is what the virtual host read over NBD for it after the reboot.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kemari_lab import images
from kemari_lab.errors import LabError, step
from kemari_lab.guests import Guest, GuestSpec
from kemari_lab.lab import Lab
from kemari_lab.netns import BRIDGE_IP
from kemari_lab.shared_disk import NBD_PORT, SharedDisk
from kemari_lab.vhost import VirtualHost

ROUNDS = 2
DISK_MB = 512
BIG_MB = 256
WWW_FILES = 64
WWW_FILE_KB = 1024
CACHE = "512M"
GUEST_MB = 1024
READ_RE = re.compile(r"KLAB-READ bytes=(\d+) start=([\d.]+) end=([\d.]+)")
READ_DISK_RE = re.compile(r"KLAB-READ-DISK ios=(\d+) sectors=(\d+)")
READ_NS_RE = re.compile(r"KLAB-READ-NS start=(\d+) end=(\d+)")
# The dax guest's window: the kernel NBD client's device in the virtual host.
PMEM_DEVICE = "/dev/nbd1"
_HTTP_BENCH = Path(__file__).resolve().parent / "http_bench.py"


def lab_options() -> dict[str, Any]:
    return {"host_memory_mb": 4096}


def build_disk(directory: Path) -> Path:
    """The benchmark's ext4 image: the guest disk's hello.txt, big.bin, www/."""
    out = directory / "warm-cache-disk.ext4"
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "hello.txt").write_text(images.GUEST_DISK_HELLO)
        with (root / "big.bin").open("wb") as f:
            for _ in range(BIG_MB):
                f.write(os.urandom(1 << 20))
        (root / "www").mkdir()
        for i in range(WWW_FILES):
            (root / "www" / f"f{i:03d}").write_bytes(os.urandom(WWW_FILE_KB << 10))
        images.run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                # The default for this size, said outright: DAX needs
                # blocks of the page size (4 KiB).
                "-b",
                "4096",
                "-L",
                "klabdisk",
                "-d",
                d,
                str(out),
                f"{DISK_MB}M",
            ]
        )
    return out


def dax_problem(text: str) -> str | None:
    """None when the last mount report in `text` (the console's ``KLAB-MOUNT
    dev=DEV opts=OPTS`` at boot, or a read's ``KLAB-READ-MOUNT DEV OPTS``)
    shows /mnt mounted from a pmem device with DAX (``dax`` or
    ``dax=always``); otherwise what is wrong."""
    reports = [line for line in text.splitlines() if "KLAB-MOUNT " in line or "KLAB-READ-MOUNT" in line]
    if not reports:
        return "no mount report (KLAB-MOUNT) from the guest"
    fields = reports[-1].split("MOUNT", 1)[1].split()
    dev = fields[0].removeprefix("dev=") if fields else ""
    opts = fields[1].removeprefix("opts=") if len(fields) > 1 else ""
    if not dev.startswith("/dev/pmem") or not opts:
        return f"/mnt is not mounted from a pmem device: {reports[-1].strip()!r}"
    if not {"dax", "dax=always"} & set(opts.split(",")):
        return f"/mnt is mounted without DAX ({dev} {opts})"
    return None


def read_seconds(body: str) -> float | None:
    """How long the guest's read of big.bin took by its own clock: the
    nanosecond stamps (KLAB-READ-NS) where the guest had them, else its
    /proc/uptime (10 ms steps, at least 10 ms). None unless the answer
    reports the whole file read."""
    m = READ_RE.search(body)
    if m is None or int(m.group(1)) != BIG_MB << 20:
        return None
    ns = READ_NS_RE.search(body)
    if ns is not None and int(ns.group(2)) > int(ns.group(1)) > 0:
        return (int(ns.group(2)) - int(ns.group(1))) / 1e9
    return max(float(m.group(3)) - float(m.group(2)), 0.01)


def read_big_file(
    lab: Lab,
    ip: str,
    out: dict[str, float],
    key: str,
    dax: bool = False,
    cpu: tuple[VirtualHost, dict[str, int]] | None = None,
) -> None:
    """The guest reads big.bin once: out[key + "_mb_s"], MB/s as its clock
    measured it, and out[key + "_disk_requests"], the read requests its disk
    saw meanwhile (none when the page cache had it all, nor through DAX but
    for metadata). With `dax`, the mount must be DAX (:func:`dax_problem`).
    With `cpu` (the virtual host, each guest's kemari pid), also
    out[key + "_cpu_s_" + name]: the CPU seconds each kemari and the
    virtual host (``vh``) used meanwhile, and out[key + "_" + name +
    "_vcpu0_on"]: the virtual host's CPU its vCPU 0 thread ran on last
    (:func:`cpu_seconds`)."""
    # 256 MiB at 0.9 MB/s, under the slowest read seen (2 MB/s, a loaded
    # machine): a guest that crashed mid-read (docs/lab.md, issue 24) is
    # reported, with its diagnostics, within minutes.
    c0 = cpu_seconds(*cpu) if cpu else {}
    body = lab.client_http_get(ip, "/cgi-bin/read?big.bin", timeout=300)
    if cpu:
        # What each kemari and the virtual host used while it read (and the
        # two round trips around the request: the same for every read).
        for k, v in cpu_seconds(*cpu).items():
            if k.endswith("_vcpu0_on"):
                out[f"{key}_{k}"] = v
            else:
                out[f"{key}_cpu_s_{k}"] = v - c0[k]
    seconds = read_seconds(body)
    if seconds is None:
        raise LabError(f"guest {ip}: reading big.bin answered {body.strip()!r}")
    out[f"{key}_mb_s"] = (BIG_MB << 20) / seconds / 1e6
    d = READ_DISK_RE.search(body)
    if d is not None:
        out[f"{key}_disk_requests"] = float(d.group(1))
    if dax and (problem := dax_problem(body)) is not None:
        raise LabError(f"guest {ip}, {key}: {problem}; the read is not a DAX read:\n{body.strip()}")


def http_mb_s(lab: Lab, ip: str) -> float:
    """The client GETs the guest's files (the first HTTP_FILES) once, 4 at a time; MB/s."""
    files = int(os.environ.get("KEMARI_WARM_CACHE_HTTP_FILES", WWW_FILES))
    cmd = [
        sys.executable,
        str(_HTTP_BENCH),
        ip,
        "data/f",
        str(files),
        "--concurrency",
        "4",
    ]
    proc = lab.client(cmd, timeout=900)
    try:
        res = json.loads(proc.stdout)
    except ValueError:
        raise LabError(
            f"http_bench against {ip} printed {proc.stdout!r} ({proc.stderr.strip()})"
        ) from None
    if res["errors"] or res["bytes"] != files * (WWW_FILE_KB << 10):
        raise LabError(f"http_bench against {ip}: {res}")
    return float(res["mb_s"])


def copy_to_ram(host: VirtualHost, port: int, export: str) -> str:
    """Copies `export` into the virtual host's tmpfs with the kernel's NBD
    client; returns the file's path (the ram guest's disk)."""
    path = f"/tmp/{export}.disk"
    with step(f"{host.name}: copying export {export!r} into {path}"):
        host.run(f"/sbin/nbd-client {BRIDGE_IP} {port} /dev/nbd0 -N {export} -b 512")
        try:
            host.run(f"dd if=/dev/nbd0 of={path} bs=1M 2>&1 | tail -1", timeout=600)
        finally:
            host.run("/sbin/nbd-client -d /dev/nbd0", check=False)
    return path


def connect_pmem(host: VirtualHost, port: int, export: str) -> None:
    """Connects the virtual host's kernel NBD client to `export` as
    PMEM_DEVICE (4 KiB blocks), the dax guest's --pmem; checks its size."""
    with step(f"{host.name}: connecting export {export!r} to {PMEM_DEVICE}"):
        host.run(f"/sbin/nbd-client {BRIDGE_IP} {port} {PMEM_DEVICE} -N {export} -b 4096")
        size = host.run(f"blockdev --getsize64 {PMEM_DEVICE}").output.strip()
        if size != str(DISK_MB << 20):
            raise LabError(f"{host.name}: {PMEM_DEVICE} has {size} bytes, not {DISK_MB} MiB")


def disconnect_pmem(host: VirtualHost) -> None:
    """Best effort: the virtual host may be gone already."""
    try:
        host.run(f"/sbin/nbd-client -d {PMEM_DEVICE}", check=False, timeout=60)
    except LabError:
        pass


def nbd_read_mb(host: VirtualHost) -> float:
    """MiB the virtual host has read from PMEM_DEVICE so far (block/stat.rst)."""
    fields = host.run(f"cat /sys/block/{PMEM_DEVICE.rsplit('/', 1)[1]}/stat").output.split()
    return int(fields[2]) * 512 / (1 << 20)


def cpu_seconds(host: VirtualHost, pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each guest's kemari (its threads' user and
    system time) and by the virtual host as a whole (``vh``: every CPU's
    busy time, /proc/stat), for what ran beside a read."""
    lines = host.run(
        "head -1 /proc/stat; " + "; ".join(f"cat /proc/{pid}/stat" for pid in pids.values())
        # Which of the virtual host's CPUs each vCPU 0 thread last ran on.
        + "; " + "; ".join(f"grep -h '(vcpu0)' /proc/{pid}/task/*/stat || echo -" for pid in pids.values())
    ).output.splitlines()
    hz = 100  # USER_HZ
    # user nice system idle iowait irq softirq steal …: all but idle and iowait.
    ticks = [int(x) for x in lines[0].split()[1:9]]
    out = {"vh": (sum(ticks) - ticks[3] - ticks[4]) / hz}
    for name, line in zip(pids, lines[1:]):
        if ")" not in line:
            # `cat` said why instead: that kemari has exited (a guest's
            # platform triple fault, say); the caller's diagnostics tell.
            raise LabError(f"{host.name}: {name}'s kemari (pid {pids[name]}) is gone: {line.strip()}")
        # After "(comm)": field 3 (state) first; utime is field 14, stime 15.
        f = line.rsplit(")", 1)[1].split()
        out[name] = (int(f[11]) + int(f[12])) / hz
    for name, line in zip(pids, lines[1 + len(pids) :]):
        f = line.rsplit(")", 1)[1].split() if ")" in line else []
        # Field 39: the CPU it last ran on.
        out[f"{name}_vcpu0_on"] = float(f[36]) if len(f) > 36 else -1.0
    return out


def check_dax_mount(guest: Guest) -> None:
    """The guest's last boot mounted /dev/pmem0 with DAX, or the run fails
    with what the guest and kemari said."""
    console = guest.console_text()
    problem = dax_problem(console)
    if problem is None:
        return
    said = "\n".join(
        line for line in console.splitlines() if re.search(r"KLAB-(MOUNT|DMESG|DISK|FS|WARN)", line)
    )
    try:
        # A JSON list (Guest.ctl takes objects): the pmem0 device, its window.
        devices = guest.host.run(f"kemarictl -s {guest.spec.api_socket} devices", check=False).output
    except LabError as e:
        devices = str(e)
    raise LabError(
        f"guest {guest.spec.name}: {problem}\n{said[-3000:]}\nkemarictl devices: {devices[:2000]}"
    )


def cache_counters(guest: Guest) -> dict[str, float]:
    """The disk cache's counters from `kemarictl metrics` (empty without a cache)."""

    def find(node: Any) -> dict[str, Any] | None:
        if isinstance(node, dict):
            if "hit_bytes" in node and "miss_bytes" in node:
                return node
            for v in node.values():
                if (found := find(v)) is not None:
                    return found
        elif isinstance(node, list):
            for v in node:
                if (found := find(v)) is not None:
                    return found
        return None

    c = find(guest.ctl("metrics")) or {}
    return {k: float(v) for k, v in c.items() if isinstance(v, (int, float))}


def reboot(lab: Lab, guest: Guest, boots: int, pid: int) -> float:
    """`reboot` in the guest; waits until it is ready again in the same kemari.
    Returns the seconds from the request to KLAB-GUEST-READY."""
    t0 = time.monotonic()
    lab.client_http_get(guest.spec.ip, "/cgi-bin/reboot")
    deadline = t0 + 300
    while True:
        console = guest.host.run(f"cat {guest.console}").output
        if console.count("KLAB-GUEST-READY") > boots:
            break
        if "KLAB-VMM-EXIT" in console or time.monotonic() > deadline:
            raise LabError(
                f"guest {guest.spec.name} did not come back from its reboot:\n{console[-3000:]}"
            )
        time.sleep(0.5)
    took = time.monotonic() - t0
    info = guest.info()
    if (
        info.get("pid") != pid
        or info.get("reboots") != boots
        or info.get("state") != "running"
    ):
        raise LabError(
            f"guest {guest.spec.name} after reboot {boots}: kemari answers {info} (pid was {pid})"
        )
    lab.wait_client_reach(guest.spec.ip, timeout=120)
    return took


def pmem_host_state(host: VirtualHost) -> str:
    """The virtual host's side of the dax guest's window, best effort: load,
    NBD requests in flight on PMEM_DEVICE, dirty and writeback memory, and
    every task in uninterruptible sleep with where it waits (a window whose
    NBD connection stopped shows here as kemari's threads waiting on it)."""
    dev = PMEM_DEVICE.rsplit("/", 1)[1]
    cmd = (
        f"echo \"load $(cut -d' ' -f1-3 /proc/loadavg) {dev} in flight (reads, writes)"
        f" $(cat /sys/block/{dev}/inflight | tr -s ' ')"
        f" $(grep -E '^(MemFree|Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\\n' ' ')\"; "
        "for t in /proc/[0-9]*/task/[0-9]*; do read -r st < $t/stat 2>/dev/null || continue; "
        "case \"$st\" in *') D '*) echo \"D $(cat $t/comm) $(cat $t/wchan)\";; esac; done"
    )
    try:
        return f"{host.name}: " + host.run(cmd, timeout=30, check=False).output.strip()
    except LabError as e:
        return f"{host.name}: no answer ({str(e).splitlines()[0]})"


@contextlib.contextmanager
def _diagnosed(guests: Iterable[Guest], pmem_host: VirtualHost | None = None) -> Iterator[None]:
    """Adds every guest's diagnostics (devices, TAP, console with kemari's
    log) to a LabError raised inside: a read that never answers says why
    (a guest that crashed, a device that stopped). With `pmem_host`, that
    host's side of the dax guest's window first (:func:`pmem_host_state`)."""
    try:
        yield
    except LabError as e:
        notes = [pmem_host_state(pmem_host)] if pmem_host is not None else []
        notes += [g.diagnostics(console_chars=3000) for g in guests]
        raise LabError(f"{e}\n" + "\n".join(notes)) from None


def bench(lab: Lab, vmm: str) -> dict[str, float]:
    """Warm-cache Reboot, Debian guest, disk over NBD: reads and HTTP right
    after an in-place reboot with kemari's disk cache vs without, vs before"""
    if vmm != "kemari":
        raise LabError(
            f"warm-cache-bench measures kemari's disk cache (--vmm kemari), not {vmm}"
        )
    host = lab.hosts[0]
    out: dict[str, float] = {}
    servers: list[SharedDisk] = []
    pmem = os.environ.get("KEMARI_WARM_CACHE_PMEM") == "1"
    try:
        names: tuple[str, ...] = (
            "dax" if pmem else "warm",
            "ram" if os.environ.get("KEMARI_WARM_CACHE_FLOOR") == "1" else "cold",
        )
        if os.environ.get("KEMARI_WARM_CACHE_ALONE") == "1":
            names = names[:1]
        with step("building and serving the disks"):
            image = build_disk(lab.run_dir)
            for i, name in enumerate(names):
                servers.append(
                    SharedDisk(
                        lab, export=name, port=NBD_PORT + 2 * i, source=image
                    ).start()
                )
            image.unlink()
        guests: dict[str, Guest] = {}
        for i, (name, server) in enumerate(zip(names, servers)):
            url = server.url + (f",cache={CACHE}" if name == "warm" else "")
            if name == "ram":
                url = copy_to_ram(host, NBD_PORT + 2 * i, name)
            if name == "dax":
                connect_pmem(host, NBD_PORT + 2 * i, name)
            spec = GuestSpec(
                name=name,
                vmm="kemari",
                index=i,
                vcpus=1,
                memory_mb=GUEST_MB,
                disk=name != "dax",
                disk_url=url,
                pmem=PMEM_DEVICE if name == "dax" else None,
            )
            guests[name] = Guest(host, spec)
            guests[name].start()
        for g in guests.values():
            g.check_boot(g.wait_ready(timeout=600))
            if g.spec.pmem:
                check_dax_mount(g)
            lab.wait_client_reach(g.spec.ip, timeout=120)
        pids = {n: int(g.info()["pid"]) for n, g in guests.items()}
        boots = {n: 0 for n in guests}
        extra = os.environ.get("KEMARI_WARM_CACHE_HTTP_EXTRA") == "1"
        for r in range(1, int(os.environ.get("KEMARI_WARM_CACHE_ROUNDS", ROUNDS)) + 1):
            order = names if r % 2 else names[::-1]
            for name in order:
                g, ip, p = guests[name], guests[name].spec.ip, f"{name}_r{r}"
                dax = name == "dax"
                with step(f"round {r}, {name}"), _diagnosed(guests.values(), host if pmem else None):
                    if extra:
                        # The disk path alone, no reboot: the guest's page
                        # cache dropped (/cgi-bin/disk syncs a token, then
                        # drops it), the pass of the round before again
                        # (first, so that the reads below find big.bin cached).
                        lab.client_http_get(ip, "/cgi-bin/disk?warm-cache-bench")
                        out[f"{p}_http_dropped_mb_s"] = http_mb_s(lab, ip)
                    read_big_file(lab, ip, out, f"{p}_read_first", dax)
                    out[f"{p}_http_first_mb_s"] = http_mb_s(lab, ip)
                    out[f"{p}_http_before_mb_s"] = http_mb_s(lab, ip)
                    read_big_file(lab, ip, out, f"{p}_read_before", dax, (host, pids))
                    c0 = cache_counters(g)
                    n0 = nbd_read_mb(host) if dax else 0.0
                    boots[name] += 1
                    out[f"{p}_reboot_to_ready_s"] = reboot(
                        lab, g, boots[name], pids[name]
                    )
                    if dax:
                        check_dax_mount(g)
                    read_big_file(lab, ip, out, f"{p}_read_after", dax, (host, pids))
                    read_big_file(lab, ip, out, f"{p}_read_after_again", dax, (host, pids))
                    out[f"{p}_http_after_mb_s"] = http_mb_s(lab, ip)
                    if extra:
                        # Once more, every file in the page cache again: what
                        # the reboot left behind beyond the first pass.
                        out[f"{p}_http_after_again_mb_s"] = http_mb_s(lab, ip)
                    if dax:
                        # What the window's reads after the reboot cost the
                        # virtual host over NBD (0: all still mapped).
                        out[f"{p}_after_reboot_nbd_read_mb"] = nbd_read_mb(host) - n0
                    c1 = cache_counters(g)
                    for k in ("hit_bytes", "miss_bytes"):
                        if k in c1:
                            out[
                                f"{p}_after_reboot_cache_{k.replace('_bytes', '')}_mb"
                            ] = (c1[k] - c0.get(k, 0.0)) / (1 << 20)
                    (lab.run_dir / "warm-cache-bench.json").write_text(
                        json.dumps({k: round(v, 3) for k, v in out.items()}, indent=1)
                    )
        for g in guests.values():
            lab.client_http_get(g.spec.ip, "/cgi-bin/poweroff")
        if pmem:
            # kemari unmaps the window before the device is disconnected.
            status = guests["dax"].wait_exit(timeout=120)
            if status != 0:
                raise LabError(f"kemari of the dax guest exited {status} after the guest's poweroff")
    finally:
        if pmem:
            disconnect_pmem(host)
        for s in servers:
            s.stop()
            s.image.unlink(missing_ok=True)  # 512 MiB each, not kept with the run
    out.update(summary(out))
    return out


def summary(times: dict[str, float]) -> dict[str, float]:
    """Medians over the rounds and the ratios the goals name."""

    def med(key: str) -> float:
        vals = [v for k, v in times.items() if re.fullmatch(key, k)]
        return statistics.median(vals) if vals else float("nan")

    def paired(name: str, what: str) -> float:
        """The median of each round's own after ÷ before."""
        ratios = [
            times[k.replace("_before_", "_after_")] / v
            for k, v in times.items()
            if re.fullmatch(rf"{name}_r\d+_{what}_before_mb_s", k)
            and k.replace("_before_", "_after_") in times
            and v > 0
        ]
        return statistics.median(ratios) if ratios else float("nan")

    # The guest kept warm: kemari's disk cache, or (KEMARI_WARM_CACHE_PMEM=1)
    # a DAX mount of a virtio-pmem window.
    warm = "dax" if any(k.startswith("dax_") for k in times) else "warm"
    # The other guest: without a cache, or (the floor run) with its disk in RAM.
    other = "ram" if any(k.startswith("ram_") for k in times) else "cold"
    s: dict[str, float] = {}
    alone = not any(k.startswith(f"{other}_") for k in times)
    for name in (warm,) if alone else (warm, other):
        for what in ("read_before", "read_after", "read_after_again", "http_before", "http_after"):
            s[f"{name}_{what}_median_mb_s"] = med(rf"{name}_r\d+_{what}_mb_s")
        for what in ("read", "http"):
            s[f"{what}_{name}_after_over_before_paired_median"] = paired(name, what)
        for what in ("http_dropped", "http_after_again"):
            if any(re.fullmatch(rf"{name}_r\d+_{what}_mb_s", k) for k in times):
                s[f"{name}_{what}_median_mb_s"] = med(rf"{name}_r\d+_{what}_mb_s")
                s[f"{name}_{what}_over_before"] = (
                    s[f"{name}_{what}_median_mb_s"] / s[f"{name}_http_before_median_mb_s"]
                )
    if alone:
        s[f"read_{warm}_after_over_before"] = (
            s[f"{warm}_read_after_median_mb_s"] / s[f"{warm}_read_before_median_mb_s"]
        )
        s[f"http_{warm}_after_over_before"] = (
            s[f"{warm}_http_after_median_mb_s"] / s[f"{warm}_http_before_median_mb_s"]
        )
        return s
    # Against the RAM disk, 1.0 means the cache is at the lab's floor.
    s[f"read_{warm}_after_over_{other}_after"] = (
        s[f"{warm}_read_after_median_mb_s"] / s[f"{other}_read_after_median_mb_s"]
    )
    s[f"read_{other}_after_over_before"] = (
        s[f"{other}_read_after_median_mb_s"] / s[f"{other}_read_before_median_mb_s"]
    )
    if other == "ram":
        return s
    s[f"read_{warm}_after_over_before"] = (
        s[f"{warm}_read_after_median_mb_s"] / s[f"{warm}_read_before_median_mb_s"]
    )
    s[f"http_{warm}_after_over_before"] = (
        s[f"{warm}_http_after_median_mb_s"] / s[f"{warm}_http_before_median_mb_s"]
    )
    s["http_cold_after_over_before"] = (
        s["cold_http_after_median_mb_s"] / s["cold_http_before_median_mb_s"]
    )
    return s
