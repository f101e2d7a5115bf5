//! [`MachineCore`]: the parts of a machine other threads use while it runs
//! (a fault-tolerance synchronizer): nesting vCPU pauses, dirty-page
//! harvests, the whole state saved.

use std::sync::{Arc, Mutex};

use super::{MachineError, PauseLength, RunState};
use crate::config::MachineConfig;
use crate::devices::legacy::SerialDevice;
use crate::dirty::DirtyTracker;
use crate::memory::{GuestMemoryFile, GuestMemoryMmap};
use crate::persist::{self, VmState};
use crate::virtio_devices::AttachedDevice;
use crate::vstate::vcpu::VcpuSet;
use crate::vstate::vm::{Vm, VmError};

/// The parts of a machine that other threads may use while it runs: a
/// synchronizer (fault tolerance) on the device event-loop thread pauses the
/// vCPUs, harvests dirty pages and saves the whole state through it, while the
/// [`Machine`] stays with the VMM's main thread.
pub struct MachineCore {
    // Dropped in this order: vCPU threads end before devices and memory go.
    pub(super) vcpus: VcpuSet,
    pub(super) virtio: Vec<AttachedDevice>,
    pub(super) serial: Arc<Mutex<SerialDevice>>,
    pub(super) vm: Vm,
    pub(super) dirty: Arc<DirtyTracker>,
    pub(super) config: Arc<MachineConfig>,
    pub(super) memory_file: GuestMemoryFile,
    pub(super) guest_memory: GuestMemoryMmap,
    /// KVM's MSR list, fetched on the first save (syncs save often).
    pub(super) msr_indices: std::sync::OnceLock<Arc<Vec<u32>>>,
    /// Each vCPU's CPUID and TSC frequency, read on its first save.
    pub(super) vcpu_constants: Arc<Vec<std::sync::OnceLock<persist::vcpu::VcpuConstants>>>,
    /// Since the guest booted (saved with the state).
    pub(super) guest_uptime: super::GuestUptime,
}

impl MachineCore {
    /// Stops the vCPUs (pauses nest with the machine's own, see [`VcpuSet`]).
    pub fn pause_vcpus(&self) -> Result<(), MachineError> {
        Ok(self.vcpus.pause()?)
    }

    /// Undoes one [`pause_vcpus`](Self::pause_vcpus).
    pub fn resume_vcpus(&self) -> Result<(), MachineError> {
        Ok(self.vcpus.resume()?)
    }

    /// Pages written since the last harvest. The vCPUs must be paused.
    pub fn harvest_dirty_paused(&self) -> Result<Vec<u64>, MachineError> {
        if !self.vcpus.is_paused() {
            return Err(MachineError::State(RunState::Running));
        }
        Ok(self.dirty.harvest()?)
    }

    /// [`harvest_dirty_paused`](Self::harvest_dirty_paused) leaving up to
    /// `max_writable` guest-written pages writable (and reported again by
    /// every harvest until they are re-protected): see
    /// [`DirtyTracker::harvest_paused_keep_writable`](crate::dirty::DirtyTracker::harvest_paused_keep_writable).
    pub fn harvest_dirty_paused_keep_writable(
        &self,
        max_writable: usize,
    ) -> Result<crate::dirty::KeptHarvest, MachineError> {
        if !self.vcpus.is_paused() {
            return Err(MachineError::State(RunState::Running));
        }
        Ok(self.dirty.harvest_paused_keep_writable(max_writable)?)
    }

    /// The MSRs a vCPU's state holds ([`persist::vcpu::msr_indices`],
    /// fetched once).
    fn msr_indices(&self) -> Result<Arc<Vec<u32>>, MachineError> {
        if let Some(m) = self.msr_indices.get() {
            return Ok(m.clone());
        }
        let list = persist::vcpu::msr_indices(self.vm.kvm()).map_err(|source| VmError::Kvm {
            what: "KVM_GET_MSR_INDEX_LIST",
            source,
        })?;
        Ok(self.msr_indices.get_or_init(|| Arc::new(list)).clone())
    }

    /// Stops the vCPUs (one more nested pause, undone by
    /// [`resume_vcpus`](Self::resume_vcpus) — also when this fails) and
    /// saves each one's state on its own thread as soon as it has stopped:
    /// one wake-up per vCPU for both, which is what a fault-tolerance sync
    /// pays for on every output. `length` says how soon the resume will come
    /// (see [`PauseLength`]).
    pub fn pause_and_save_vcpus(
        &self,
        length: PauseLength,
    ) -> Result<Vec<persist::VcpuState>, MachineError> {
        let msrs = match self.msr_indices() {
            Ok(m) => m,
            Err(e) => {
                // Keep the pause count balanced for the caller's resume.
                self.vcpus.pause()?;
                return Err(e);
            }
        };
        let constants = self.vcpu_constants.clone();
        self.vcpus
            .pause_with(length, move |index, fd| {
                save_vcpu(fd, index, &msrs, &constants)
            })?
            .into_iter()
            .map(|r| r.map_err(MachineError::VcpuState))
            .collect()
    }

