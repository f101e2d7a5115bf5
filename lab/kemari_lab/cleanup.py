"""Teardown that happens whatever way the lab ends.

Every resource the lab creates (a namespace, a process) registers an undo
action here. The actions run, newest first, when the owning context manager
exits, at interpreter exit (atexit), or on SIGTERM/SIGINT/SIGHUP. Each action
runs at most once and a failing action does not stop the others.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class CleanupRegistry:
    """Undo actions, run newest first, each at most once."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._actions: dict[int, tuple[str, Callable[[], None]]] = {}
        self._next_id = 0

    def register(self, what: str, action: Callable[[], None]) -> int:
        """Registers an undo action; returns a handle for :meth:`run_one`/:meth:`forget`."""
        with self._lock:
            self._next_id += 1
            self._actions[self._next_id] = (what, action)
            return self._next_id

    def run_one(self, handle: int) -> None:
        """Runs (and forgets) one action now."""
        with self._lock:
            entry = self._actions.pop(handle, None)
        if entry is not None:
            _safe(*entry)

    def forget(self, handle: int) -> None:
        """Drops an action without running it (its resource was released normally)."""
        with self._lock:
            self._actions.pop(handle, None)

    def run_all(self) -> None:
        """Runs every pending action, newest first."""
        while True:
            with self._lock:
                if not self._actions:
                    return
                handle = max(self._actions)
                entry = self._actions.pop(handle)
            _safe(*entry)

    def pending(self) -> list[str]:
        """Descriptions of the actions not run yet."""
        with self._lock:
            return [what for what, _ in self._actions.values()]


def stop_process(proc: subprocess.Popen[Any], grace: float = 5) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; waits for the end. Does
    nothing to a process that has already ended."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)


def _safe(what: str, action: Callable[[], None]) -> None:
    try:
        action()
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        print(f"[lab] cleanup of {what} failed: {e}", file=sys.stderr)


# The process-wide registry the lab uses, run at exit and on signals.
_registry = CleanupRegistry()
_installed = False


def register(what: str, action: Callable[[], None]) -> int:
    """Registers an undo action in the process-wide registry."""
    _install()
    return _registry.register(what, action)


def run_one(handle: int) -> None:
    """Runs (and forgets) one action of the process-wide registry now."""
    _registry.run_one(handle)


def forget(handle: int) -> None:
    """Drops an action of the process-wide registry without running it."""
    _registry.forget(handle)


def run_all() -> None:
    """Runs every pending action of the process-wide registry."""
    _registry.run_all()


def pending() -> list[str]:
    """Descriptions of the process-wide registry's pending actions."""
    return _registry.pending()


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    run_all()
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(run_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(sig, _on_signal)
