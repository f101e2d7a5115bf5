//! Device models: the address buses, legacy ports (serial, i8042, exit port)
//! and the console's output, disk backends and virtio devices.

pub mod block_backend;
pub mod bus;
pub mod console_buffer;
pub mod event_loop;
pub mod legacy;
pub mod serial_output;
pub mod virtio;

use serde::{Deserialize, Serialize};

use virtio::DeviceCounters;

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
