//! How the VMM lets go of its VM when it ends.

use std::sync::mpsc;
use std::time::Duration;

use vmm::machine::{Machine, RunState};

/// How long a VMM that lost its fence gives its VM to stop before it ends
/// without it (see [`end_vm_within`]).
pub const FENCE_LOST_STOP_BOUND: Duration = Duration::from_secs(5);

/// Once the VM runs in another process, this one only has to end: it does
/// so at idle priority (SCHED_IDLE, inherited by the reaper it forks to
/// destroy the KVM VM), so that its exit never takes a CPU from the new
/// VMM's vCPUs, which are starting on the same host. Every thread of it:
/// the vCPU, device and console threads end too, and with only the main
/// thread lowered, a 4 GiB live migration's guest-visible pause on this
/// host had a median of 0.73 ms against 0.61 with all of them (idle guest,
/// 24 runs each, alternated).
pub fn finish_at_idle_priority() {
    crate::sys::all_threads_at_idle_priority();
}

/// Ends the VM as this process ends: stops it, lets go of its disks and
/// TAPs (the VM's next VMM may open them at once), leaves the KVM VM's
/// destruction to a reaper process (`sys.rs`: 15–17 ms in the kernel here,
/// which whoever waits for this process's exit would otherwise wait for
/// too), and shuts the machine down.
pub fn end_vm(mut machine: Machine) {
    if machine.state() == RunState::Running {
        if let Err(e) = machine.pause() {
            // A vCPU that already ended (guest error) cannot be asked.
            tracing::debug!(error = %e, "cannot stop the VM before ending it");
        }
    }
    if machine.state() == RunState::Paused {
        drop(release_backends(&mut machine));
    }
    crate::sys::fork_reaper();
    machine.shutdown();
}

/// Lets go of the disks and TAPs of a machine paused for good, so that the
/// VM's next VMM can open them while this process still exits; returns the
/// TAP fds (to hand over, or drop).
pub fn release_backends(machine: &mut Machine) -> Vec<std::fs::File> {
    machine.release_backends().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot release the device backends before exiting");
        Vec::new()
    })
}

/// [`end_vm`], given at most `bound`: past it, this process ends without
/// waiting for the VM to stop. For an ending whose VM may not release
/// anything from now on (its fence is lost: outputs held for good), where a
/// device loop blocked in a backend — a disk request to an NBD server this
/// host can no longer reach (seen in the lab, cut off the network) — would
/// otherwise keep the process, and the copy it is, alive until the server
/// answers again.
pub fn end_vm_within(machine: Machine, bound: Duration) {
    let (done_tx, done_rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("vm-end".into())
        .spawn(move || {
            end_vm(machine);
            let _ = done_tx.send(());
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the thread that stops the VM; ending without it");
        return;
    }
    if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(bound) {
        tracing::error!(
            bound_ms = bound.as_millis() as u64,
            "the VM did not stop in time (a device is blocked, e.g. on a disk server that does not answer); ending without it"
        );
    }
}
