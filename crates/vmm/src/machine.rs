//! The machine: builds guest memory, the KVM VM, devices and vCPUs from a
//! [`MachineConfig`], boots the kernel, and offers pause/resume/metrics to
//! whoever runs it (the `kemari` process and its API).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::boot::{self, BootError};
use crate::config::{ConfigError, MachineConfig, SerialConfig};
use crate::devices::bus::{Bus, BusError};
use crate::devices::event_loop::{DeviceEventLoop, EventLoopAhead, EventLoopError};
use crate::devices::legacy::{
    ExitPort, SerialDevice, SerialOutput, SerialSocket, EXIT_PORT, I8042, I8042_PORT, SERIAL_GSI,
    SERIAL_PORT,
};
use crate::devices::virtio::DeviceCounters;
use crate::dirty::{DirtyError, DirtyTracker, DirtyTrackerConfig};
use crate::memory::{GuestMemoryFile, GuestMemoryMmap, MemoryError};
use crate::output::{OutputGate, PassThroughGate};
use crate::persist::{self, VmState};
use crate::virtio_devices::{self, AttachError, AttachedDevice};
use crate::vstate::cpuid;
pub use crate::vstate::vcpu::PauseLength;
use crate::vstate::vcpu::{BootEntry, Vcpu, VcpuError, VcpuSet, VcpuThreadAhead};
use crate::vstate::vm::{Vm, VmError};
use crate::vstate::VmEventSink;

