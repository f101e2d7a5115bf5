//! The machine: builds guest memory, the KVM VM, devices and vCPUs from a
//! [`MachineConfig`], boots the kernel, and offers pause/resume/metrics to
//! whoever runs it (the `kemari` process and its API).
//!
//! - this file: the [`Machine`] and its run-time control (pause, resume,
//!   save, release, announce, queries);
//! - `builder.rs`: building one (boot, restore, restore into a prepared VM);
//! - `setup.rs`: the devices, the kernel and the vCPUs it is built from;
//! - `prepared.rs`: [`PreparedVm`], a VM made ahead of a restore;
//! - `reboot.rs`: [`Machine::reboot`], a guest reset in the same process;
//! - `core.rs`: [`MachineCore`], the part other threads use while it runs;
//! - `monitor.rs`: what it reports ([`RunState`], [`MachineMetrics`]), also
//!   through a [`MachineMonitor`] on other threads;
//! - `error.rs`: [`MachineError`].

mod builder;
mod core;
mod error;
mod guest_uptime;
mod monitor;
mod prepared;
mod reboot;
mod reset;
mod setup;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use guest_uptime::GuestUptime;
use monitor::MachineStatus;

pub use self::core::MachineCore;
pub use crate::devices::DeviceInfo;
pub use crate::vstate::vcpu::PauseLength;
pub use error::MachineError;
pub use monitor::{MachineMetrics, MachineMonitor, RunState};
pub use prepared::PreparedVm;

use crate::config::MachineConfig;
use crate::devices::event_loop::{DeviceEventLoop, EventLoopError};
use crate::dirty::DirtyTracker;
use crate::memory::{GuestMemoryFile, GuestMemoryMmap};
use crate::output::{FenceSlot, FencedGate, OutputFence, OutputGate};
use crate::persist::{self, VmState};
use crate::sys;
use crate::vstate::vm::Vm;

/// A built, booted machine.
pub struct Machine {
    // The event loop (and the gate it holds) ends before the core goes.
    event_loop: Option<DeviceEventLoop>,
    /// The fence every output gate of the machine sits behind.
    fence: Arc<FenceSlot>,
    core: Arc<MachineCore>,
    /// The run state, the pause count and what else a [`MachineMonitor`]
    /// reads; written only here.
    status: Arc<MachineStatus>,
}

impl Drop for Machine {
    fn drop(&mut self) {
        // No monitor holds the core from here on: it goes with this drop.
        self.status.machine_gone();
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

    /// Saves the whole VM state. The machine must be paused (vCPUs and devices
    /// at rest), so the state and guest memory form one consistent image.
    pub fn save_state(&self) -> Result<VmState, MachineError> {
        let state = self.status.state();
        if state != RunState::Paused {
            return Err(MachineError::State(state));
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
        if self.status.state() == RunState::Paused {
            return self.core.save_state();
        }
        let started = Instant::now();
        if let Some(l) = &self.event_loop {
            l.pause()?;
        }
        let t_devices = started.elapsed();
        // From here on a resume() undoes both pauses, also when saving fails.
        self.status.set_paused();
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
            Some(l) => Ok(l.set_gate(FencedGate::wrap(self.fence.clone(), gate))?),
            None => Err(MachineError::EventLoop(EventLoopError::Gone)),
        }
    }

    /// From now on, outputs (disk requests, frames, console bytes) go only
    /// while `fence` holds, whatever the gate (see [`crate::output::fence`]).
    /// Once per machine: false if it already had a fence (kept).
    pub fn fence_outputs(&self, fence: Arc<dyn OutputFence>) -> bool {
        self.fence.set(fence)
    }

    /// The configuration the machine was built from.
    pub fn config(&self) -> &MachineConfig {
        &self.core.config
    }

    /// Running or paused.
    pub fn state(&self) -> RunState {
        self.status.state()
    }

    /// A handle that answers the machine's queries (state, configuration,
    /// uptime, devices, metrics) on other threads, while this one keeps the
    /// machine: see [`MachineMonitor`].
    pub fn monitor(&self) -> MachineMonitor {
        MachineMonitor::new(self.status.clone())
    }

    /// Which KVM VM of this process runs the guest ([`Vm::id`](crate::vstate::vm::Vm::id)).
    pub fn vm_id(&self) -> u64 {
        self.core.vm.id()
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
        Ok(match self.status.state() {
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

    /// Announces each network device's MAC — the guest's, which the saved
    /// configuration carries (`MachineConfig::pin_macs`) — on its TAP (a
    /// RARP broadcast, as switches expect after a VM moved), so that bridges
    /// learn its new port.
    pub fn announce_network(&self) {
        let taps = self.tap_fds();
        for (net, fd) in self.core.config.nets.iter().zip(taps) {
            let frame = rarp_announce(net.mac_address());
            for _ in 0..3 {
                if let Err(e) = sys::write(fd, &frame) {
                    tracing::warn!(tap = %net.tap, error = %e, "cannot announce MAC");
                    break;
                }
            }
        }
    }

    /// Stops every vCPU, then the device event loop.
    pub fn pause(&mut self) -> Result<(), MachineError> {
        if self.status.state() == RunState::Paused {
            return Err(MachineError::State(RunState::Paused));
        }
        self.core.vcpus.pause()?;
        if let Some(l) = &self.event_loop {
            l.pause()?;
        }
        self.status.set_paused();
        tracing::info!("VM paused");
        Ok(())
    }

    /// Restarts the device event loop, then the vCPUs.
    pub fn resume(&mut self) -> Result<(), MachineError> {
        if self.status.state() == RunState::Running {
            return Err(MachineError::State(RunState::Running));
        }
        if let Some(l) = &self.event_loop {
            l.resume()?;
        }
        self.core.vcpus.resume()?;
        self.status.set_running();
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
        let state = self.status.state();
        if state != RunState::Paused {
            return Err(MachineError::State(state));
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
        self.status.devices(&self.core)
    }

    /// Machine-wide counters.
    pub fn metrics(&self) -> MachineMetrics {
        self.status.metrics(Some(&self.core))
    }

    /// Time since the machine was built.
    pub fn uptime(&self) -> Duration {
        self.status.uptime()
    }

    /// The guest's uptime: since it booted, across restores and migrations.
    pub fn guest_uptime(&self) -> Duration {
        self.core.guest_uptime.now()
    }

    /// Stops vCPUs and devices for good.
    pub fn shutdown(self) {
        drop(self);
        tracing::info!("machine shut down");
    }
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
