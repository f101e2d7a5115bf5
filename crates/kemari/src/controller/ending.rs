//! How the VMM lets go of its VM when it ends.

use vmm::machine::{Machine, RunState};

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