/// Errors while building or controlling a machine.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// KVM VM.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// vCPU.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Kernel loading.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// Device wiring.
    #[error("device set-up: {0}")]
    Bus(#[from] BusError),
    /// virtio device creation.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// Device event loop.
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    /// Dirty-page tracking.
    #[error(transparent)]
    Dirty(#[from] DirtyError),
    /// ACPI tables could not be built.
    #[error(transparent)]
    Acpi(#[from] crate::acpi::AcpiError),
    /// The bzImage could not be loaded.
    #[error(transparent)]
    BzImage(#[from] boot::bzimage::BzImageError),
    /// The serial console's output could not be opened.
    #[error("serial console output {path}")]
    Serial {
        /// The file or socket.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An eventfd could not be created.
    #[error("cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    /// A vCPU's state could not be saved or restored.
    #[error(transparent)]
    VcpuState(#[from] persist::vcpu::VcpuStateError),
    /// The VM-wide KVM state could not be saved or restored.
    #[error(transparent)]
    VmState(persist::VmStateError),
    /// Saved state that cannot be restored here.
    #[error("cannot restore the saved state: {0}")]
    InvalidState(String),
    /// The operation does not apply in the current state.
    #[error("the VM is {0}")]
    State(RunState),
    /// A device backend could not be released.
    #[error("cannot release the backend of {device}")]
    Release {
        /// The device.
        device: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Whether the guest is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// vCPUs running.
    Running,
    /// vCPUs and devices stopped.
    Paused,
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunState::Running => "running",
            RunState::Paused => "paused",
        })
    }
}

/// A device as the API lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Name ("block0", "net0", "serial0").
    pub name: String,
    /// Kind ("virtio-blk", "virtio-net", "serial").
    pub kind: String,
    /// MMIO window or port base.
    pub address: u64,
    /// Interrupt line.
    pub gsi: u32,
    /// Backend (image path, TAP name, console target).
    pub backend: String,
    /// Request counters.
    pub counters: DeviceCounters,
}

/// Counters of the whole machine.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MachineMetrics {
    /// Time since the machine was built, in milliseconds.
    pub uptime_ms: u64,
    /// Guest memory size in bytes.
    pub memory_bytes: u64,
    /// Guest memory in 4 KiB pages.
    pub memory_pages: u64,
    /// KVM exits by reason, summed over vCPUs.
    pub exits: std::collections::BTreeMap<String, u64>,
    /// Per-device counters.
    pub devices: Vec<DeviceInfo>,
    /// Number of pauses since boot.
    pub pauses: u64,
}

/// A KVM VM with guest memory mapped and registered, built ahead of a restore
/// so that the guest's pause does not include KVM's O(memory) slot set-up
/// (zero-copy migration prepares while the source still runs).
pub struct PreparedVm {
    memory_file: GuestMemoryFile,
    guest_memory: GuestMemoryMmap,
    vm: Vm,
    /// Made by [`create_vcpus`](Self::create_vcpus), with the dirty tracker
    /// that had to come before them.
    dirty: Option<Arc<DirtyTracker>>,
    vcpus: Vec<Vcpu>,
    /// Threads for the vCPUs, made by
    /// [`start_threads_ahead`](Self::start_threads_ahead).
    threads_ahead: Vec<VcpuThreadAhead>,
    /// The device event loop's thread, made there too.
    event_loop_ahead: Option<EventLoopAhead>,
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
        let preset = self
            .vm
            .kvm()
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| e.to_string())
            .and_then(|mut base| {
                let tsc_khz = self.vcpus.first().and_then(Vcpu::tsc_khz);
                cpuid::add_timing_leaf(&mut base, tsc_khz);
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

/// What is built besides memory slots, before the vCPUs start.
struct Setup {
    serial: Arc<Mutex<SerialDevice>>,
    serial_backend: String,
    virtio: Vec<AttachedDevice>,
    event_loop: DeviceEventLoop,
    vcpus: Vec<Vcpu>,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    /// When the devices (and their event loop) were ready.
    devices_done: Instant,
}

/// The parts of a machine that other threads may use while it runs: a
/// synchronizer (fault tolerance) on the device event-loop thread pauses the
/// vCPUs, harvests dirty pages and saves the whole state through it, while the
/// [`Machine`] stays with the VMM's main thread.
pub struct MachineCore {
    // Dropped in this order: vCPU threads end before devices and memory go.
    vcpus: VcpuSet,
    virtio: Vec<AttachedDevice>,
    serial: Arc<Mutex<SerialDevice>>,
    vm: Vm,
    dirty: Arc<DirtyTracker>,
    config: MachineConfig,
    memory_file: GuestMemoryFile,
    guest_memory: GuestMemoryMmap,
    /// KVM's MSR list, fetched on the first save (syncs save often).
    msr_indices: std::sync::OnceLock<Arc<Vec<u32>>>,
    /// Each vCPU's CPUID and TSC frequency, read on its first save.
    vcpu_constants: Arc<Vec<std::sync::OnceLock<persist::vcpu::VcpuConstants>>>,
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

    /// KVM's MSR list (fetched once).
    fn msr_indices(&self) -> Result<Arc<Vec<u32>>, MachineError> {
        if let Some(m) = self.msr_indices.get() {
            return Ok(m.clone());
        }
        let list: Arc<Vec<u32>> = Arc::new(
            self.vm
                .kvm()
                .get_msr_index_list()
                .map_err(|source| VmError::Kvm {
                    what: "KVM_GET_MSR_INDEX_LIST",
                    source,
                })?
                .as_slice()
                .to_vec(),
        );
        Ok(self.msr_indices.get_or_init(|| list).clone())
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
        Ok(VmState {
            kemari_version: env!("CARGO_PKG_VERSION").to_owned(),
            saved_at_ms: persist::now_ms(),
            config: self.config.clone(),
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

/// A built, booted machine.
pub struct Machine {
    // The event loop (and the gate it holds) ends before the core goes.
    event_loop: Option<DeviceEventLoop>,
    core: Arc<MachineCore>,
    serial_backend: String,
    state: RunState,
    built_at: Instant,
    pauses: u64,
}

impl Drop for Machine {
    fn drop(&mut self) {
        self.core.vcpus.exit_all();
        self.event_loop = None;
        // The last partial line, even if a vCPU thread still holds the UART.
        self.core
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush_output();
    }
}

impl Machine {
    /// Starts the console's flusher thread now (see
    /// [`ConsoleBuffer::start_flusher_now`](crate::devices::console_buffer::ConsoleBuffer::start_flusher_now)).
    pub fn start_console_flusher(&self) {
        self.core
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .start_output_flusher();
    }

    /// Console bytes the machine has not written out yet: what a gate that
    /// holds the console ([`OutputGate::console_may_write`]) keeps back.
    pub fn console_bytes_pending(&self) -> usize {
        self.core
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending_output()
    }

    /// Builds and boots a machine; its vCPUs run at once unless `start_paused`.
    /// Guest events (poweroff, reset, errors) are reported to `events`.
    pub fn build(
        config: MachineConfig,
        events: VmEventSink,
        start_paused: bool,
    ) -> Result<Self, MachineError> {
        Self::build_with_gate(config, events, start_paused, Arc::new(PassThroughGate))
    }

    /// Like [`build`](Self::build), with the output gate of the caller's choice.
    pub fn build_with_gate(
        config: MachineConfig,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
    ) -> Result<Self, MachineError> {
        let dirty = DirtyTrackerConfig::default();
        Self::build_with_dirty_tracking(config, events, start_paused, gate, dirty)
    }

    /// Like [`build_with_gate`](Self::build_with_gate), choosing how dirty
    /// pages are tracked (the choice is made before the vCPUs exist; tracking
    /// itself starts later, see [`dirty_tracker`](Self::dirty_tracker)).
    pub fn build_with_dirty_tracking(
        config: MachineConfig,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        dirty: DirtyTrackerConfig,
    ) -> Result<Self, MachineError> {
        config.validate()?;
        let memory_file = GuestMemoryFile::create(config.memory_bytes, &config.memory_backing)?;
        Self::assemble(
            config,
            memory_file,
            events,
            start_paused,
            gate,
            None,
            Vec::new(),
            dirty,
        )
    }

    /// Rebuilds a machine from saved `state` around `memory_file` (the same
    /// memory, kept or passed over, or a copy loaded from an image). Nothing of
    /// the guest is reloaded: vCPUs, devices and the in-kernel irqchip, PIT and
    /// clock continue from the state.
    pub fn restore(
        state: &VmState,
        memory_file: GuestMemoryFile,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
    ) -> Result<Self, MachineError> {
        Self::restore_with_taps(state, memory_file, events, start_paused, gate, Vec::new())
    }

    /// Like [`restore`](Self::restore), with the network devices' TAP fds handed
    /// over by the previous VMM (in network-device order) instead of opened by
    /// name: a TAP can be attached to one fd at a time.
    pub fn restore_with_taps(
        state: &VmState,
        memory_file: GuestMemoryFile,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        taps: Vec<std::fs::File>,
    ) -> Result<Self, MachineError> {
        check_restorable(state, &memory_file)?;
        Self::assemble(
            state.config.clone(),
            memory_file,
            events,
            start_paused,
            gate,
            Some(state),
            taps,
            DirtyTrackerConfig::default(),
        )
    }

    /// Creates the VM and registers `memory_file` as its memory, for a later
    /// [`restore_prepared`](Self::restore_prepared).
    pub fn prepare(memory_file: GuestMemoryFile) -> Result<PreparedVm, MachineError> {
        let guest_memory = memory_file.map()?;
        let vm = Vm::new()?;
        vm.register_memory(&guest_memory)?;
        Ok(PreparedVm {
            memory_file,
            guest_memory,
            vm,
            dirty: None,
            vcpus: Vec::new(),
            threads_ahead: Vec::new(),
            event_loop_ahead: None,
        })
    }

    /// [`restore_with_taps`](Self::restore_with_taps) into a prepared VM.
    pub fn restore_prepared(
        state: &VmState,
        prepared: PreparedVm,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        taps: Vec<std::fs::File>,
    ) -> Result<Self, MachineError> {
        check_restorable(state, &prepared.memory_file)?;
        Self::assemble_in(
            state.config.clone(),
            prepared,
            true,
            events,
            start_paused,
            gate,
            Some(state),
            taps,
            DirtyTrackerConfig::default(),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: MachineConfig,
        memory_file: GuestMemoryFile,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        saved: Option<&VmState>,
        taps: Vec<std::fs::File>,
        dirty: DirtyTrackerConfig,
    ) -> Result<Self, MachineError> {
        let guest_memory = memory_file.map()?;
        let vm = Vm::new()?;
        let prepared = PreparedVm {
            memory_file,
            guest_memory,
            vm,
            dirty: None,
            vcpus: Vec::new(),
            threads_ahead: Vec::new(),
            event_loop_ahead: None,
        };
        Self::assemble_in(
            config,
            prepared,
            false,
            events,
            start_paused,
            gate,
            saved,
            taps,
            dirty,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble_in(
        config: MachineConfig,
        prepared: PreparedVm,
        slots_registered: bool,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        saved: Option<&VmState>,
        taps: Vec<std::fs::File>,
        dirty: DirtyTrackerConfig,
    ) -> Result<Self, MachineError> {
        let built_at = Instant::now();
        let PreparedVm {
            memory_file,
            guest_memory,
            vm,
            dirty: dirty_ahead,
            vcpus: vcpus_ahead,
            threads_ahead,
            event_loop_ahead,
        } = prepared;
        // Before any vCPU exists: the dirty ring must be enabled first.
        let dirty = match dirty_ahead {
            Some(d) => d,
            None => DirtyTracker::new(&vm, &guest_memory, dirty)?,
        };
        let t_memory = built_at.elapsed();
        let t_vm = built_at.elapsed();
        let setup = |gate| {
            Self::setup_devices_kernel_vcpus(
                &config,
                &vm,
                &guest_memory,
                &events,
                gate,
                saved,
                taps,
                start_paused,
                event_loop_ahead,
            )
        };
        let (setup, t_slots) = if slots_registered {
            // Prepared ahead: no thread to start (up to 1 ms on a busy host,
            // inside the guest's pause when restoring).
            (setup(gate), t_vm)
        } else {
            // Memory slots cost O(memory) in KVM: register them while the
            // devices, the kernel and the vCPUs are set up, and join before
            // any vCPU runs.
            let (setup, slots) = std::thread::scope(|scope| {
                let slots = scope.spawn(|| (vm.register_memory(&guest_memory), built_at.elapsed()));
                (setup(gate), slots.join())
            });
            let (slots_result, t_slots) = slots.unwrap_or_else(|p| std::panic::resume_unwind(p));
            slots_result?;
            (setup, t_slots)
        };
        let Setup {
            serial,
            serial_backend,
            virtio,
            event_loop,
            vcpus: created,
            io_bus,
            mmio_bus,
            devices_done,
        } = setup?;
        let t_devices = devices_done.saturating_duration_since(built_at);
        // A restore's vCPUs, their registers written, each with its thread
        // made ahead if there is one.
        let restoring = match saved {
            Some(state) => Self::restore_vcpus(vm.fd(), state, vcpus_ahead, threads_ahead, &dirty)?,
            // A boot makes its own vCPUs.
            None => Vec::new(),
        };
        let t_vcpus = built_at.elapsed();
        if let Some(state) = saved {
            // Last, so that the clock resumes as close as possible to the start.
            state.kvm.restore(vm.fd()).map_err(MachineError::VmState)?;
            // Requests the guest queued after the last notification served
            // before the save: look at every queue once.
            for d in &virtio {
                for evt in &d.queue_events {
                    let _ = evt.write(1);
                }
            }
        }
        let t_setup = built_at.elapsed();
        let mut vcpus = Vec::with_capacity(created.len() + restoring.len());
        for (vcpu, thread) in restoring {
            let (io, mmio, events) = (io_bus.clone(), mmio_bus.clone(), events.clone());
            vcpus.push(match thread {
                Some(t) => t.start(vcpu, io, mmio, events, start_paused)?,
                None => vcpu.start(io, mmio, events, start_paused)?,
            });
        }
        for mut vcpu in created {
            dirty.attach_vcpu(&mut vcpu)?;
            vcpus.push(vcpu.start(
                io_bus.clone(),
                mmio_bus.clone(),
                events.clone(),
                start_paused,
            )?);
        }
        tracing::debug!(
            memory_us = t_memory.as_micros() as u64,
            vm_us = (t_vm - t_memory).as_micros() as u64,
            memslots_done_us = t_slots.as_micros() as u64,
            devices_done_us = t_devices.as_micros() as u64,
            vcpus_done_us = t_vcpus.as_micros() as u64,
            setup_done_us = t_setup.as_micros() as u64,
            started_us = built_at.elapsed().as_micros() as u64,
            "machine set-up timing"
        );
        let state = if start_paused {
            // The event loop started paused.
            RunState::Paused
        } else {
            RunState::Running
        };
        tracing::info!(
            vcpus = config.vcpus,
            memory_mib = config.memory_bytes >> 20,
            kernel = %config.kernel.display(),
            devices = virtio.len(),
            restored = saved.is_some(),
            setup_us = built_at.elapsed().as_micros() as u64,
            "machine {}",
            if saved.is_some() { "restored" } else { "booted" }
        );
        let vcpu_count = vcpus.len();
        Ok(Machine {
            event_loop: Some(event_loop),
            core: Arc::new(MachineCore {
                vcpus: VcpuSet::new(vcpus, start_paused),
                virtio,
                serial,
                vm,
                dirty,
                config,
                memory_file,
                guest_memory,
                msr_indices: std::sync::OnceLock::new(),
                vcpu_constants: Arc::new(
                    (0..vcpu_count)
                        .map(|_| std::sync::OnceLock::new())
                        .collect(),
                ),
            }),
            serial_backend,
            state,
            built_at,
            pauses: 0,
        })
    }

    /// Everything but the memory slots: legacy and virtio devices, the kernel
    /// and its boot structures, the vCPUs (created, not started).
    #[allow(clippy::too_many_arguments)]
    fn setup_devices_kernel_vcpus(
        config: &MachineConfig,
        vm: &Vm,
        guest_memory: &GuestMemoryMmap,
        events: &VmEventSink,
        gate: Arc<dyn OutputGate>,
        saved: Option<&VmState>,
        taps: Vec<std::fs::File>,
        start_paused: bool,
        event_loop_ahead: Option<EventLoopAhead>,
    ) -> Result<Setup, MachineError> {
        // Legacy devices.
        let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(MachineError::EventFd)?;
        vm.register_irqfd(&serial_irq, SERIAL_GSI)?;
        let (serial_out, serial_backend) = open_serial(&config.serial)?;
        let serial = match saved {
            None => SerialDevice::new(serial_irq, serial_out, gate.clone()),
            Some(s) => {
                SerialDevice::from_state(serial_irq, serial_out, &(&s.serial).into(), gate.clone())
                    .map_err(MachineError::InvalidState)?
            }
        };
        let serial = Arc::new(Mutex::new(serial));
        let mut io_bus = Bus::new();
        io_bus.insert(serial.clone(), SERIAL_PORT, 8)?;
        io_bus.insert(
            Arc::new(Mutex::new(I8042::new(events.clone()))),
            I8042_PORT,
            5,
        )?;
        io_bus.insert(
            Arc::new(Mutex::new(ExitPort::new(events.clone()))),
            EXIT_PORT,
            4,
        )?;
        io_bus.insert(
            Arc::new(Mutex::new(crate::acpi::PowerPorts::new(events.clone()))),
            u64::from(crate::acpi::SLEEP_CONTROL_PORT),
            crate::acpi::POWER_PORTS_LEN,
        )?;

        // virtio devices.
        let mut mmio_bus = Bus::new();
        let virtio = virtio_devices::attach_all(
            config,
            vm,
            guest_memory,
            &mut mmio_bus,
            saved.map(|s| s.virtio.as_slice()),
            taps,
        )?;
        let mut cmdline = config.cmdline.clone();
        for d in &virtio {
            cmdline.push_str(&format!(
                " virtio_mmio.device=4K@{:#x}:{}",
                d.info.address, d.info.gsi
            ));
        }
        let event_loop_ahead = match event_loop_ahead {
            Some(a) => a,
            None => EventLoopAhead::spawn()?,
        };
        let event_loop = DeviceEventLoop::start_on(
            event_loop_ahead,
            virtio
                .iter()
                .map(|d| d.loop_device())
                .collect::<Result<_, _>>()?,
            gate,
            start_paused,
        )?;
        let devices_done = Instant::now();

        let vcpus = match saved {
            None => {
                let descs: Vec<crate::acpi::VirtioMmioDesc> = virtio
                    .iter()
                    .map(|d| crate::acpi::VirtioMmioDesc {
                        base: d.info.address,
                        size: crate::layout::VIRTIO_MMIO_SIZE,
                        gsi: d.info.gsi,
                    })
                    .collect();
                Self::boot_fresh(config, vm, guest_memory, cmdline.trim(), &descs)?
            }
            // Restored by restore_vcpus.
            Some(_) => Vec::new(),
        };
        Ok(Setup {
            serial,
            serial_backend,
            virtio,
            event_loop,
            vcpus,
            io_bus: Arc::new(io_bus),
            mmio_bus: Arc::new(mmio_bus),
            devices_done,
        })
    }

    /// Writes each vCPU's saved registers of `state` into the vCPU made
    /// ahead (or a new one), and pairs it with its thread made ahead, if
    /// there is one.
    fn restore_vcpus(
        vm: &kvm_ioctls::VmFd,
        state: &VmState,
        vcpus_ahead: Vec<Vcpu>,
        threads_ahead: Vec<VcpuThreadAhead>,
        dirty: &Arc<DirtyTracker>,
    ) -> Result<Vec<(Vcpu, Option<VcpuThreadAhead>)>, MachineError> {
        let ahead = vcpus_ahead.len();
        if ahead > 0 && ahead != state.vcpus.len() {
            return Err(MachineError::InvalidState(format!(
                "the state has {} vCPUs, this VM was prepared with {ahead}",
                state.vcpus.len()
            )));
        }
        let mut ahead: Vec<Option<Vcpu>> = vcpus_ahead.into_iter().map(Some).collect();
        let mut threads: Vec<Option<VcpuThreadAhead>> =
            threads_ahead.into_iter().map(Some).collect();
        let mut restoring = Vec::with_capacity(state.vcpus.len());
        for vs in &state.vcpus {
            let made = ahead.get_mut(usize::from(vs.index)).and_then(Option::take);
            let mut vcpu = match made {
                Some(v) => v,
                None if ahead.is_empty() => Vcpu::new(vm, vs.index)?,
                None => {
                    return Err(MachineError::InvalidState(format!(
                        "vCPU index {} is out of range or repeated",
                        vs.index
                    )))
                }
            };
            let in_place = vcpu.take_in_place();
            if !vcpu.dirty_ring_attached() {
                dirty.attach_vcpu(&mut vcpu)?;
            }
            let thread = threads
                .iter_mut()
                .find(|t| t.as_ref().is_some_and(|t| t.index() == vs.index))
                .and_then(Option::take);
            persist::vcpu::restore(vcpu.fd(), vs, in_place.as_ref())
                .map_err(MachineError::VcpuState)?;
            restoring.push((vcpu, thread));
        }
        Ok(restoring)
    }

    /// Loads the kernel and creates the vCPUs in their boot state.
    fn boot_fresh(
        config: &MachineConfig,
        vm: &Vm,
        guest_memory: &GuestMemoryMmap,
        cmdline: &str,
        virtio: &[crate::acpi::VirtioMmioDesc],
    ) -> Result<Vec<Vcpu>, MachineError> {
        let boot_entry = if boot::bzimage::is_bzimage(&config.kernel).unwrap_or(false) {
            let rsdp = crate::acpi::create_acpi_tables(guest_memory, config.vcpus, virtio)?;
            let bz = boot::bzimage::load(
                guest_memory,
                config.memory_bytes,
                &boot::bzimage::BzImageSpec {
                    kernel: &config.kernel,
                    initramfs: config.initramfs.as_deref(),
                    cmdline: config.cmdline.trim(),
                    rsdp: Some(rsdp.0),
                },
            )?;
            BootEntry::Linux64 {
                entry: bz.entry_64,
                boot_params: bz.zero_page,
                page_tables: bz.page_tables,
                gdt: bz.gdt,
            }
        } else {
            let pvh = boot::pvh::load(
                guest_memory,
                config.memory_bytes,
                &boot::pvh::PvhBootSpec {
                    kernel: &config.kernel,
                    initramfs: config.initramfs.as_deref(),
                    cmdline,
                    rsdp: None,
                },
            )?;
            BootEntry::Pvh {
                entry: pvh.entry,
                start_info: pvh.start_info,
            }
        };
        let kvm = vm.kvm();
        let mut base_cpuid = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| VmError::Kvm {
                what: "KVM_GET_SUPPORTED_CPUID",
                source,
            })?;
        let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
        for i in 0..config.vcpus {
            let vcpu = Vcpu::new(vm.fd(), i)?;
            if i == 0 {
                cpuid::add_timing_leaf(&mut base_cpuid, vcpu.tsc_khz());
            }
            vcpu.configure(&base_cpuid, config.vcpus)?;
            if i == 0 {
                vcpu.set_boot_state(boot_entry)?;
            }
            vcpus.push(vcpu);
        }
        Ok(vcpus)
    }

    /// Saves the whole VM state. The machine must be paused (vCPUs and devices
    /// at rest), so the state and guest memory form one consistent image.
    pub fn save_state(&self) -> Result<VmState, MachineError> {
        if self.state != RunState::Paused {
            return Err(MachineError::State(self.state));
        }
        self.core.save_state()
    }

    /// Makes the coming [`pause_and_save`](Self::pause_and_save) cheaper:
    /// reads ahead what its first save would read in the pause
    /// ([`MachineCore::prepare_saves`]) and warms up the state's encoder
    /// (see [`persist::format::warm_up`]). Best effort: what fails here is
    /// read in the pause as before. Call it well before the pause: it stops
    /// each vCPU briefly.
    pub fn prepare_to_save(&self) {
        if let Err(e) = self.core.prepare_saves() {
            tracing::debug!(error = %e, "cannot read the vCPUs' constants ahead of the save");
        }
        persist::format::warm_up();
    }

    /// Pauses the machine (if it runs) and saves its whole state, with one
    /// wake-up per vCPU: the device event loop is stopped first (so no device
    /// interrupt reaches a local APIC after its vCPU was saved), then each
    /// vCPU saves its own state the moment it stops, then the devices and
    /// the in-kernel irqchip are saved. This is the pause of a migration, a
    /// warm restart and a snapshot. On error the machine is left paused (the
    /// caller decides whether to resume it).
    pub fn pause_and_save(&mut self) -> Result<VmState, MachineError> {
        if self.state == RunState::Paused {
            return self.core.save_state();
        }
        let started = Instant::now();
        if let Some(l) = &self.event_loop {
            l.pause()?;
        }
        let t_devices = started.elapsed();
        // From here on a resume() undoes both pauses, also when saving fails.
        self.state = RunState::Paused;
        self.pauses += 1;
        // Long: the pause of a migration or a restart ends in another
        // process, or late; a polling vCPU would only take a CPU from it.
        let vcpus = self.core.pause_and_save_vcpus(PauseLength::Long)?;
        let t_vcpus = started.elapsed();
        let state = self.core.state_with_vcpus(vcpus)?;
        tracing::info!(
            devices_stopped_us = t_devices.as_micros() as u64,
            vcpus_saved_us = t_vcpus.as_micros() as u64,
            saved_us = started.elapsed().as_micros() as u64,
            "VM paused and saved"
        );
        Ok(state)
    }

    /// The shared parts, for a synchronizer on another thread.
    pub fn core(&self) -> Arc<MachineCore> {
        self.core.clone()
    }

    /// Replaces the output gate (see [`crate::output`]); returns once the
    /// device event loop uses it.
    pub fn set_output_gate(&self, gate: Arc<dyn OutputGate>) -> Result<(), MachineError> {
        match &self.event_loop {
            Some(l) => Ok(l.set_gate(gate)?),
            None => Err(MachineError::EventLoop(EventLoopError::Gone)),
        }
    }

    /// The configuration the machine was built from.
    pub fn config(&self) -> &MachineConfig {
        &self.core.config
    }

    /// Running or paused.
    pub fn state(&self) -> RunState {
        self.state
    }

    /// Guest memory.
    pub fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.core.guest_memory
    }

    /// The file behind guest memory.
    pub fn memory_file(&self) -> &GuestMemoryFile {
        &self.core.memory_file
    }

    /// The KVM VM.
    pub fn vm(&self) -> &Vm {
        &self.core.vm
    }

    /// The dirty-page tracker (off until its `start()`).
    pub fn dirty_tracker(&self) -> &Arc<DirtyTracker> {
        &self.core.dirty
    }

    /// Guest page frame numbers written since tracking started or the last
    /// harvest; running vCPUs are kicked so that none is missed.
    pub fn harvest_dirty(&self) -> Result<Vec<u64>, MachineError> {
        Ok(match self.state {
            RunState::Running => self.core.dirty.harvest_running(self.core.vcpus.handles())?,
            RunState::Paused => self.core.dirty.harvest()?,
        })
    }

    /// Starts dirty-page logging (guest and VMM writes).
    pub fn start_dirty_log(&self) -> Result<(), MachineError> {
        Ok(self.core.dirty.start()?)
    }

    /// Stops dirty-page logging.
    pub fn stop_dirty_log(&self) -> Result<(), MachineError> {
        Ok(self.core.dirty.stop()?)
    }

    /// Announces each network device's MAC on its TAP (a RARP broadcast, as
    /// switches expect after a VM moved), so that bridges learn its new port.
    pub fn announce_network(&self) {
        let taps = self.tap_fds();
        for (net, fd) in self.core.config.nets.iter().zip(taps) {
            let mac = net
                .mac
                .as_deref()
                .and_then(|m| crate::config::parse_mac(m).ok())
                .unwrap_or_else(|| crate::config::default_mac(&net.tap));
            let frame = rarp_announce(mac);
            for _ in 0..3 {
                // SAFETY: write() reads `frame` (valid for its length) from our
                // own buffer into the TAP fd the device owns; no memory is kept.
                let rc = unsafe { libc::write(fd, frame.as_ptr().cast(), frame.len()) };
                if rc < 0 {
                    tracing::warn!(tap = %net.tap, error = %std::io::Error::last_os_error(), "cannot announce MAC");
                    break;
                }
            }
        }
    }

    /// Stops every vCPU, then the device event loop.
    pub fn pause(&mut self) -> Result<(), MachineError> {
        if self.state == RunState::Paused {
            return Err(MachineError::State(self.state));
        }
        self.core.vcpus.pause()?;
        if let Some(l) = &self.event_loop {
            l.pause()?;
        }
        self.state = RunState::Paused;
        self.pauses += 1;
        tracing::info!("VM paused");
        Ok(())
    }

    /// Restarts the device event loop, then the vCPUs.
    pub fn resume(&mut self) -> Result<(), MachineError> {
        if self.state == RunState::Running {
            return Err(MachineError::State(self.state));
        }
        if let Some(l) = &self.event_loop {
            l.resume()?;
        }
        self.core.vcpus.resume()?;
        self.state = RunState::Running;
        tracing::info!("VM resumed");
        Ok(())
    }

    /// The TAP fds of the network devices, in network-device order (to hand
    /// them to another VMM).
    pub fn tap_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.core
            .virtio
            .iter()
            .filter(|d| d.info.kind == "virtio-net")
            .filter_map(|d| {
                d.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .backend_fd()
            })
            .collect()
    }

    /// Lets go of every device backend — disk images and NBD connections
    /// closed, TAP queues given up — so that the VM's next VMM can open them
    /// while this process still exits (warm restart, snapshot + exit). Returns
    /// the TAP fds in network-device order, to hand over or close. The machine
    /// must be paused, and must never run again: its devices serve nothing
    /// afterwards.
    pub fn release_backends(&mut self) -> Result<Vec<std::fs::File>, MachineError> {
        if self.state != RunState::Paused {
            return Err(MachineError::State(self.state));
        }
        let mut taps = Vec::new();
        for d in &self.core.virtio {
            let released = d
                .device
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .release_backend()
                .map_err(|source| MachineError::Release {
                    device: d.info.name.clone(),
                    source,
                })?;
            taps.extend(released);
        }
        Ok(taps)
    }

    /// Devices with their counters.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        let serial = self.core.serial.lock().unwrap_or_else(|p| p.into_inner());
        let mut list = vec![DeviceInfo {
            name: "serial0".into(),
            kind: "serial".into(),
            address: SERIAL_PORT,
            gsi: SERIAL_GSI,
            backend: self.serial_backend.clone(),
            counters: DeviceCounters {
                bytes_out: serial.bytes_out(),
                ..Default::default()
            },
        }];
        drop(serial);
        list.extend(self.core.virtio.iter().map(|d| d.info_with_counters()));
        list
    }

    /// Machine-wide counters.
    pub fn metrics(&self) -> MachineMetrics {
        let mut exits = std::collections::BTreeMap::new();
        for v in self.core.vcpus.handles() {
            for (reason, n) in v.counters().snapshot() {
                *exits.entry(reason.to_string()).or_insert(0) += n;
            }
        }
        MachineMetrics {
            uptime_ms: self.built_at.elapsed().as_millis() as u64,
            memory_bytes: self.core.config.memory_bytes,
            memory_pages: self.core.config.memory_bytes / 4096,
            exits,
            devices: self.devices(),
            pauses: self.pauses,
        }
    }

    /// Time since the machine was built.
    pub fn uptime(&self) -> Duration {
        self.built_at.elapsed()
    }

    /// Stops vCPUs and devices for good.
    pub fn shutdown(self) {
        drop(self);
        tracing::info!("machine shut down");
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

/// Checks that `state` is consistent and fits `memory`.
fn check_restorable(state: &VmState, memory: &GuestMemoryFile) -> Result<(), MachineError> {
    state.validate().map_err(MachineError::InvalidState)?;
    if memory.size() != state.memory.size {
        return Err(MachineError::InvalidState(format!(
            "guest memory is {} bytes, the state needs {}",
            memory.size(),
            state.memory.size
        )));
    }
    Ok(())
}

/// A RARP "request reverse" broadcast from `mac`, behind a zeroed virtio-net
/// header (the TAP expects one), padded to the 60-byte Ethernet minimum.
fn rarp_announce(mac: [u8; 6]) -> Vec<u8> {
    let mut f = vec![0u8; 12]; // virtio-net header
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x80, 0x35]); // RARP
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 3]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0; 4]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0; 4]);
    f.resize(12 + 60, 0);
    f
}

fn open_serial(cfg: &SerialConfig) -> Result<(SerialOutput, String), MachineError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| MachineError::Serial { path, source }
    };
    Ok(match cfg {
        SerialConfig::Null => (SerialOutput::Null, "null".into()),
        SerialConfig::Stdout => (SerialOutput::Stdout, "stdout".into()),
        SerialConfig::File(p) => (
            SerialOutput::File(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(err(p))?,
            ),
            format!("file:{}", p.display()),
        ),
        SerialConfig::Socket(p) => (
            SerialOutput::Socket(SerialSocket::bind(p).map_err(err(p))?),
            format!("socket:{}", p.display()),
        ),
    })
}
