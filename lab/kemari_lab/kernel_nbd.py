"""The Linux kernel's NBD client against kemari-nbd's target and proxy (issue #8).

Virtual hosts load the kernel's ``nbd`` module at boot (``images.HOST_MODULES``:
/dev/nbd0 … /dev/nbd15) and carry Debian's ``nbd-client`` as /sbin/nbd-client
(``images.HOST_TOOLS``), which negotiates with the server (fixed newstyle,
``NBD_OPT_GO``) and hands the socket to the kernel over netlink. (This
machine's kernel has no nbd module, hence a virtual host.) The ``kernel-nbd``
scenario::

    this machine, netns klab-<pid>     (both images start as the same pseudo-random bytes)
      kemari-nbd serve --export target=<run>/shared-target.img --listen 10.77.0.1:10809
      kemari-nbd serve --export origin=<run>/shared-origin.img --listen 10.77.0.1:10811
      kemari-nbd proxy --upstream nbd://10.77.0.1:10811/origin --export relocated --no-background
                       --no-auto-cutover --cache <run>/proxy-relocated-cache --control …
                       --listen 10.77.0.1:10810
      kemari-nbd serve --export disk=<run>/shared-disk.ext4 --listen 10.77.0.1:10812   (the guest disk)
      kemari-nbd proxy --upstream nbd://10.77.0.1:10812/disk --export fs --rate-limit 1M
                       --no-auto-cutover … --listen 10.77.0.1:10813
    vh0: nbd-client 10.77.0.1 10809 /dev/nbd0 -N target -b 512     (then 10810 -N relocated, 10813 -N fs)

For each server, in the virtual host (:func:`round_trip`): connect; the
device must have the export's size to the byte (``blockdev --getsize64``,
/sys/block/nbd0/size); write slices of a random pattern file (:data:`WRITES`:
through the page cache and with O_DIRECT, at an offset inside a 4 KiB
block, across the proxy's 16 MiB access-count groups, the last block);
``sync``, flush the device's buffers, drop the caches; read each write
back from the server and compare its SHA-256 with the pattern slice's; hash
the whole device; disconnect. Then, on this machine, the image the server
wrote — the target's file, or the proxy's cache file after ``kemari-nbd
cutover --wait`` — must hold what the virtual host wrote at each write, the
original bytes everywhere else, and hash as the kernel read it
(:func:`image_problems`). The proxy's
background copy is paused and it cuts over only when told, so what it holds
came through on-demand fetches (the kernel's reads, and the blocks around
partial writes); its upstream image must come out unchanged.

Last, a file-system round trip (:func:`fs_round_trip`) through a proxy whose
background copy runs, rate-limited so that the kernel works mid-copy: mount
the guest disk's ext4 from /dev/nbd0, read /hello.txt, write a token and the
pattern file, unmount, disconnect; after ``cutover --wait`` (which lifts the
limit) ``e2fsck -f -n`` finds the proxy's cache file clean and ``debugfs``
reads both files back from it (:func:`check_fs_image`).
"""

from __future__ import annotations

import hashlib
import random
import re
import secrets
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kemari_lab import images
from kemari_lab.errors import LabError, step
from kemari_lab.lab import Lab
from kemari_lab.netns import BRIDGE_IP
from kemari_lab.shared_disk import (
    NBD_PORT,
    PROXY_PORT,
    RelocationProxy,
    SharedDisk,
    debugfs_cat,
)
from kemari_lab.vhost import VirtualHost

