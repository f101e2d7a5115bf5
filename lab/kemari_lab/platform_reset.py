"""Faults of the lab's platform (QEMU/TCG virtual hosts with nested KVM on
an emulated AMD-V), told apart from a VMM's failure after the fact.

Seen on these virtual hosts with both VMMs (docs/lab.md, "Soak" and
"Platform faults"):

- a guest reset with no panic or oops on its console: kemari reports it as
  "guest crashed: triple fault" and exits 4 (KVM's SVM code re-initializes
  the vCPU on the shutdown, so the registers it logs are the reset state);
  QEMU, run with -no-reboot, exits 0 without a poweroff;
- the virtual host's own kernel dying inside KVM_RUN ("BUG: TASK stack guard
  page was hit", "Kernel panic - not syncing: corrupted stack end"): no
  userspace VMM can do that;
- a virtual host whose QEMU ends by itself mid-scenario with nothing on
  its console (a CI rehearsal on 2026-11-29, guest-reboots; most likely a
  reset of the virtual host, which under -no-reboot ends QEMU with status
  0); a signal from QEMU's own crash ends it likewise;
- the virtual host's kernel holding a CPU for minutes ("soft lockup - CPU#1
  stuck for 104s! [qemu-system-x86]"): the harness's command on that host
  times out, whatever the nested VMM is.

- a guest, a virtual host or a connection that stops answering with no sign
  on any console (the virtual host's shell silent for minutes, a kemari
  guest's TCP connection that does not come back after a warm reboot of its
  host in CI although it passes most runs): a timeout, or "No route to host"
  when a guest stops answering ARP.

The acceptance tests run a scenario again, loudly (up to three runs in
all), while each run failed with one of these. A nested guest's own panic,
a VMM's non-zero exit, or any check that found wrong data (a corrupted
echo, a lost record, a dirty filesystem) is never retried; a stall that
happens every time still fails, on the last run.
"""

from __future__ import annotations

import re
from pathlib import Path

# A virtual host's own console (vh0.console); nested guests' are vh0-NAME.console.
HOST_CONSOLE_RE = re.compile(r"^vh\d+\.console$")
HOST_DEATH = ("stack guard page was hit", "Kernel panic - not syncing", "corrupted stack end detected")
SOFT_LOCKUP_RE = re.compile(r"soft lockup - CPU#\d+ stuck for (\d+)s! \[([^\]]*)\]")
# Lockups of 26-52 s come and go in passing runs (a nested guest's boot);
# the harness's waits are minutes long. A lockup this long explains a timeout.
LONG_LOCKUP_S = 60


def platform_reset_in(run_dir: Path) -> str | None:
    """The first nested guest console in `run_dir` that shows a guest reset,
    said in one line, or None."""
    for console in sorted(run_dir.glob("*.console")):
        text = console.read_text(errors="replace")
        if "guest crashed: triple fault" in text and "KLAB-VMM-EXIT=4" in text:
            return f"{console.name}: kemari reported a guest triple fault (exit 4)"
        if "qemu" in console.name and "KLAB-VMM-EXIT=0" in text and "KLAB-GUEST-POWEROFF" not in text:
            return f"{console.name}: QEMU's guest reset (exit 0, no poweroff asked)"
    return None


def host_fault_in(run_dir: Path, error: str) -> str | None:
    """A virtual host's kernel that died, or (when `error` is a timeout) held
    a CPU for LONG_LOCKUP_S or more, said in one line, or None."""
    timed_out = "timed out" in error
    for console in sorted(run_dir.glob("*.console")):
        if not HOST_CONSOLE_RE.match(console.name):
            continue
        text = console.read_text(errors="replace")
        for sign in HOST_DEATH:
            if sign in text:
                return f"{console.name}: the virtual host's kernel died ({sign!r})"
        if timed_out:
            lockups = [(int(s), task) for s, task in SOFT_LOCKUP_RE.findall(text)]
            longest = max(lockups, default=None)
            if longest and longest[0] >= LONG_LOCKUP_S:
                return (
                    f"{console.name}: the virtual host's kernel held a CPU for {longest[0]} s "
                    f"(soft lockup in {longest[1]}) and a command on it timed out"
                )
    return None


# What the harness says when a check found wrong data, not silence: such a
# failure is never retried, even if a timeout is mentioned with it.
WRONG_DATA = re.compile(r"corrupt|mismatch|malformed|lost|differ|dirty|bad=[1-9]|KLAB-DISK-FAIL|KLAB-NET-FAIL")
# Silence: a timeout, or a guest that stopped answering ARP (the client's
# kernel gives up on the neighbour: "No route to host", EHOSTUNREACH).
TIMEOUT_RE = re.compile(r"timed out|TimeoutError|No route to host|Errno 113")


# Where the harness attaches consoles and diagnostics to an error (their
# text, e.g. kemari's "dirty tracker ready", is not the error's).
ATTACHMENT_RE = re.compile(r"\ndiagnostics of |console tail:|; tail:\n|\nconsole:\n|\n\S+ on vh\d+:\n")


def _without_attachments(error: str) -> str:
    m = ATTACHMENT_RE.search(error)
    return error[: m.start()] if m else error


def stall_in(error: str) -> str | None:
    """A failure that is only silence (a timeout, or a guest no longer
    answering ARP: a guest, a virtual host or a connection that stopped
    answering), said in one line, or None. On these
    virtual hosts such stalls come from the platform as often as not (a
    kemari or QEMU guest, a virtual host that stops for minutes with nothing
    on any console: docs/lab.md, "Platform faults"); wrong data never
    counts."""
    said = _without_attachments(error)
    if not TIMEOUT_RE.search(said) or WRONG_DATA.search(said):
        return None
    first = said.strip().splitlines()[0] if said.strip() else said
    return f"a timeout with no wrong data ({first[:200]})"


# vhost.py's words for a virtual host whose QEMU ended without the lab
# stopping it.
HOST_EXIT_RE = re.compile(r"(vh\d+): .*its QEMU exited by itself \(status (-?\d+)\)")


def host_exit_in(error: str) -> str | None:
    """A virtual host whose QEMU ended by itself (a reset of the virtual
    host under -no-reboot, or QEMU's crash), said in one line, or None;
    wrong data never counts."""
    said = _without_attachments(error)
    m = HOST_EXIT_RE.search(said)
    if m is None or WRONG_DATA.search(said):
        return None
    vh, status = m.group(1), int(m.group(2))
    if status == 0:
        how = "a reset of the virtual host (-no-reboot)"
    elif status < 0:
        how = f"QEMU ended by signal {-status}"
    else:
        how = f"status {status}"
    return f"{vh}: its QEMU exited by itself: {how}"


def platform_fault_in(run_dir: Path, error: str) -> str | None:
    """Why a scenario that failed with `error` may have failed on the
    platform (retried), or None."""
    return platform_reset_in(run_dir) or host_fault_in(run_dir, error) or host_exit_in(error) or stall_in(error)
