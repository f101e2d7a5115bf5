//! [`PreparedVm`]: a KVM VM with its memory registered, and optionally its
//! vCPUs and their threads, made ahead of a restore so that the guest's
//! pause does not include them.

use std::sync::Arc;

use super::MachineError;
use crate::devices::event_loop::EventLoopAhead;
use crate::dirty::{DirtyTracker, DirtyTrackerConfig};
use crate::memory::{GuestMemoryFile, GuestMemoryMmap};
use crate::persist;
use crate::vstate::cpuid;
use crate::vstate::vcpu::{Vcpu, VcpuThreadAhead};
use crate::vstate::vm::Vm;

/// A KVM VM with guest memory mapped and registered, built ahead of a restore
/// so that the guest's pause does not include KVM's O(memory) slot set-up
/// (zero-copy migration prepares while the source still runs).
pub struct PreparedVm {
    pub(super) memory_file: GuestMemoryFile,
    pub(super) guest_memory: GuestMemoryMmap,
    pub(super) vm: Vm,
    /// Made by [`create_vcpus`](Self::create_vcpus), with the dirty tracker
    /// that had to come before them.
    pub(super) dirty: Option<Arc<DirtyTracker>>,
    pub(super) vcpus: Vec<Vcpu>,
    /// Threads for the vCPUs, made by
    /// [`start_threads_ahead`](Self::start_threads_ahead).
    pub(super) threads_ahead: Vec<VcpuThreadAhead>,
    /// The device event loop's thread, made there too.
    pub(super) event_loop_ahead: Option<EventLoopAhead>,
}

impl PreparedVm {
    /// Starts a thread for each vCPU made by
    /// [`create_vcpus`](Self::create_vcpus), to run it once restored (see
    /// [`VcpuThreadAhead`]), and the device event loop's thread (see
    /// [`EventLoopAhead`]): no thread is spawned inside the guest's pause.
    /// Does nothing if they exist.
    pub fn start_threads_ahead(&mut self) -> Result<(), MachineError> {
        if self.threads_ahead.is_empty() {
            for v in &mut self.vcpus {
                let thread = VcpuThreadAhead::spawn(v.index())?;
                // Best effort: without it that set-up is in the first entry.
                if let Err(e) = thread.first_run(v) {
                    tracing::debug!(error = %e, "no first KVM_RUN ahead");
                }
                self.threads_ahead.push(thread);
            }
        }
        if self.event_loop_ahead.is_none() {
            self.event_loop_ahead = Some(EventLoopAhead::spawn()?);
        }
        Ok(())
    }

    /// The restore comes now: the threads made ahead poll for their vCPUs
    /// rather than sleep (they sleep again if it does not come within a
    /// few milliseconds).
    pub fn get_vcpu_threads_ready(&self) {
        for t in &self.threads_ahead {
            t.get_ready();
        }
    }

    /// The guest memory the VM was prepared around.
    pub fn memory_file(&self) -> &GuestMemoryFile {
        &self.memory_file
    }

    /// Creates the dirty tracker (default configuration) and `count` vCPUs
    /// ahead of a restore, so that KVM_CREATE_VCPU (80–130 µs each on the
    /// PVM host) is not inside the guest's pause. A restore into this VM
    /// then needs a state of exactly `count` vCPUs. Does nothing if they
    /// exist.
    pub fn create_vcpus(&mut self, count: u8) -> Result<(), MachineError> {
        if !self.vcpus.is_empty() {
            return Ok(());
        }
        let dirty = match &self.dirty {
            Some(d) => d.clone(),
            None => DirtyTracker::new(&self.vm, &self.guest_memory, DirtyTrackerConfig::default())?,
        };
        self.dirty = Some(dirty.clone());
        for index in 0..count {
            let mut vcpu = Vcpu::new(self.vm.fd(), index)?;
            // Its dirty ring mapped now, not in the restore (~7 µs each).
            dirty.attach_vcpu(&mut vcpu)?;
            self.vcpus.push(vcpu);
        }
        // The CPUID a VM kemari boots here has: a restore of such a VM skips
        // KVM_SET_CPUID2 (~60 µs of the pause here). Best effort: a restore
        // sets whatever CPUID the state holds if this is not it.
        let tsc_khz = self.vcpus.first().and_then(Vcpu::tsc_khz);
        let preset = cpuid::base(self.vm.kvm(), tsc_khz)
            .map_err(|e| e.to_string())
            .and_then(|base| {
                self.vcpus
                    .iter_mut()
                    .try_for_each(|v| v.preset_cpuid(&base, count))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = preset {
            tracing::debug!(error = %e, "cannot give the vCPUs their CPUID ahead");
        }
        // What else they hold: the restore writes only what differs.
        for v in &mut self.vcpus {
            v.read_in_place();
        }
        // The state's decode, the restore's first, is cold otherwise.
        persist::format::warm_up();
        Ok(())
    }
}
