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

_lock = threading.RLock()
_actions: dict[int, tuple[str, Callable[[], None]]] = {}
_next_id = 0
_installed = False


def register(what: str, action: Callable[[], None]) -> int:
    """Registers an undo action; returns a handle for :func:`run_one`."""
    global _next_id
    _install()
    with _lock:
        _next_id += 1
        _actions[_next_id] = (what, action)
        return _next_id


def run_one(handle: int) -> None:
    """Runs (and forgets) one action now."""
    with _lock:
        entry = _actions.pop(handle, None)
    if entry is not None:
        _safe(*entry)


def forget(handle: int) -> None:
    """Drops an action without running it (its resource was released normally)."""
    with _lock:
        _actions.pop(handle, None)


def run_all() -> None:
    """Runs every pending action, newest first."""
    while True:
        with _lock:
            if not _actions:
                return
            handle = max(_actions)
            entry = _actions.pop(handle)
        _safe(*entry)


def pending() -> list[str]:
    """Descriptions of the actions not run yet (for tests)."""
    with _lock:
        return [what for what, _ in _actions.values()]


def _safe(what: str, action: Callable[[], None]) -> None:
    try:
        action()
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        print(f"[lab] cleanup of {what} failed: {e}", file=sys.stderr)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    run_all()
    # Default behaviour afterwards: exit with the conventional status.
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