    /// Reads what the first save would otherwise read inside its pause:
    /// KVM's MSR list, and each vCPU's CPUID and TSC rate (a stop of each
    /// vCPU for two ioctls, tens of µs, while the guest runs). A
    /// migration's or a warm restart's only save is its process's first.
    pub fn prepare_saves(&self) -> Result<(), MachineError> {
        self.msr_indices()?;
        for v in self.vcpus.handles() {
            let index = v.index();
            let Some(cell) = self.vcpu_constants.get(usize::from(index)) else {
                continue;
            };
            if cell.get().is_some() {
                continue;
            }
            let read = v.with_fd(move |fd| persist::vcpu::read_constants(fd, index))?;
            let _ = cell.set(read.map_err(MachineError::VcpuState)?);
        }
        Ok(())
    }

    /// The whole VM state. The vCPUs must be paused and the devices at rest
    /// (the machine paused, or the caller is the device event loop).
    pub fn save_state(&self) -> Result<VmState, MachineError> {
        if !self.vcpus.is_paused() {
            return Err(MachineError::State(RunState::Running));
        }
        let msr_indices = self.msr_indices()?;
        let mut vcpus = Vec::with_capacity(self.vcpus.handles().len());
        for v in self.vcpus.handles() {
            let index = v.index();
            let msrs = msr_indices.clone();
            let constants = self.vcpu_constants.clone();
            let state = v.with_fd(move |fd| save_vcpu(fd, index, &msrs, &constants))?;
            vcpus.push(state.map_err(MachineError::VcpuState)?);
        }
        self.state_with_vcpus(vcpus)
    }

    /// The whole VM state around vCPU states saved while paused (see
    /// [`pause_and_save_vcpus`](Self::pause_and_save_vcpus)). The vCPUs must
    /// still be paused and the devices at rest.
    pub fn state_with_vcpus(
        &self,
        vcpus: Vec<persist::VcpuState>,
    ) -> Result<VmState, MachineError> {
        if !self.vcpus.is_paused() {
            return Err(MachineError::State(RunState::Running));
        }
        let kvm = persist::KvmVmState::save(self.vm.fd()).map_err(MachineError::VmState)?;
        let serial = {
            let mut serial = self.serial.lock().unwrap_or_else(|p| p.into_inner());
            // What the guest printed before the pause is out before anything
            // can end this VMM (a migration, a warm restart, a failover).
            serial.flush_output();
            serial.state().into()
        };
        let virtio = self.virtio.iter().map(|d| d.save()).collect();
        // What the guest wrote into device memory outside guest RAM (a
        // virtio-pmem window) is in its backing before the state exists:
        // whoever opens the state maps the backing anew.
        for d in &self.virtio {
            d.sync_backend()
                .map_err(|e| MachineError::DeviceSync(d.info.name.clone(), e))?;
        }
        Ok(VmState {
            kemari_version: env!("CARGO_PKG_VERSION").to_owned(),
            saved_at_ms: persist::now_ms(),
            guest_uptime_ms: Some(self.guest_uptime.now_ms()),
            config: MachineConfig::clone(&self.config),
            memory: persist::MemoryState {
                size: self.memory_file.size(),
                backing: self.memory_file.backing().clone(),
            },
            kvm,
            vcpus,
            serial,
            virtio,
        })
    }

    /// The configuration the machine was built from.
    pub fn config(&self) -> &MachineConfig {
        &self.config
    }

    /// The file behind guest memory.
    pub fn memory_file(&self) -> &GuestMemoryFile {
        &self.memory_file
    }

    /// Guest memory.
    pub fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.guest_memory
    }

    /// The dirty-page tracker.
    pub fn dirty_tracker(&self) -> &Arc<DirtyTracker> {
        &self.dirty
    }
}

/// Saves vCPU `index`, reading its constants (CPUID, TSC frequency) only
/// the first time.
fn save_vcpu(
    fd: &kvm_ioctls::VcpuFd,
    index: u8,
    msr_indices: &[u32],
    constants: &[std::sync::OnceLock<persist::vcpu::VcpuConstants>],
) -> Result<persist::VcpuState, persist::vcpu::VcpuStateError> {
    let Some(cell) = constants.get(usize::from(index)) else {
        return persist::vcpu::save(fd, index, msr_indices);
    };
    let known = match cell.get() {
        Some(c) => c,
        None => {
            let read = persist::vcpu::read_constants(fd, index)?;
            cell.get_or_init(|| read)
        }
    };
    persist::vcpu::save_with(fd, index, msr_indices, known)
}
