//! The output hook: the one point every externally visible device output passes.
//!
//! A block request about to reach the disk backend and a packet about to be
//! written to the TAP device both call [`OutputGate::before_output`] first, from
//! the thread that will perform the output, and perform it only after the call
//! returns. Fault tolerance installs a gate that pauses the vCPUs, synchronizes
//! the standby and returns once the standby has acknowledged; a periodic
//! checkpointer installs one that returns when the current epoch is committed.
//! Without fault tolerance the gate lets everything pass.

use std::fmt;

/// What kind of output is about to leave the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputEvent {
    /// A virtio-blk request (read, write, flush...) about to be issued to the backend.
    BlockRequest {
        /// Index of the device among the VM's block devices.
        device: usize,
        /// virtio-blk request type (VIRTIO_BLK_T_*).
        request_type: u32,
        /// First sector of the request.
        sector: u64,
    },
    /// A packet about to be written to a network backend.
    NetTransmit {
        /// Index of the device among the VM's network devices.
        device: usize,
        /// Frame length in bytes (without the virtio-net header).
        len: usize,
    },
}

/// Decides when a device output may proceed.
pub trait OutputGate: Send + Sync + fmt::Debug {
    /// Blocks until `event` may be performed. Called once per output, before it.
    fn before_output(&self, event: OutputEvent);
}

/// The gate without fault tolerance: every output passes at once.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughGate;

impl OutputGate for PassThroughGate {
    fn before_output(&self, _event: OutputEvent) {}
}
