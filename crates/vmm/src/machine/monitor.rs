//! What a machine reports: its [`RunState`] and [`MachineMetrics`].

use serde::{Deserialize, Serialize};

use super::DeviceInfo;

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
