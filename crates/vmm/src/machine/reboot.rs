//! Rebooting a machine in place, for a guest reset (i8042, ACPI reset
//! register, port 0xcf9) or a triple fault the VMM is told to restart.
//!
//! The reboot makes a new KVM VM around the same guest memory file and the
//! same device models, and boots it as [`Machine::build`] does: vCPUs,
//! local APICs, irqchip, PIT and clock are those of a VM KVM just made, so
//! no register can be left over from the old boot, and the kernel, the
//! initramfs and the boot structures (command line, memory map, ACPI
//! tables) are loaded again from the configuration. What is kept:
//!
//! - the memory file (a memfd, a named file) and the VMM's mapping of it,
//!   cleared: the pages the guest touched are zeroed where they are (a
//!   hugetlbfs file's are given back), so the guest reads zeroes where it
//!   left its data, as at power-on, and the next boot finds them
//!   allocated and mapped in the VMM (only the new VM's KVM mappings are
//!   made again, at the guest's first touch);
//! - each virtio device model with its backend — the disk image or NBD
//!   connection and the TAP stay open — reset as a driver's reset does, and
//!   wired to the new VM in the same MMIO window and interrupt line;
//! - the serial console's output (its file or socket and the clients on it).
//!
//! ```text
//!  old VM: vCPU threads end, device loop ends ─▶ devices reset, console output taken
//!        ─▶ old VM closed ─▶ memory zeroed in place ─▶ new VM: memory slots, devices
//!           re-wired, kernel loaded, vCPUs made ─▶ vCPUs run
//! ```

use std::sync::Arc;
use std::time::Instant;

use super::setup::Kept;
use super::{Machine, MachineError, PreparedVm, RunState};
use crate::config::MachineConfig;
use crate::dirty::DirtyTrackerConfig;
use crate::output::PassThroughGate;
use crate::vstate::vm::Vm;
use crate::vstate::VmEventSink;

impl Machine {
    /// Reboots the guest in place: a new VM around the same memory (zeroed)
    /// and devices (reset, backends open), the kernel loaded again (see the
    /// module documentation). Its events go to `events` (the old machine's
    /// late events can then be told apart). The machine comes back running,
    /// or paused if it was. Dirty-page tracking and any output gate end with
    /// the old VM: a reboot under migration or fault tolerance is the
    /// caller's to settle first. On error the old VM is gone: the machine
    /// cannot run again.
    pub fn reboot(mut self, events: VmEventSink) -> Result<Machine, MachineError> {
        let started = Instant::now();
        let start_paused = self.status.state() == RunState::Paused;
        // Nothing touches devices or memory from here on.
        self.core.vcpus.exit_all();
        self.event_loop = None;
        let virtio = self.core.virtio.iter().map(|d| d.keep()).collect();
        let serial = self
            .core
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_output();
        let kept = Kept {
            virtio,
            serial,
            serial_backend: self.status.serial_backend().to_owned(),
        };
        let config = MachineConfig::clone(&self.core.config);
        let memory_file = self.core.memory_file.clone();
        // The same mapping: the host's page tables for it stay, so the new
        // boot's first touches (the kernel's loader, then the devices'
        // writes into guest memory) take no page fault here.
        let guest_memory = self.core.guest_memory.clone();
        // Whatever tracking recorded of the VMM's writes meant the old VM.
        crate::memory::set_vmm_dirty_tracking(&guest_memory, false);
        drop(crate::memory::harvest_vmm_dirty(&guest_memory));
        // The fence (etcd lease, lock) is the process's, not the boot's: the
        // new boot's outputs stay behind it.
        let fence = self.fence.fence();
        // The old VM (and its mapping of guest memory) goes.
        drop(self);
        let stopped = started.elapsed();
        memory_file.clear()?;
        let cleared = started.elapsed();
        let prepared = PreparedVm {
            memory_file,
            guest_memory,
            vm: Vm::new()?,
            dirty: None,
            vcpus: Vec::new(),
            threads_ahead: Vec::new(),
            event_loop_ahead: None,
        };
        let machine = Self::assemble_in(
            config,
            prepared,
            false,
            events,
            start_paused,
            Arc::new(PassThroughGate),
            None,
            Vec::new(),
            DirtyTrackerConfig::default(),
            Some(kept),
        )?;
        if let Some(f) = fence {
            machine.fence_outputs(f);
        }
        tracing::info!(
            stopped_us = stopped.as_micros() as u64,
            memory_cleared_us = cleared.as_micros() as u64,
            rebooted_us = started.elapsed().as_micros() as u64,
            "machine rebooted in place"
        );
        Ok(machine)
    }
}
