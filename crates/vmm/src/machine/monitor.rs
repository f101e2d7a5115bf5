//! What a machine reports — its [`RunState`], devices and
//! [`MachineMetrics`] — and [`MachineMonitor`], which answers the same
//! queries on any thread while another one owns the
//! [`Machine`](super::Machine) (the API while a worker migrates it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{DeviceInfo, MachineCore};
use crate::config::MachineConfig;
use crate::devices::legacy::{SERIAL_GSI, SERIAL_PORT};
use crate::devices::virtio::DeviceCounters;

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

/// Answers a machine's queries — [`state`](Self::state),
/// [`config`](Self::config), [`uptime`](Self::uptime),
/// [`devices`](Self::devices), [`metrics`](Self::metrics) — on any thread,
/// while another thread owns the [`Machine`](super::Machine) and runs its
/// `&mut self` methods (`pause_and_save`, `resume`, a migration). Made by
/// [`Machine::monitor`](super::Machine::monitor); its answers are the
/// machine's own.
///
/// No query waits for a long operation. The run state and the pause count
/// are atomics the machine's owner writes; the configuration and the build
/// time never change; exit counters are atomics. A device list takes only
/// each device's own lock, as `Machine::devices` does: the lock a vCPU holds
/// for one register access of the UART and the device event loop for one
/// batch of a virtio device's requests, and that the owner holds while it
/// releases a device's backend. None of them is held across a pause, a
/// save (`pause_and_save`, `MachineCore::pause_and_save_vcpus`), a
/// dirty-page harvest or a vCPU pause; the monitor takes no lock of the
/// vCPU set.
///
/// A monitor keeps none of the machine's resources: once the machine is
/// dropped (which waits for the device lists under way), `state` says how
/// it last was, `devices` is empty and `metrics` counts no exits or
/// devices.
#[derive(Clone)]
pub struct MachineMonitor {
    status: Arc<MachineStatus>,
}

impl MachineMonitor {
    pub(super) fn new(status: Arc<MachineStatus>) -> Self {
        MachineMonitor { status }
    }

    /// Running or paused.
    pub fn state(&self) -> RunState {
        self.status.state()
    }

    /// The configuration the machine was built from.
    pub fn config(&self) -> &MachineConfig {
        &self.status.config
    }

    /// Time since the machine was built.
    pub fn uptime(&self) -> Duration {
        self.status.uptime()
    }

    /// The guest's uptime: since it booted, across restores and migrations
    /// (reset by a reboot).
    pub fn guest_uptime(&self) -> Duration {
        self.status.guest_uptime()
    }

    /// Devices with their counters (none once the machine is gone).
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.status
            .with_core(|core| self.status.devices(core))
            .unwrap_or_default()
    }

    /// Machine-wide counters.
    pub fn metrics(&self) -> MachineMetrics {
        self.status
            .with_core(|core| self.status.metrics(Some(core)))
            .unwrap_or_else(|| self.status.metrics(None))
    }
}

impl std::fmt::Debug for MachineMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MachineMonitor")
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

/// What a [`Machine`](super::Machine) shares with its monitors. Only the
/// machine's owner writes it.
pub(super) struct MachineStatus {
    /// Paused or running.
    paused: AtomicBool,
    /// Pauses since the machine was built.
    pauses: AtomicU64,
    built_at: Instant,
    guest_uptime: super::GuestUptime,
    config: Arc<MachineConfig>,
    /// Where the serial console goes ("stdout", "file:PATH"...).
    serial_backend: String,
    /// The machine's core while the machine lives. Its drop empties it,
    /// taking the write lock: a query holds a strong reference only under
    /// the read lock, so the core never ends on a monitor's thread.
    core: RwLock<Weak<MachineCore>>,
}

impl MachineStatus {
    pub(super) fn new(
        core: &Arc<MachineCore>,
        serial_backend: String,
        state: RunState,
        built_at: Instant,
        guest_uptime: super::GuestUptime,
    ) -> Self {
        MachineStatus {
            paused: AtomicBool::new(state == RunState::Paused),
            pauses: AtomicU64::new(0),
            built_at,
            guest_uptime,
            config: core.config.clone(),
            serial_backend,
            core: RwLock::new(Arc::downgrade(core)),
        }
    }

    pub(super) fn state(&self) -> RunState {
        if self.paused.load(Ordering::Acquire) {
            RunState::Paused
        } else {
            RunState::Running
        }
    }

    /// The machine paused: one more pause counted.
    pub(super) fn set_paused(&self) {
        // Counted first: whoever sees the state paused sees the count too.
        self.pauses.fetch_add(1, Ordering::Relaxed);
        self.paused.store(true, Ordering::Release);
    }

    pub(super) fn set_running(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// Where the serial console goes.
    pub(super) fn serial_backend(&self) -> &str {
        &self.serial_backend
    }

    pub(super) fn uptime(&self) -> Duration {
        self.built_at.elapsed()
    }

    pub(super) fn guest_uptime(&self) -> Duration {
        self.guest_uptime.now()
    }

    /// The machine is being dropped: monitors no longer reach its core.
    /// Returns once no query uses it.
    pub(super) fn machine_gone(&self) {
        *self.core.write().unwrap_or_else(|p| p.into_inner()) = Weak::new();
    }

    /// Runs `query` on the machine's core if the machine lives.
    fn with_core<R>(&self, query: impl FnOnce(&MachineCore) -> R) -> Option<R> {
        let core = self.core.read().unwrap_or_else(|p| p.into_inner());
        // The strong reference ends inside, before the read lock.
        core.upgrade().map(|c| query(&c))
    }

    /// Devices with their counters.
    pub(super) fn devices(&self, core: &MachineCore) -> Vec<DeviceInfo> {
        let serial = core.serial.lock().unwrap_or_else(|p| p.into_inner());
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
            queues: Vec::new(),
            interrupt_status: None,
        }];
        drop(serial);
        list.extend(core.virtio.iter().map(|d| d.info_with_counters()));
        list
    }

    /// Machine-wide counters; without the core (the machine is gone), no
    /// exits and no devices.
    pub(super) fn metrics(&self, core: Option<&MachineCore>) -> MachineMetrics {
        let mut exits = BTreeMap::new();
        for v in core.map_or(&[][..], |c| c.vcpus.handles()) {
            for (reason, n) in v.counters().snapshot() {
                *exits.entry(reason.to_string()).or_insert(0) += n;
            }
        }
        MachineMetrics {
            uptime_ms: self.built_at.elapsed().as_millis() as u64,
            memory_bytes: self.config.memory_bytes,
            memory_pages: self.config.memory_bytes / 4096,
            exits,
            devices: core.map(|c| self.devices(c)).unwrap_or_default(),
            pauses: self.pauses.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_monitor_can_go_to_any_thread() {
        fn shared<T: Clone + Send + Sync + 'static>() {}
        shared::<MachineMonitor>();
    }
}
