"""A lab run: the namespaces, N virtual hosts, and their teardown.

    with Lab(hosts=2) as lab:
        lab.hosts[0].run("uname -r")
        lab.client(["busybox", "ping", "-c1", lab.hosts[1].ip])
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from kemari_lab import cleanup, images, paths
from kemari_lab.errors import LabError
from kemari_lab.netns import LabNetwork, remove_stale
from kemari_lab.vhost import VirtualHost

# Console logs of this many recent lab runs are kept under lab/build/runs/.
KEEP_RUNS = 30


def _prune_runs(keep: int) -> None:
    runs = sorted(paths.RUNS_DIR.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in runs[keep:]:
        shutil.rmtree(old, ignore_errors=True)


_HTTP_GET = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r:
    sys.stdout.write(r.read().decode())
"""


class Lab:
    """Context manager owning one lab run. Teardown happens on exit, on error,
    at interpreter exit and on SIGTERM/SIGINT/SIGHUP."""

    def __init__(
        self,
        hosts: int = 1,
        host_memory_mb: int = 3072,
        host_cpus: int = 2,
        tag: str | None = None,
        boot_timeout: float = 120,
        host_append: str = "",
        kexec_media: bool = False,
        scratch_disk_gb: int = 0,
    ) -> None:
        if hosts < 1:
            raise LabError("a lab needs at least one virtual host")
        self.tag = tag or str(os.getpid())
        self.network = LabNetwork(self.tag)
        self.run_dir = paths.RUNS_DIR / f"{self.tag}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.n_hosts = hosts
        self.host_memory_mb = host_memory_mb
        self.host_cpus = host_cpus
        self.boot_timeout = boot_timeout
        self.host_append = host_append
        # The host kernel and initramfs as read-only disks in each virtual
        # host (serials klab-kernel, klab-initrd): what a kexec loads.
        self.kexec_media = kexec_media
        # A writable disk per virtual host (serial klab-scratch, sparse file
        # in the run directory): the host's own disk, for suspend-to-disk.
        self.scratch_disk_gb = scratch_disk_gb
        self.hosts: list[VirtualHost] = []
        self._cleanup: int | None = None
        self.images: images.Images | None = None

    def __enter__(self) -> Lab:
        try:
            self.start()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()

    def start(self) -> None:
        """Set-up (cached), namespaces, then all virtual hosts booted in parallel."""
        for ns in remove_stale():
            images.log(f"removed stale namespace {ns}")
        self.images = images.setup()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _prune_runs(keep=KEEP_RUNS)
        self._cleanup = cleanup.register(f"lab {self.tag}", self.teardown)
        self.network.create()
        for i in range(self.n_hosts):
            drives: list[tuple[Path, str, bool]] = []
            if self.kexec_media:
                drives += [(self.images.vmlinuz, "klab-kernel", True), (self.images.host_initrd, "klab-initrd", True)]
            if self.scratch_disk_gb:
                scratch = self.run_dir / f"vh{i}-scratch.img"
                with scratch.open("wb") as f:
                    f.truncate(self.scratch_disk_gb << 30)
                drives.append((scratch, "klab-scratch", False))
            vh = VirtualHost(
                i,
                self.network,
                self.images.vmlinuz,
                self.images.host_initrd,
                self.run_dir,
                memory_mb=self.host_memory_mb,
                cpus=self.host_cpus,
                extra_append=self.host_append,
                drives=drives,
            )
            self.hosts.append(vh)
            vh.start()
        for vh in self.hosts:
            vh.wait_ready(self.boot_timeout)
            images.log(f"{vh.name} up in {vh.boot_seconds:.1f}s ({vh.ip}); console log {vh.console_log}")

    def teardown(self) -> None:
        """Kills every virtual host and deletes the namespaces (idempotent)."""
        for vh in self.hosts:
            vh.kill()
        for scratch in self.run_dir.glob("vh*-scratch.img"):
            scratch.unlink(missing_ok=True)  # sparse, but large once written
        self.network.destroy()
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)

    def client(self, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Runs a command in the client namespace."""
        return self.network.client_run(cmd, timeout)

    def client_http_get(self, ip: str, path: str = "/", timeout: float = 10) -> str:
        """An HTTP GET from the client namespace (a TCP connection); raises on failure."""
        # Python rather than busybox wget, which crashes on this machine's kernel.
        # "No route to host" is an ARP request the guest did not answer in
        # time (a loaded virtual host): the request never left, so it is
        # sent again until `timeout`.
        deadline = time.monotonic() + timeout
        while True:
            left = max(1.0, deadline - time.monotonic())
            proc = self.client([sys.executable, "-c", _HTTP_GET, f"http://{ip}{path}", str(left)], left + 5)
            if proc.returncode == 0:
                return proc.stdout
            if "No route to host" not in proc.stderr or time.monotonic() + 1 > deadline:
                raise LabError(f"client: GET http://{ip}{path} failed ({proc.returncode}): {proc.stderr.strip()}")
            time.sleep(1)

    def wait_client_reach(self, ip: str, path: str = "/", timeout: float = 30) -> str:
        """Retries :meth:`client_http_get` until it succeeds or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.client_http_get(ip, path, timeout=5)
            except LabError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def log_dir(self) -> Path:
        return self.run_dir
