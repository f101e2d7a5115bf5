//! The output hook: the one point every externally visible device output passes.
//!
//! A device's *output queue* holds requests whose effect leaves the VM: the
//! virtio-blk request queue (reads too: a read fixes what the guest saw of the
//! disk) and the virtio-net transmit queue. The device event loop never lets a
//! device serve its output queue on its own: it first collects, across all
//! devices, how far the guest has published requests (the *batch*), asks the
//! [`OutputGate`] when they may go, and then lets each device serve exactly
//! the requests of the batch — nothing published later. Device locks are not
//! held while the gate decides, so a gate may pause the vCPUs and save the
//! whole machine.
//!
//! - Without fault tolerance the gate lets every batch go at once
//!   ([`PassThroughGate`]).
//! - Event-driven synchronization (Kemari) synchronizes the standby inside
//!   [`OutputGate::before_output`] and then releases the batch.
//! - Periodic checkpointing (Remus-style) answers [`Release::AtCheckpoint`]:
//!   the batch waits for the next checkpoint, which the event loop triggers
//!   every [`OutputGate::checkpoint_interval`] and after which it releases
//!   whatever was pending when the checkpoint began.

use std::fmt;
use std::time::Duration;

/// What kind of output waits on a device's output queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// virtio-blk requests (read, write, flush, discard...).
    BlockRequests,
    /// virtio-net frames to transmit.
    NetTransmits,
}

/// Outputs waiting on one device's output queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputEvent {
    /// Index of the device among the VM's virtio devices.
    pub device: usize,
    /// What the requests are.
    pub kind: OutputKind,
    /// How many requests (descriptor chains) the batch holds.
    pub requests: u16,
}

/// When a batch of outputs may be performed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Now (the gate has done whatever had to precede them).
    Now,
    /// After the next checkpoint ([`OutputGate::checkpoint`]).
    AtCheckpoint,
}

/// Decides when device outputs may proceed. Called from the device event
/// loop with no device lock held.
pub trait OutputGate: Send + Sync + fmt::Debug {
    /// Outputs in `batch` are about to be performed.
    fn before_output(&self, batch: &[OutputEvent]) -> Release;

    /// How often the event loop calls [`checkpoint`](Self::checkpoint); `None`
    /// (the default) never.
    fn checkpoint_interval(&self) -> Option<Duration> {
        None
    }

    /// A periodic checkpoint; the outputs in `batch` (everything pending when
    /// it began) are performed once it returns.
    fn checkpoint(&self, _batch: &[OutputEvent]) {}
}

/// The gate without fault tolerance: every output passes at once.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughGate;

impl OutputGate for PassThroughGate {
    fn before_output(&self, _batch: &[OutputEvent]) -> Release {
        Release::Now
    }
}
