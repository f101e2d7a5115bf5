"""A long-lived TCP connection from the client namespace to a guest.

:class:`LongConnection` runs ``echo_client.py`` in the client namespace
against the guest's echo service (busybox ``nc -lk -p 7 -e cat``): one
connection, opened once, exchanging random blocks that must come back
byte-exact, until closed. Whatever happens to the guest meanwhile (live
migration, failover), the connection either keeps verifying echoes or the
test fails with what broke it.

    conn = LongConnection(lab, guest.spec.ip).open()
    conn.expect_progress(20)       # 20 more verified echoes
    ...                            # move the guest
    conn.expect_progress(20)
    final = conn.close()           # raises if any echo failed
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kemari_lab import cleanup
from kemari_lab.errors import LabError
from kemari_lab.lab import Lab

ECHO_PORT = 7
_SCRIPT = Path(__file__).resolve().parent / "echo_client.py"


class LongConnection:
    """One byte-checked TCP connection to `ip:port`, kept open by a client process."""

    def __init__(
        self,
        lab: Lab,
        ip: str,
        port: int = ECHO_PORT,
        interval: float = 0.1,
        stall_limit: float = 60,
        max_block: int | None = None,
    ) -> None:
        self.lab = lab
        self.ip = ip
        self.port = port
        self.interval = interval
        self.max_block = max_block
        self.stall_limit = stall_limit
        self.local: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._cleanup: int | None = None
        self._stderr = lab.run_dir / f"client-{ip}-{port}.stderr"

    def __str__(self) -> str:
        return f"client connection {self.local or '?'} -> {self.ip}:{self.port}"

    def open(self, connect_timeout: float = 30) -> LongConnection:
        """Connects (retrying while the service starts); raises if it cannot."""
        cmd = self.lab.network.in_client(
            [
                sys.executable, "-u", str(_SCRIPT), self.ip, str(self.port),
                "--interval", str(self.interval),
                "--stall-limit", str(self.stall_limit),
                "--connect-timeout", str(connect_timeout),
            ]
            + (["--max-block", str(self.max_block)] if self.max_block else [])
        )  # fmt: skip
        with self._stderr.open("ab") as err:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
            )
        self._cleanup = cleanup.register(f"{self} (pid {self._proc.pid})", self._kill)
        threading.Thread(target=self._read, name=f"client-{self.ip}", daemon=True).start()
        first = self._reply(connect_timeout + 10, "the connection")
        if not first.get("connected"):
            self._kill()
            raise LabError(f"client: {first.get('error')}")
        self.local = str(first["local"])
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise LabError(f"{self}: no answer about {what} after {timeout:.0f}s") from None
        if line is None:
            raise LabError(f"{self}: the client process ended ({self._stderr_tail()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _stderr_tail(self) -> str:
        try:
            text = self._stderr.read_text(errors="replace").strip()
        except OSError:
            text = ""
        return text[-1500:] or "no stderr"

    def _send(self, cmd: str) -> None:
        if self._proc is None or self._proc.stdin is None or self._proc.poll() is not None:
            raise LabError(f"{self}: the client process is not running ({self._stderr_tail()})")
        self._proc.stdin.write(cmd + "\n")
        self._proc.stdin.flush()

    def stats(self) -> dict[str, Any]:
        """exchanges, bytes, max_gap_s, max_gap_end_s, gaps, since_last_s, elapsed_s, error."""
        self._send("stats")
        return self._reply(10, "stats")

    def check(self) -> dict[str, Any]:
        """The statistics; raises if the connection has failed."""
        s = self.stats()
        if s["error"]:
            raise LabError(f"{self} failed: {s['error']} (stats {s})")
        return s

    def wait_exchanges(self, total: int, timeout: float) -> dict[str, Any]:
        """Waits until `total` echoes have been verified since the connection opened."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.check()
            if s["exchanges"] >= total:
                return s
            if time.monotonic() > deadline:
                raise LabError(
                    f"{self}: only {s['exchanges']} of {total} echoes after {timeout:.0f}s "
                    f"(last one {s['since_last_s']:.1f}s ago; stats {s})"
                )
            time.sleep(0.5)

    def expect_progress(self, more: int = 20, timeout: float = 60) -> dict[str, Any]:
        """Waits for `more` further verified echoes on the same connection."""
        return self.wait_exchanges(self.check()["exchanges"] + more, timeout)

    @staticmethod
    def max_gap_in(stats: dict[str, Any], start_s: float, end_s: float) -> float:
        """The longest gap between echoes that ended within [start_s, end_s]
        (seconds since connecting, as ``elapsed_s``), of those over 1 s; 0 if none."""
        return max((gap for end, gap in stats.get("gaps", []) if start_s <= end <= end_s), default=0.0)

    def close(self) -> dict[str, Any]:
        """Ends the exchanges and the connection; returns the final statistics,
        raises if any echo failed."""
        self._send("stop")
        final = self._reply(self.stall_limit + 15, "the final statistics")
        assert self._proc is not None
        status = self._proc.wait(timeout=10)
        self._forget()
        if final["error"] or status != 0:
            raise LabError(f"{self} failed: {final['error']} (exit {status}, stats {final})")
        return final

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._forget()

    def _forget(self) -> None:
        if self._cleanup is not None:
            handle, self._cleanup = self._cleanup, None
            cleanup.forget(handle)

    def abort(self) -> None:
        """Kills the client process without checks (error paths)."""
        self._kill()
