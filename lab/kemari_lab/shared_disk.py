"""The lab's storage servers: kemari-nbd processes in the lab namespace, on the bridge address.

**The shared disk.** A guest that moves between virtual hosts (live
migration, later failover) must find the same disk on each. The lab copies
the guest image into the run directory and serves it with ``kemari-nbd
serve``, started inside the lab namespace and listening on the lab bridge's
address::

    this machine, netns klab-<pid>:  kemari-nbd serve --export disk=<run dir>/shared-disk.ext4
                                                      --listen 10.77.0.1:10809
    virtual host vh0 / vh1:          kemari … --disk nbd://10.77.0.1:10809/disk

kemari opens the export with its own userspace NBD client, so a virtual host
needs nothing but a TCP route to the bridge (no kernel NBD, no 9p or
virtiofs). The export is the storage server of the lab: it outlives any
virtual host, and killing a virtual host (a power failure) leaves it intact.
After the guest has unmounted its disk (poweroff), :meth:`SharedDisk.read_file`
reads what the guest wrote straight from the image with ``debugfs``.
``SharedDisk(lab, export, port, source=IMAGE)`` serves a copy of another image.

**The relocation proxy.** :class:`RelocationProxy` runs ``kemari-nbd proxy``
the same way, in front of an upstream export (docs/nbd.md), with its cache
and control socket in the run directory.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from kemari_lab import cleanup, images
from kemari_lab.errors import LabError
from kemari_lab.lab import Lab
from kemari_lab.netns import BRIDGE_IP

NBD_PORT = 10809
PROXY_PORT = 10810


def _binary() -> Path:
    binary = images.kemari_nbd_binary()
    if binary is None:
        raise LabError("no kemari-nbd binary: run lab/setup.sh --kemari (cargo build --release -p kemari-nbd)")
    return binary


def debugfs_cat(image: Path, path: str) -> bytes:
    """A file of an ext2/3/4 image, read with debugfs (only while nothing has it mounted)."""
    proc = subprocess.run(["debugfs", "-R", f"cat {path}", str(image)], capture_output=True, check=False, timeout=30)
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0 or "File not found" in err:
        raise LabError(f"debugfs cannot read {path} from {image}: {err.strip()}")
    return proc.stdout


class KemariNbdProcess:
    """One ``kemari-nbd`` server (``serve`` or ``proxy``) in the lab namespace,
    listening on the bridge address; its output goes to `log` in the run directory."""

    def __init__(self, lab: Lab, what: str, log_name: str, port: int) -> None:
        self.lab = lab
        self.what = what
        self.port = port
        self.log = lab.run_dir / f"kemari-nbd-{log_name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._cleanup: int | None = None

    def _spawn(self, args: list[str], timeout: float) -> None:
        """Starts ``kemari-nbd ARGS --listen BRIDGE_IP:port``; returns once it listens."""
        cmd = self.lab.network.in_lab([str(_binary()), *args, "--listen", f"{BRIDGE_IP}:{self.port}"])
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._cleanup = cleanup.register(f"{self.what} (pid {self._proc.pid})", self.stop)
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self._proc.poll() is not None:
                raise LabError(f"{self.what} exited with status {self._proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise LabError(f"{self.what} does not listen on {BRIDGE_IP}:{self.port} after {timeout:.0f}s")
            time.sleep(0.2)

    def _listening(self) -> bool:
        proc = subprocess.run(
            self.lab.network.in_lab(["ss", "-Hltn", f"sport = :{self.port}"]),
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        return f"{BRIDGE_IP}:{self.port}" in proc.stdout

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def check_serving(self) -> None:
        """Raises if the server has exited."""
        if self._proc is None or self._proc.poll() is not None:
            raise LabError(f"{self.what} is not running: {self.log_tail()}")

    def stop(self) -> None:
        """Stops the server (idempotent); its files stay in the run directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            cleanup.stop_process(proc)
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)


