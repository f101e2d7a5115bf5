"""The shared disk: one ext4 image on this machine, served over NBD to every virtual host.

A guest that moves between virtual hosts (live migration, later failover)
must find the same disk on each. The lab copies the guest image into the run
directory and serves it with ``kemari-nbd serve``, started inside the lab
namespace and listening on the lab bridge's address::

    this machine, netns klab-<pid>:  kemari-nbd serve --export disk=<run dir>/shared-disk.ext4
                                                      --listen 10.77.0.1:10809
    virtual host vh0 / vh1:          kemari … --disk nbd://10.77.0.1:10809/disk

kemari opens the export with its own userspace NBD client, so a virtual host
needs nothing but a TCP route to the bridge (no kernel NBD, no 9p or
virtiofs). The export is the storage server of the lab: it outlives any
virtual host, and killing a virtual host (a power failure) leaves it intact.
After the guest has unmounted its disk (poweroff), :meth:`SharedDisk.read_file`
reads what the guest wrote straight from the image with ``debugfs``.
"""

from __future__ import annotations

import subprocess
import time

from kemari_lab import cleanup, images
from kemari_lab.errors import LabError
from kemari_lab.lab import Lab
from kemari_lab.netns import BRIDGE_IP

NBD_PORT = 10809


class SharedDisk:
    """A copy of the guest disk served by ``kemari-nbd serve`` in the lab namespace."""

    def __init__(self, lab: Lab, export: str = "disk", port: int = NBD_PORT) -> None:
        if lab.images is None:
            raise LabError("the lab is not started: no images to copy the shared disk from")
        self.lab = lab
        self.export = export
        self.port = port
        self.image = lab.run_dir / f"shared-{export}.ext4"
        self.log = lab.run_dir / f"kemari-nbd-{export}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._cleanup: int | None = None

    @property
    def url(self) -> str:
        """The disk as kemari's --disk takes it."""
        return f"nbd://{BRIDGE_IP}:{self.port}/{self.export}"

    def start(self, timeout: float = 20) -> SharedDisk:
        """Copies the guest image and starts serving it; returns once the server listens."""
        binary = images.kemari_nbd_binary()
        if binary is None:
            raise LabError("no kemari-nbd binary: run lab/setup.sh --kemari (cargo build --release -p kemari-nbd)")
        assert self.lab.images is not None
        # Sparse: the run directory keeps the image (what the guest wrote) for
        # KEEP_RUNS runs; its holes need not take space.
        images.run(["cp", "--sparse=always", str(self.lab.images.guest_disk), str(self.image)])
        cmd = self.lab.network.in_lab(
            [str(binary), "serve", "--export", f"{self.export}={self.image}", "--listen", f"{BRIDGE_IP}:{self.port}"]
        )
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._cleanup = cleanup.register(f"kemari-nbd serve (pid {self._proc.pid})", self.stop)
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self._proc.poll() is not None:
                raise LabError(f"kemari-nbd serve exited with status {self._proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise LabError(f"kemari-nbd serve does not listen on {BRIDGE_IP}:{self.port} after {timeout:.0f}s")
            time.sleep(0.2)
        images.log(f"shared disk {self.url} serving {self.image}")
        return self

    def _listening(self) -> bool:
        proc = subprocess.run(
            self.lab.network.in_lab(["ss", "-Hltn", f"sport = :{self.port}"]),
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        return f"{BRIDGE_IP}:{self.port}" in proc.stdout

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def check_serving(self) -> None:
        """Raises if the server has exited."""
        if self._proc is None or self._proc.poll() is not None:
            raise LabError(f"the shared-disk server is not running: {self._log_tail()}")

    def read_file(self, path: str) -> str:
        """A file of the ext4 image, read with debugfs (only while no guest has it mounted)."""
        proc = subprocess.run(
            ["debugfs", "-R", f"cat {path}", str(self.image)], capture_output=True, text=True, check=False, timeout=30
        )
        if proc.returncode != 0 or "File not found" in proc.stderr:
            raise LabError(f"debugfs cannot read {path} from {self.image}: {proc.stderr.strip()}")
        return proc.stdout

    def stop(self) -> None:
        """Stops the server (idempotent); the image stays in the run directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)