KiB = 1024
MiB = 1024 * KiB
# Not a whole number of MiB: the device must show the size to the byte.
EXPORT_SIZE = 16 * MiB + 20 * KiB
ORIGIN_PORT = PROXY_PORT + 1
FS_ORIGIN_PORT = PROXY_PORT + 2
FS_PROXY_PORT = PROXY_PORT + 3
DEVICE = "/dev/nbd0"
SYSFS_SECTORS = "/sys/block/nbd0/size"
NBD_CLIENT = "/sbin/nbd-client"
# Made in the virtual host from /dev/urandom; the writes copy slices of it.
PATTERN = "/tmp/klab-nbd-pattern"
PATTERN_SIZE = 4 * MiB
_READ_BACK = "/tmp/klab-nbd-read"
_WANTED = "/tmp/klab-nbd-wanted"
# What the file-system round trip writes on the guest disk's ext4.
FS_TOKEN = "/klab-nbd-token.txt"
FS_PATTERN = "/klab-nbd-pattern"
_SHA_RE = re.compile(r"^([0-9a-f]{64})\s+(\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class Write:
    """`length` bytes of the pattern file from its offset `source`, written to
    the device at `offset` by one dd with block size `bs`. With `direct`
    (O_DIRECT) each dd block is one request to the server, page cache bypassed."""

    what: str
    offset: int
    length: int
    source: int
    bs: int
    direct: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    def _dd(self, src: str, dst: str, skip: int, seek: int | None = None, direct: bool = False) -> str:
        cmd = f"dd if={src} of={dst} bs={self.bs} count={self.length // self.bs} skip={skip} iflag=skip_bytes"
        if seek is not None:
            cmd += f" seek={seek} conv=notrunc oflag=seek_bytes" + (",direct" if direct else "")
        return cmd

    def write_command(self) -> str:
        """The dd that writes this slice of the pattern to the device."""
        return self._dd(PATTERN, DEVICE, self.source, seek=self.offset, direct=self.direct)

    def read_back_command(self) -> str:
        """Reads the range back from the device and the slice from the pattern;
        prints both SHA-256 sums (device first)."""
        return (
            f"{self._dd(DEVICE, _READ_BACK, self.offset)} && {self._dd(PATTERN, _WANTED, self.source)}"
            f" && sha256sum {_READ_BACK} {_WANTED}"
        )


WRITES = (
    Write("the first MiB, through the page cache", 0, 1 * MiB, source=0, bs=64 * KiB),
    Write(
        "5.5 KiB at a 512-byte offset, O_DIRECT (one request, partial 4 KiB blocks at both ends)",
        5 * MiB + 1536,
        5632,
        source=1 * MiB + 1000,
        bs=5632,
        direct=True,
    ),
    Write(
        "1 MiB + 1 KiB across the 16 MiB boundary, O_DIRECT",
        15 * MiB + 512,
        1 * MiB + 1 * KiB,
        source=2 * MiB + 7,
        bs=1 * MiB + 1 * KiB,
        direct=True,
    ),
    Write("the last 4 KiB block, through the page cache", EXPORT_SIZE - 4 * KiB, 4 * KiB, source=3 * MiB, bs=4 * KiB),
)


@dataclass
class RoundTrip:
    """What the virtual host wrote and read through the kernel client."""

    # SHA-256 of the pattern slice each write copied (what the image must hold there).
    written: dict[Write, str]
    # SHA-256 of the whole device as the kernel read it back from the server.
    device_sha256: str
    times: dict[str, float] = field(default_factory=dict)


def _sha256_lines(output: str) -> dict[str, str]:
    return {path: digest for digest, path in _SHA_RE.findall(output)}


def prepare_host(host: VirtualHost) -> None:
    """Checks the virtual host's kernel client is there (module, device,
    nbd-client) and makes the pattern file."""
    with step(f"{host.name}: checking the nbd module and {NBD_CLIENT}"):
        host.run(f"test -d /sys/module/nbd && test -b {DEVICE} || {{ echo 'no nbd module or no {DEVICE}'; exit 1; }}")
        host.run(f"test -x {NBD_CLIENT} || {{ echo '{NBD_CLIENT} is not in the initramfs'; exit 1; }}")
    with step(f"{host.name}: making the pattern file"):
        host.run(f"head -c {PATTERN_SIZE} /dev/urandom > {PATTERN}")


def connect(host: VirtualHost, port: int, export: str, size: int) -> None:
    """nbd-client connects /dev/nbd0 to BRIDGE_IP:port/export; the device must
    then have `size` bytes (blockdev and sysfs)."""
    with step(f"{host.name}: connecting {DEVICE} to {BRIDGE_IP}:{port} export {export!r}"):
        host.run(f"{NBD_CLIENT} {BRIDGE_IP} {port} {DEVICE} -N {export} -b 512")
    with step(f"{host.name}: the size of {DEVICE}"):
        out = host.run(f"blockdev --getsize64 {DEVICE}; cat {SYSFS_SECTORS}").output.split()
        if out != [str(size), str(size // 512)]:
            raise LabError(f"expected {size} bytes ({size // 512} sectors), blockdev and sysfs say {out}")


def disconnect(host: VirtualHost, timeout: float = 20) -> None:
    """nbd-client -d; waits until the device has no size left."""
    with step(f"{host.name}: disconnecting {DEVICE}"):
        host.run(f"{NBD_CLIENT} -d {DEVICE}")
        deadline = time.monotonic() + timeout
        while (left := host.run(f"cat {SYSFS_SECTORS}").output.strip()) != "0":
            if time.monotonic() > deadline:
                raise LabError(f"{DEVICE} still has {left} sectors {timeout:.0f} s after nbd-client -d")
            time.sleep(0.2)


def sha256_of(host: VirtualHost, path: str) -> str:
    """SHA-256 of a file or device on the virtual host (busybox sha256sum)."""
    res = host.run(f"sha256sum {path}")
    digest = _sha256_lines(res.output).get(path)
    if digest is None:
        raise LabError(f"{host.name}: no checksum in the output of `{res.command}`:\n{res.output}")
    return digest


def round_trip(host: VirtualHost, port: int, export: str, size: int) -> RoundTrip:
    """Connects /dev/nbd0 to the export, writes :data:`WRITES`, reads them
    back through the server, hashes the device and disconnects. Raises
    LabError naming the step."""
    times: dict[str, float] = {}
    t0 = time.monotonic()
    connect(host, port, export, size)
    times["connect_s"] = time.monotonic() - t0
    t = time.monotonic()
    for w in WRITES:
        with step(f"{host.name}: writing {w.what} at {w.offset}"):
            host.run(w.write_command())
    with step(f"{host.name}: sync, flushing {DEVICE}'s buffers, dropping caches"):
        host.run(f"sync && blockdev --flushbufs {DEVICE} && echo 3 > /proc/sys/vm/drop_caches")
    times["write_s"] = time.monotonic() - t
    t = time.monotonic()
    written: dict[Write, str] = {}
    for w in WRITES:
        with step(f"{host.name}: reading back {w.what} at {w.offset}"):
            res = host.run(w.read_back_command())
            sums = _sha256_lines(res.output)
            got, want = sums.get(_READ_BACK), sums.get(_WANTED)
            if got is None or want is None:
                raise LabError(f"no checksums in the output of `{res.command}`:\n{res.output}")
            if got != want:
                raise LabError(f"{DEVICE} [{w.offset}, {w.end}) reads back with SHA-256 {got}, the pattern has {want}")
            written[w] = want
    with step(f"{host.name}: hashing the whole of {DEVICE}"):
        device_sha = sha256_of(host, DEVICE)
    times["read_s"] = time.monotonic() - t
    disconnect(host)
    times["total_s"] = time.monotonic() - t0
    return RoundTrip(written, device_sha, times)


def fs_round_trip(host: VirtualHost, port: int, export: str, size: int) -> dict[str, str]:
    """Mounts the ext4 file system of the export (the guest disk) from
    /dev/nbd0, checks /hello.txt, writes a random token to :data:`FS_TOKEN`
    and the pattern file to :data:`FS_PATTERN`, unmounts and disconnects.
    Returns the file name -> the contents the image must hold (the pattern's
    as its SHA-256)."""
    token = secrets.token_hex(16)
    connect(host, port, export, size)
    with step(f"{host.name}: mounting {DEVICE} (ext4) on /mnt"):
        host.run(f"mount -t ext4 {DEVICE} /mnt")
    with step(f"{host.name}: the file system on {DEVICE}"):
        hello = host.run("cat /mnt/hello.txt").output
        if hello != images.GUEST_DISK_HELLO:
            raise LabError(f"/hello.txt reads {hello!r}, the image has {images.GUEST_DISK_HELLO!r}")
        host.run(f"echo {token} > /mnt{FS_TOKEN} && cp {PATTERN} /mnt{FS_PATTERN}")
        pattern_sha = sha256_of(host, PATTERN)
        host.run("umount /mnt")
    disconnect(host)
    return {FS_TOKEN: token + "\n", FS_PATTERN: pattern_sha}


def _first_difference(data: bytes, base: bytes, start: int, end: int) -> int | None:
    """The first offset in [start, end) where `data` and `base` differ, or None."""
    if data[start:end] == base[start:end]:
        return None
    for pos in range(start, end, 4 * KiB):
        hi = min(pos + 4 * KiB, end)
        if data[pos:hi] != base[pos:hi]:
            return next(i for i in range(pos, hi) if data[i] != base[i])
    return None


def image_problems(data: bytes, base: bytes, written: Mapping[Write, str], device_sha256: str) -> list[str]:
    """How an export's image after the round trip differs from what it must be:
    the pattern's bytes at each write (by SHA-256, as the virtual host reported
    them), the original `base` bytes everywhere else, and as a whole the bytes
    the kernel read. Empty if it is right."""
    problems = []
    if len(data) != len(base):
        problems.append(f"{len(data)} bytes, the export had {len(base)}")
    pos = 0
    for w in sorted(written, key=lambda w: w.offset):
        got = hashlib.sha256(data[w.offset : w.end]).hexdigest()
        if got != written[w]:
            problems.append(
                f"{w.what}, bytes [{w.offset}, {w.end}): SHA-256 {got}, the virtual host wrote {written[w]}"
            )
        diff = _first_difference(data, base, pos, w.offset)
        if diff is not None:
            problems.append(
                f"bytes [{pos}, {w.offset}), which nothing wrote, differ from the original at offset {diff}"
                f" ({data[diff]:#04x}, was {base[diff]:#04x})"
            )
        pos = w.end
    diff = _first_difference(data, base, pos, len(base))
    if diff is not None:
        problems.append(f"bytes [{pos}, {len(base)}), which nothing wrote, differ from the original at offset {diff}")
    got = hashlib.sha256(data).hexdigest()
    if got != device_sha256:
        problems.append(f"SHA-256 of the whole image {got}, the kernel read {device_sha256} from {DEVICE}")
    return problems


def check_image(image: Path, base: bytes, trip: RoundTrip) -> None:
    """Raises LabError listing every difference (:func:`image_problems`) of `image`."""
    problems = image_problems(image.read_bytes(), base, trip.written, trip.device_sha256)
    if problems:
        raise LabError(f"{image} is not what the kernel client wrote:\n  " + "\n  ".join(problems))


def check_fs_image(image: Path, files: Mapping[str, str]) -> None:
    """e2fsck finds the ext4 file system in `image` clean, and it holds `files`
    (:func:`fs_round_trip`) and the guest disk's /hello.txt."""
    proc = subprocess.run(["e2fsck", "-f", "-n", str(image)], capture_output=True, text=True, check=False, timeout=60)
    if proc.returncode != 0:
        raise LabError(f"e2fsck -f -n {image} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    for path, want in {**files, "/hello.txt": images.GUEST_DISK_HELLO}.items():
        data = debugfs_cat(image, path)
        got = hashlib.sha256(data).hexdigest() if path == FS_PATTERN else data.decode(errors="replace")
        if got != want:
            raise LabError(f"{image}: {path} holds {got!r}, the virtual host wrote {want!r}")


def kernel_nbd(lab: Lab, vmm: str) -> dict[str, float]:
    """The Linux kernel's NBD client in vh0 (nbd-client) against kemari-nbd's
    target and proxy: device size, writes at odd offsets, read-back, and the
    image on this machine byte-checked; then an ext4 round trip through a
    proxy mid-copy. No VMM (--vmm is ignored)."""
    host = lab.hosts[0]
    base_image = lab.run_dir / "kernel-nbd-base.img"
    base = random.Random(0x4B4E4244).randbytes(EXPORT_SIZE)
    base_image.write_bytes(base)
    prepare_host(host)
    target = SharedDisk(lab, "target", NBD_PORT, source=base_image)
    origin = SharedDisk(lab, "origin", ORIGIN_PORT, source=base_image)
    # Neither a background copy nor an automatic cut-over: the kernel's reads and
    # partial writes alone make the proxy fetch, and `cutover --wait` ends it.
    proxy = RelocationProxy(lab, origin.url, extra_args=("--no-background", "--no-auto-cutover"))
    disk = SharedDisk(lab, "disk", FS_ORIGIN_PORT)
    # The background copy runs, slowly: the kernel mounts and writes mid-copy.
    fs_proxy = RelocationProxy(lab, disk.url, "fs", FS_PROXY_PORT, ("--rate-limit", "1M", "--no-auto-cutover"))
    times: dict[str, float] = {}
    try:
        with step("the kernel client against kemari-nbd serve"):
            target.start()
            trip = round_trip(host, target.port, target.export, EXPORT_SIZE)
            times.update({f"target_{k}": v for k, v in trip.times.items()})
            target.check_serving()
            check_image(target.image, base, trip)
        with step("the kernel client against kemari-nbd proxy"):
            origin.start()
            proxy.start()
            trip = round_trip(host, proxy.port, proxy.export, EXPORT_SIZE)
            times.update({f"proxy_{k}": v for k, v in trip.times.items()})
            status = proxy.status()
            images.log(f"proxy after the kernel client: {status}")
            if status["cut_over"] or status["ondemand_bytes"] == 0:
                raise LabError(f"expected on-demand fetches and no cut-over yet: status {status}")
            t = time.monotonic()
            proxy.cutover()
            times["proxy_cutover_s"] = time.monotonic() - t
            proxy.stop()
            check_image(proxy.cache_image, base, trip)
            origin.stop()
            if origin.image.read_bytes() != base:
                raise LabError(f"the proxy's upstream image {origin.image} changed: a proxy never writes upstream")
            times.update(
                proxy_ondemand_mb=status["ondemand_bytes"] / 1e6,
                proxy_ondemand_requests=float(status["ondemand_requests"]),
            )
        with step("ext4 through kemari-nbd proxy while it copies"):
            disk.start()
            fs_proxy.start()
            t = time.monotonic()
            files = fs_round_trip(host, fs_proxy.port, fs_proxy.export, disk.image.stat().st_size)
            times["fs_round_trip_s"] = time.monotonic() - t
            status = fs_proxy.status()
            images.log(f"proxy after the file-system round trip: {status}")
            times["fs_proxy_cached_percent_before_cutover"] = float(status["cached_percent"])
            fs_proxy.cutover()
            fs_proxy.stop()
            check_fs_image(fs_proxy.cache_image, files)
    finally:
        for server in (fs_proxy, disk, proxy, origin, target):
            server.stop()
    return times