class SharedDisk(KemariNbdProcess):
    """A copy of the guest disk (or of `source`) served by ``kemari-nbd serve`` in the lab namespace."""

    def __init__(self, lab: Lab, export: str = "disk", port: int = NBD_PORT, source: Path | None = None) -> None:
        if lab.images is None:
            raise LabError("the lab is not started: no images to copy the shared disk from")
        super().__init__(lab, f"kemari-nbd serve of {export}", export, port)
        self.export = export
        self.source = source or lab.images.guest_disk
        self.image = lab.run_dir / f"shared-{export}{self.source.suffix}"

    @property
    def url(self) -> str:
        """The disk as kemari's --disk takes it."""
        return f"nbd://{BRIDGE_IP}:{self.port}/{self.export}"

    def start(self, timeout: float = 20) -> SharedDisk:
        """Copies the image and starts serving it; returns once the server listens."""
        _binary()
        # Sparse: the run directory keeps the image (what the guest wrote) for
        # KEEP_RUNS runs; its holes need not take space.
        images.run(["cp", "--sparse=always", str(self.source), str(self.image)])
        self._spawn(["serve", "--export", f"{self.export}={self.image}"], timeout)
        images.log(f"shared disk {self.url} serving {self.image}")
        return self

    def read_file(self, path: str) -> str:
        """A file of the ext4 image, read with debugfs (only while no guest has it mounted)."""
        return debugfs_cat(self.image, path).decode(errors="replace")


class RelocationProxy(KemariNbdProcess):
    """``kemari-nbd proxy`` in the lab namespace: serves `export`, relocated
    from the `upstream` URL, with its cache and control socket in the run
    directory. `extra_args` go to the proxy (e.g. ``--no-background``)."""

    def __init__(
        self,
        lab: Lab,
        upstream: str,
        export: str = "relocated",
        port: int = PROXY_PORT,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(lab, f"kemari-nbd proxy of {export}", f"proxy-{export}", port)
        self.upstream = upstream
        self.export = export
        self.extra_args = extra_args
        self.cache_dir = lab.run_dir / f"proxy-{export}-cache"
        self.control = lab.run_dir / f"proxy-{export}.ctl"

    @property
    def url(self) -> str:
        return f"nbd://{BRIDGE_IP}:{self.port}/{self.export}"

    @property
    def cache_image(self) -> Path:
        """The proxy's copy of the export (complete once cut over)."""
        return self.cache_dir / "cache.img"

    def start(self, timeout: float = 20) -> RelocationProxy:
        """Starts the proxy; returns once it listens."""
        args = ["proxy", "--upstream", self.upstream, "--cache", str(self.cache_dir), "--export", self.export]
        self._spawn([*args, "--control", str(self.control), *self.extra_args], timeout)
        images.log(f"proxy {self.url} relocating {self.upstream}")
        return self

    def _control(self, command: str, *flags: str, timeout: float = 30) -> dict[str, Any]:
        """Runs ``kemari-nbd COMMAND --control … FLAGS``; returns the proxy's status from its reply."""
        cmd = [str(_binary()), command, "--control", str(self.control), *flags]
        shown = " ".join(cmd)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LabError(f"`{shown}` timed out after {timeout:.0f}s; {self.what}:\n{self.log_tail()}") from None
        try:
            reply = json.loads(proc.stdout)
        except json.JSONDecodeError:
            reply = {}
        if proc.returncode != 0 or reply.get("ok") is not True:
            raise LabError(f"`{shown}` failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        status: dict[str, Any] = reply["status"]
        return status

    def status(self) -> dict[str, Any]:
        """``kemari-nbd status``: cached blocks, bytes fetched, phase, cut_over …"""
        return self._control("status")

    def cutover(self, timeout: float = 60) -> dict[str, Any]:
        """``kemari-nbd cutover --wait``: copies what is left, then cuts over; returns the status."""
        return self._control("cutover", "--wait", timeout=timeout)
