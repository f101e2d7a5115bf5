//! What the API threads read while the main loop and a worker run: the
//! machine's monitor, the role of this VMM, fault tolerance's status, the
//! operations and the last live migration's progress. Nothing here waits
//! for the main loop or a worker, so a query is answered at once whatever
//! runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ft::status::{FtShared, FtState};
use transfer::ProgressCell;
use vmm::machine::MachineMonitor;

use crate::events::EventHub;
use crate::operation::Operations;

/// What this VMM is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Building its VM, or waiting for one (`--incoming`, `--restore
    /// --await-state`).
    Starting(&'static str),
    /// A fault-tolerance standby following its primary.
    Standby,
    /// It runs the VM.
    Running,
    /// It ends.
    Ending,
}

/// The state shared by the main loop, the workers and the API threads.
pub struct Shared {
    monitor: Mutex<Option<MachineMonitor>>,
    role: Mutex<Role>,
    /// Fault tolerance's state and metrics.
    pub ft: Arc<FtShared>,
    /// The long operations.
    pub operations: Arc<Operations>,
    /// The running or last live migration's progress (`GET /vm/migration`).
    pub migration: Arc<ProgressCell>,
    /// When this process started.
    pub started: Instant,
    /// The VM's events (`GET /vm/events`).
    pub events: EventHub,
    /// Fault tolerance's state as last published (`ft_events`).
    pub ft_seen: Mutex<FtState>,
    /// In-place guest reboots in this process.
    reboots: AtomicU64,
    /// Which operation may publish `operation_progress` events.
    pub progress_gate: super::progress_events::ProgressGate,
    /// The role and process settings in effect (`GET /vm/config`).
    pub process: std::sync::OnceLock<serde_json::Value>,
}

impl Shared {
    /// A VMM starting as `what`.
    pub fn new(what: &'static str) -> Arc<Self> {
        Arc::new(Shared {
            monitor: Mutex::new(None),
            role: Mutex::new(Role::Starting(what)),
            ft: Arc::new(FtShared::default()),
            operations: Arc::new(Operations::default()),
            migration: Arc::new(ProgressCell::default()),
            started: Instant::now(),
            events: EventHub::default(),
            ft_seen: Mutex::new(FtState::Unprotected),
            reboots: AtomicU64::new(0),
            progress_gate: Default::default(),
            process: std::sync::OnceLock::new(),
        })
    }

    /// The machine runs here now.
    pub fn set_machine(&self, monitor: MachineMonitor) {
        let c = monitor.config();
        self.events.set_identity(c.id.clone(), c.name.clone());
        *self.monitor.lock().unwrap_or_else(|p| p.into_inner()) = Some(monitor);
        self.set_role(Role::Running);
    }

    /// The machine's monitor, if a machine runs here.
    pub fn monitor(&self) -> Option<MachineMonitor> {
        self.monitor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// One more in-place reboot; returns how many there were.
    pub fn count_reboot(&self) -> u64 {
        self.reboots.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// In-place guest reboots in this process.
    pub fn reboots(&self) -> u64 {
        self.reboots.load(Ordering::Relaxed)
    }

    /// What this VMM is.
    pub fn role(&self) -> Role {
        *self.role.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// It became `role`.
    pub fn set_role(&self, role: Role) {
        *self.role.lock().unwrap_or_else(|p| p.into_inner()) = role;
    }
}
