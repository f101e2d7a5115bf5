"""A virtual host: QEMU/TCG with an emulated AMD-V CPU, driven over its serial console.

Console protocol. The host's init runs a prompt-less shell on ttyS0 with echo
off. For each command the harness sends one line::

    echo __KLAB_""BEGIN_<n>; ( <command> ) </dev/null 2>&1; echo __KLAB_""END_<n>_$?

The empty quotes keep the markers from appearing in any echo of the line
itself; the output is what lies between ``__KLAB_BEGIN_<n>`` and
``__KLAB_END_<n>_<status>``. Each command runs in a subshell (``cd`` or
variables do not carry over) with stdin from /dev/null, so it cannot eat
the next command. Everything the console prints is also logged to
``<run dir>/<name>.console``.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kemari_lab import cleanup
from kemari_lab.errors import LabError
from kemari_lab.netns import PREFIX_LEN, LabNetwork, host_ip

READY_RE = re.compile(r"KLAB-HOST-READY name=(\S+) ip=(\S*) kvm=(\w+)\n")


@dataclass
class CommandResult:
    """What a command printed (stdout and stderr together) and its exit status."""

    command: str
    status: int
    output: str

    @property
    def ok(self) -> bool:
        return self.status == 0


def tcg_accel() -> str:
    """QEMU's -accel for the virtual hosts: TCG, its vCPUs each in a thread of
    their own (QEMU's default for an x86 host) or, with
    KEMARI_LAB_TCG_THREAD=single, all in one thread (issue 24's A/B)."""
    thread = os.environ.get("KEMARI_LAB_TCG_THREAD", "")
    if thread not in ("", "single", "multi"):
        raise LabError(f"KEMARI_LAB_TCG_THREAD={thread!r}: single or multi")
    return f"tcg,thread={thread}" if thread else "tcg"


def qemu_binary() -> list[str]:
    """The virtual hosts' QEMU: the system's, or KEMARI_LAB_QEMU=DIR — a
    QEMU unpacked into DIR (``dpkg -x`` of qemu-system-x86, -common and
    -data: DIR/usr/bin/qemu-system-x86_64, its firmware in DIR/usr/share/qemu,
    the system's seabios after it) to try another QEMU's TCG (docs/lab.md,
    "Platform faults")."""
    root = os.environ.get("KEMARI_LAB_QEMU", "")
    if not root:
        return ["qemu-system-x86_64"]
    binary = Path(root) / "usr/bin/qemu-system-x86_64"
    data = Path(root) / "usr/share/qemu"
    if not binary.is_file() or not data.is_dir():
        raise LabError(f"KEMARI_LAB_QEMU={root}: no {binary} or no {data} (unpack the QEMU packages there)")
    return [str(binary), "-L", str(data), "-L", "/usr/share/qemu"]


class VirtualHost:
    """One QEMU/TCG virtual host on the lab bridge."""

    def __init__(
        self,
        index: int,
        network: LabNetwork,
        vmlinuz: Path,
        initrd: Path,
        run_dir: Path,
        memory_mb: int = 3072,
        cpus: int = 2,
        extra_append: str = "",
        drives: list[tuple[Path, str, bool]] | None = None,
    ) -> None:
        self.index = index
        self.name = f"vh{index}"
        self.ip = host_ip(index)
        self.network = network
        self.vmlinuz = vmlinuz
        self.initrd = initrd
        self.run_dir = run_dir
        self.memory_mb = memory_mb
        self.cpus = cpus
        # More kernel command line (a persistent-memory region: memmap=…).
        self.extra_append = extra_append
        # Raw disks (file, virtio serial, read-only?): /sys/block/vdX/serial.
        self.drives = drives or []
        self.tap = f"vh{index}"
        self.mac = f"52:54:00:77:00:{10 + index:02x}"
        self.console_log = run_dir / f"{self.name}.console"
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = ""
        self._cond = threading.Condition()
        self._seq = 0
        self._cmd_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._cleanup: int | None = None
        # Whether the lab itself stopped this host (kill, power_fail).
        self._stopped_by_lab = False
        self.boot_seconds: float | None = None

    # ------------------------------------------------------------ lifecycle

    def qemu_command(self) -> list[str]:
        """The QEMU command line of this virtual host (run inside the lab namespace)."""
        append = f"console=ttyS0 quiet panic=-1 klab.name={self.name} klab.ip={self.ip}/{PREFIX_LEN}"
        # Huge pages for shared memory (kemari's guest memory is a memfd):
        # KEMARI_LAB_SHMEM_THP=advise|always|never (default: the kernel's, never).
        if os.environ.get("KEMARI_LAB_SHMEM_THP"):
            append += f" klab.shmem_thp={os.environ['KEMARI_LAB_SHMEM_THP']}"
        if self.extra_append:
            append += f" {self.extra_append}"
        drives: list[str] = []
        for i, (path, serial, readonly) in enumerate(self.drives):
            ro = ",readonly=on" if readonly else ""
            drives += [
                "-drive", f"file={path},format=raw,if=none,id=x{i}{ro}",
                "-device", f"virtio-blk-pci,drive=x{i},serial={serial}",
            ]  # fmt: skip
        return [
            *qemu_binary(),
            "-accel", tcg_accel(),
            "-cpu", "EPYC,+svm",
            "-smp", str(self.cpus),
            "-m", str(self.memory_mb),
            "-nodefaults", "-display", "none", "-no-reboot",
            "-monitor", "none",
            "-serial", "stdio",
            "-kernel", str(self.vmlinuz),
            "-initrd", str(self.initrd),
            "-append", append,
            "-netdev", f"tap,id=n0,ifname={self.tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=n0,mac={self.mac},romfile=",
            *drives,
        ]  # fmt: skip

    def start(self) -> None:
        """Starts QEMU (returns at once; see :meth:`wait_ready`)."""
        self.network.add_tap(self.tap)
        cmd = ["ip", "netns", "exec", self.network.ns, *self.qemu_command()]
        self.console_log.parent.mkdir(parents=True, exist_ok=True)
        self._started_at = time.monotonic()
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._cleanup = cleanup.register(f"virtual host {self.name} (pid {self._proc.pid})", self.kill)
        self._reader = threading.Thread(target=self._read_console, name=f"{self.name}-console", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _how_it_ended(self) -> str:
        """Why this host is not running, for an error: stopped by the lab, or
        its QEMU exited by itself, with its status — under -no-reboot a
        reset of the virtual host ends QEMU with status 0 and no message
        (platform_reset.py tells that from a VMM's failure)."""
        if self._stopped_by_lab:
            return "stopped by the lab"
        status = self._proc.poll() if self._proc is not None else None
        return f"its QEMU exited by itself (status {status})"

    def wait_ready(self, timeout: float = 120) -> None:
        """Waits for KLAB-HOST-READY and checks /dev/kvm is there."""
        m = self.wait_for(READY_RE, timeout, what="the virtual host to boot")
        self.boot_seconds = time.monotonic() - self._started_at
        if m.group(3) != "yes":
            raise LabError(f"{self.name}: booted without /dev/kvm (kvm-amd did not load); see {self.console_log}")

    def power_fail(self) -> float:
        """A power failure: SIGKILL to this virtual host's QEMU, at once, with
        no warning to anything inside (guests, VMMs, connections). Returns the
        time.monotonic() of the kill. The harness forgets the host afterwards
        (its console stays logged); :meth:`run` on it raises LabError."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise LabError(f"{self.name}: cannot cut the power: the virtual host is not running")
        killed_at = time.monotonic()
        self._stopped_by_lab = True
        proc.kill()
        proc.wait(timeout=10)
        self.kill()  # closes the console pipe, joins the reader, forgets the cleanup action
        return killed_at

    def kill(self) -> None:
        """Powers the virtual host off hard (SIGTERM, then SIGKILL)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._stopped_by_lab = True
            cleanup.stop_process(proc)
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if self._reader:
            self._reader.join(timeout=5)
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)

    # ------------------------------------------------------------ console

    def _read_console(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self.console_log.open("ab") as log:
            while True:
                chunk = self._proc.stdout.read1(65536)  # type: ignore[attr-defined]
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                text = chunk.decode(errors="replace").replace("\r", "")
                with self._cond:
                    self._buf += text
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def console_text(self) -> str:
        """Everything the console printed so far."""
        with self._cond:
            return self._buf

    def _tail(self, lines: int = 15) -> str:
        return "\n".join(self.console_text().splitlines()[-lines:])

    def wait_for(self, pattern: re.Pattern[str], timeout: float, what: str, start: int = 0) -> re.Match[str]:
        """Waits until the console (from offset `start`) matches `pattern`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = pattern.search(self._buf, start)
                if m:
                    return m
                if not self.alive():
                    raise LabError(
                        f"{self.name}: QEMU exited while waiting for {what} ({self._how_it_ended()}); "
                        f"console tail:\n{self._tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LabError(
                        f"{self.name}: timed out after {timeout:.0f}s waiting for {what}; console tail:\n{self._tail()}"
                    )
                self._cond.wait(min(left, 0.5))

    def run(self, command: str, timeout: float = 60, check: bool = True) -> CommandResult:
        """Runs a shell command on the virtual host and returns its output and status."""
        if not self.alive():
            raise LabError(
                f"{self.name}: cannot run `{command}`: the virtual host is not running ({self._how_it_ended()})"
            )
        with self._cmd_lock:
            self._seq += 1
            n = self._seq
            with self._cond:
                start = len(self._buf)
            line = f'echo __KLAB_""BEGIN_{n}; ( {command}\n) </dev/null 2>&1; echo __KLAB_""END_{n}_$?\n'
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
            except OSError as e:
                raise LabError(f"{self.name}: cannot send `{command}` to the console: {e}") from e
            pattern = re.compile(rf"__KLAB_BEGIN_{n}\n(.*?)__KLAB_END_{n}_(\d+)\n", re.DOTALL)
            try:
                m = self.wait_for(pattern, timeout, what=f"command `{command}`", start=start)
            except LabError as e:
                raise LabError(f"{e}\n(command on {self.name}: {command})") from None
        result = CommandResult(command, int(m.group(2)), m.group(1))
        if check and not result.ok:
            raise LabError(f"{self.name}: command failed with status {result.status}: {command}\n{result.output}")
        return result

    def send(self, command: str) -> int:
        """Sends a command that does not come back (a kexec: the shell is
        gone with its kernel); returns the console offset before it, to wait
        from (:meth:`wait_for`)."""
        if not self.alive():
            raise LabError(f"{self.name}: cannot send `{command}`: the virtual host is not running")
        with self._cmd_lock:
            self._seq += 1
            with self._cond:
                start = len(self._buf)
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(f"( {command}\n) </dev/null 2>&1\n".encode())
                self._proc.stdin.flush()
            except OSError as e:
                raise LabError(f"{self.name}: cannot send `{command}` to the console: {e}") from e
        return start

    def wait_file_match(self, path: str, pattern: re.Pattern[str], timeout: float, what: str) -> re.Match[str]:
        """Polls a file on the virtual host until its contents match `pattern`."""
        deadline = time.monotonic() + timeout
        text = ""
        while True:
            # The whole wait is the bound: a virtual host whose CPUs a nested
            # guest's boot holds (soft lockups of 26-52 s seen under load)
            # answers one `cat` late, not never.
            text = self.run(f"cat {path} 2>/dev/null; true", timeout=max(30.0, deadline - time.monotonic())).output
            m = pattern.search(text)
            if m:
                return m
            if time.monotonic() > deadline:
                tail = "\n".join(text.splitlines()[-20:])
                raise LabError(f"{self.name}: timed out after {timeout:.0f}s waiting for {what} in {path}; tail:\n{tail}")
            time.sleep(0.5)
