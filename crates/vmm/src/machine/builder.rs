//! Building a [`Machine`], as Firecracker's `builder.rs`: the entry points
//! (boot from a configuration; restore from a saved state into new memory,
//! kept memory or a [`PreparedVm`]) and the one assembly they share.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::monitor::MachineStatus;
use super::setup::{Kept, Setup};
use super::{Machine, MachineCore, MachineError, PreparedVm, RunState};
use crate::config::MachineConfig;
use crate::dirty::{DirtyTracker, DirtyTrackerConfig};
use crate::memory::GuestMemoryFile;
use crate::output::{FenceSlot, FencedGate, OutputGate, PassThroughGate};
use crate::persist::VmState;
use crate::vstate::vcpu::VcpuSet;
use crate::vstate::vm::Vm;
use crate::vstate::VmEventSink;

impl Machine {
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
            None,
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
            None,
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
            None,
        )
    }

    /// Builds a machine around `memory_file`: restores `saved`, or boots
    /// (with the devices a reboot `kept`, or new ones).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn assemble(
        config: MachineConfig,
        memory_file: GuestMemoryFile,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        saved: Option<&VmState>,
        taps: Vec<std::fs::File>,
        dirty: DirtyTrackerConfig,
        kept: Option<Kept>,
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
            kept,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn assemble_in(
        mut config: MachineConfig,
        prepared: PreparedVm,
        slots_registered: bool,
        events: VmEventSink,
        start_paused: bool,
        gate: Arc<dyn OutputGate>,
        saved: Option<&VmState>,
        taps: Vec<std::fs::File>,
        dirty: DirtyTrackerConfig,
        kept: Option<Kept>,
    ) -> Result<Self, MachineError> {
        let built_at = Instant::now();
        // Every gate the machine is given sits behind its fence (empty
        // until `fence_outputs`): the console's too.
        let fence = Arc::new(FenceSlot::default());
        let gate = FencedGate::wrap(fence.clone(), gate);
        // What the guest sees of its network devices, kept from here on.
        config.pin_macs();
        let PreparedVm {
            memory_file,
            guest_memory,
            vm,
            dirty: dirty_ahead,
            vcpus: vcpus_ahead,
            threads_ahead,
            event_loop_ahead,
        } = prepared;
        // A boot given vCPUs (a reboot keeping its VM) runs those; a restore
        // writes its state into those made ahead.
        let (kept_vcpus, vcpus_ahead) = match saved {
            None => (vcpus_ahead, Vec::new()),
            Some(_) => (Vec::new(), vcpus_ahead),
        };
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
                kept,
                start_paused,
                event_loop_ahead,
                kept_vcpus,
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
            if !vcpu.dirty_ring_attached() {
                dirty.attach_vcpu(&mut vcpu)?;
            }
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
        // A boot (or a reboot) starts the guest's uptime; a restore carries
        // it on (a state written before it was saved: from here).
        let before = saved
            .and_then(|s| s.guest_uptime_ms)
            .map_or(Duration::ZERO, Duration::from_millis);
        let guest_uptime = super::GuestUptime::new(before, built_at);
        let core = Arc::new(MachineCore {
            guest_uptime,
            vcpus: VcpuSet::new(vcpus, start_paused),
            virtio,
            serial,
            vm,
            dirty,
            config: Arc::new(config),
            memory_file,
            guest_memory,
            msr_indices: std::sync::OnceLock::new(),
            vcpu_constants: Arc::new(
                (0..vcpu_count)
                    .map(|_| std::sync::OnceLock::new())
                    .collect(),
            ),
        });
        Ok(Machine {
            event_loop: Some(event_loop),
            fence,
            status: Arc::new(MachineStatus::new(
                &core,
                serial_backend,
                state,
                built_at,
                guest_uptime,
            )),
            core,
        })
    }
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
