//! Rebooting a machine in place, for a guest reset (i8042, ACPI reset
//! register, port 0xcf9) or a triple fault the VMM is told to restart.
//!
//! The reboot keeps the KVM VM, as QEMU does, and boots it again as
//! [`Machine::build`] does: every vCPU and the irqchip, PIT and clock are
//! written back to the state of a VM KVM has just made ([`super::reset`]),
//! so no register, pending interrupt or guest-enabled MSR is left over
//! from the old boot, and the kernel, the initramfs and the boot
//! structures (command line, memory map, ACPI tables) are loaded again
//! from the configuration. What is kept:
//!
//! - the VM with its memory slots and vCPUs (new threads run them), and so
//!   KVM's mappings of guest memory: the new boot's first touch of a page
//!   takes no fault in KVM (in a nested host each such fault is costly);
//! - the memory file (a memfd, a named file) and the VMM's mapping of it,
//!   cleared: the pages the guest touched are zeroed where they are (a
//!   hugetlbfs file's are given back), so the guest reads zeroes where it
//!   left its data, as at power-on;
//! - each virtio device model with its backend — the disk image or NBD
//!   connection and the TAP stay open — reset as a driver's reset does, and
//!   wired in again in the same MMIO window and on the same interrupt line;
//! - the serial console's output (its file or socket and the clients on it).
//!
//! ```text
//!  vCPU threads end (vCPUs kept), device loop ends ─▶ devices unwired and reset,
//!  console output taken ─▶ memory zeroed in place ─▶ vCPUs, irqchip, PIT, clock
//!  to power-on ─▶ devices re-wired, kernel loaded ─▶ vCPUs run on new threads
//! ```

use std::sync::Arc;
use std::time::Instant;

use super::reset::PowerOnState;
use super::setup::Kept;
use super::{Machine, MachineError, PreparedVm, RunState};
use crate::config::MachineConfig;
use crate::dirty::DirtyTrackerConfig;
use crate::output::PassThroughGate;
use crate::vstate::VmEventSink;

impl Machine {
    /// Reboots the guest in place: the same VM back at power-on, around the
    /// same memory (zeroed) and devices (reset, backends open), the kernel
    /// loaded again (see the module documentation). Its events go to
    /// `events` (the old machine's late events can then be told apart). The
    /// machine comes back running, or paused if it was. Dirty-page tracking
    /// and any output gate end with the old boot: a reboot under migration
    /// or fault tolerance is the caller's to settle first. On error the
    /// machine is gone: it cannot run again.
    pub fn reboot(mut self, events: VmEventSink) -> Result<Machine, MachineError> {
        let started = Instant::now();
        let start_paused = self.status.state() == RunState::Paused;
        // Read first, before anything of the machine is stopped.
        let power_on = PowerOnState::read(self.core.config.vcpus)?;
        let vm = self.core.vm.try_clone()?;
        // Nothing touches devices or memory from here on.
        let vcpus = self.core.vcpus.exit_all_keeping_vcpus();
        self.event_loop = None;
        let Some(mut vcpus) = vcpus else {
            return Err(MachineError::InvalidState(
                "a vCPU thread had ended: the VM cannot boot again".into(),
            ));
        };
        for d in &self.core.virtio {
            d.unwire(&vm)?;
        }
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
        // Whatever tracking recorded meant the old boot.
        let dirty = self.core.dirty.clone();
        dirty.stop()?;
        crate::memory::set_vmm_dirty_tracking(&guest_memory, false);
        drop(crate::memory::harvest_vmm_dirty(&guest_memory));
        // The fence (etcd lease, lock) is the process's, not the boot's: the
        // new boot's outputs stay behind it.
        let fence = self.fence.fence();
        // The old boot's machine goes (the VM stays, held by `vm`).
        drop(self);
        let stopped = started.elapsed();
        memory_file.clear()?;
        let cleared = started.elapsed();
        power_on.write(&vm, &mut vcpus)?;
        let prepared = PreparedVm {
            memory_file,
            guest_memory,
            vm,
            dirty: Some(dirty),
            vcpus,
            threads_ahead: Vec::new(),
            event_loop_ahead: None,
        };
        let machine = Self::assemble_in(
            config,
            prepared,
            true,
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
