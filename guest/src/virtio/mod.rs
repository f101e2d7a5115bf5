//! Polling virtio-mmio (version 2) drivers. Interrupts stay off: the
//! drivers watch the used rings in memory, and touch device registers only
//! to set up and to notify (each register access is a VM exit).

pub mod blk;
pub mod mmio;
pub mod net;
pub mod pmem;
pub mod queue;

/// Device status bits (virtio 1.2, 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const FAILED: u32 = 128;
}

/// VIRTIO_F_VERSION_1 (bit 32): the modern interface.
pub const F_VERSION_1: u64 = 1 << 32;
/// VIRTIO_F_EVENT_IDX (bit 29): the device says when it wants a notify.
pub const F_EVENT_IDX: u64 = 1 << 29;

#[derive(Clone, Copy, Debug)]
pub enum VirtioError {
    /// The device refused our feature set.
    FeaturesRejected,
    /// The device lacks a feature the driver needs.
    MissingFeature(&'static str),
    /// A queue the driver needs does not exist or is too small.
    BadQueue(u32),
    /// RAM ran out while allocating rings or buffers.
    OutOfMemory,
    /// The device's configuration space holds a value the driver cannot
    /// use: what is wrong, and the value.
    BadConfig(&'static str, u64),
}

impl core::fmt::Display for VirtioError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            VirtioError::FeaturesRejected => write!(f, "device rejected the features"),
            VirtioError::MissingFeature(name) => write!(f, "device lacks feature {name}"),
            VirtioError::BadQueue(q) => write!(f, "queue {q} missing or too small"),
            VirtioError::OutOfMemory => write!(f, "out of memory for rings and buffers"),
            VirtioError::BadConfig(what, value) => {
                write!(f, "bad configuration: {what} {value:#x}")
            }
        }
    }
}
