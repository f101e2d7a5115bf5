"""The guest reset of the lab's virtual hosts (nested KVM on QEMU/TCG's
emulated AMD-V), told apart from a VMM's failure after the fact.

Guests under both VMMs reset now and then on these virtual hosts with no
panic or oops on their consoles (docs/lab.md, "Soak"): kemari reports it as
"guest crashed: triple fault" and exits 4 (KVM's SVM code re-initializes
the vCPU on the shutdown, so the registers it logs are the reset state);
QEMU, run with -no-reboot, exits 0 without a poweroff. The acceptance tests
run a scenario once more when, and only when, its first run failed with
such a reset in its consoles.
"""

from __future__ import annotations

from pathlib import Path


def platform_reset_in(run_dir: Path) -> str | None:
    """The first console in `run_dir` that shows a guest reset, said in one
    line, or None."""
    for console in sorted(run_dir.glob("*.console")):
        text = console.read_text(errors="replace")
        if "guest crashed: triple fault" in text and "KLAB-VMM-EXIT=4" in text:
            return f"{console.name}: kemari reported a guest triple fault (exit 4)"
        if "qemu" in console.name and "KLAB-VMM-EXIT=0" in text and "KLAB-GUEST-POWEROFF" not in text:
            return f"{console.name}: QEMU's guest reset (exit 0, no poweroff asked)"
    return None
