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
//! - Event-driven synchronization (Kemari) captures an epoch inside
//!   [`OutputGate::before_output`], sends it and answers
//!   [`Release::WhenConfirmed`]: the loop keeps the batch and goes on (other
//!   devices' inputs and outputs, the next epoch) until
//!   [`OutputGate::confirmed`] says the standby has the epoch.
//! - Periodic checkpointing (Remus-style) answers [`Release::AtCheckpoint`]:
//!   the batch waits for the next checkpoint, which the event loop triggers
//!   every [`OutputGate::checkpoint_interval`] and after which it releases
//!   whatever was pending when the checkpoint began.
//! - Whatever the gate, a machine whose copy of the VM may run only while it
//!   holds a lease (the etcd fence of fault tolerance) lets outputs go only
//!   while an [`OutputFence`] says it holds it ([`fence`]).

pub mod fence;

use std::fmt;
use std::time::Duration;

pub use fence::{FenceSlot, FencedGate, OutputFence};

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
    /// Once [`OutputGate::confirmed`] reaches this ticket (an epoch the
    /// standby must acknowledge first). Tickets grow from batch to batch.
    WhenConfirmed(u64),
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
    /// it began) are performed once it returns [`Release::Now`] (the default),
    /// and never if it returns [`Release::AtCheckpoint`] (a
    /// [`fence`] that no longer holds).
    fn checkpoint(&self, _batch: &[OutputEvent]) -> Release {
        Release::Now
    }

    /// The highest ticket ([`Release::WhenConfirmed`]) whose outputs may go
    /// now; `u64::MAX` once no batch needs a confirmation any more (every
    /// held one goes). Called by the event loop when one of the
    /// [`confirmation_fds`](Self::confirmation_fds) is readable and after
    /// each batch; it must consume whatever made them readable and must not
    /// block.
    fn confirmed(&self) -> u64 {
        u64::MAX
    }

    /// Descriptors that become readable when [`confirmed`](Self::confirmed)
    /// may have moved (the event loop watches copies of them while the gate
    /// is in place; it never reads them).
    fn confirmation_fds(&self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }

    /// How many batches may wait for a confirmation at once; outputs the
    /// guest publishes beyond that wait, unseen by the gate, until one is
    /// confirmed.
    fn max_unconfirmed(&self) -> usize {
        1
    }

    /// Whether the serial console may write what the guest printed, now
    /// (the default: always). Asked from a vCPU thread at each console
    /// write, so it must not block; held bytes wait in the console's buffer
    /// (see [`crate::devices::console_buffer`]).
    fn console_may_write(&self) -> bool {
        true
    }
}

/// The gate without fault tolerance: every output passes at once.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughGate;

impl OutputGate for PassThroughGate {
    fn before_output(&self, _batch: &[OutputEvent]) -> Release {
        Release::Now
    }
}

/// Holds every output until the run it belongs to is confirmed: a live
/// migration's destination runs the guest before the source's `Commit`
/// arrives, and nothing of that run may leave the VM unless the commit comes
/// (the source resumes the guest otherwise, and the outside world must not
/// have seen this copy). [`commit`](Self::commit) lets outputs go from then
/// on; after [`discard`](Self::discard) none ever goes (the VM is being torn
/// down). The device event loop waits inside
/// [`before_output`](OutputGate::before_output) while the decision is
/// pending, and the console keeps what the guest prints; the guest's vCPUs
/// run on.
#[derive(Debug, Default)]
pub struct CommitGate {
    decision: std::sync::atomic::AtomicU8,
    /// Output requests that waited for the decision.
    held_requests: std::sync::atomic::AtomicU64,
    waiting: std::sync::Mutex<()>,
    decided: std::sync::Condvar,
}

const PENDING: u8 = 0;
const COMMITTED: u8 = 1;
const DISCARDED: u8 = 2;

impl CommitGate {
    /// Outputs held so far, and all later ones, may go.
    pub fn commit(&self) {
        self.decide(COMMITTED);
    }

    /// No output held so far, or later, ever goes.
    pub fn discard(&self) {
        self.decide(DISCARDED);
    }

    /// Output requests (disk requests, frames to send) that had to wait for
    /// the decision.
    pub fn held_requests(&self) -> u64 {
        self.held_requests
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`commit`](Self::commit) was called.
    pub fn is_committed(&self) -> bool {
        self.decision.load(std::sync::atomic::Ordering::Acquire) == COMMITTED
    }

    fn decide(&self, decision: u8) {
        // Under the lock, so a waiter cannot miss the notification between
        // its check and its wait.
        let _guard = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.decision.compare_exchange(
            PENDING,
            decision,
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
        );
        self.decided.notify_all();
    }
}

impl OutputGate for CommitGate {
    fn console_may_write(&self) -> bool {
        self.is_committed()
    }

    fn before_output(&self, batch: &[OutputEvent]) -> Release {
        use std::sync::atomic::Ordering;
        if self.decision.load(Ordering::Acquire) == PENDING {
            let n: u64 = batch.iter().map(|e| u64::from(e.requests)).sum();
            self.held_requests.fetch_add(n, Ordering::Relaxed);
        }
        let mut guard = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match self.decision.load(Ordering::Acquire) {
                COMMITTED => return Release::Now,
                // Held for good: with no checkpoint interval, no checkpoint
                // ever releases the batch.
                DISCARDED => return Release::AtCheckpoint,
                _ => {
                    guard = self.decided.wait(guard).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    const BATCH: [OutputEvent; 1] = [OutputEvent {
        device: 0,
        kind: OutputKind::BlockRequests,
        requests: 1,
    }];

    /// The device event loop's side: one batch through `gate`, on a thread.
    fn output_in_a_thread(gate: &Arc<CommitGate>) -> std::thread::JoinHandle<Release> {
        let gate = gate.clone();
        std::thread::spawn(move || gate.before_output(&BATCH))
    }

    #[test]
    fn commit_gate_holds_until_committed() {
        let gate = Arc::new(CommitGate::default());
        let waiter = output_in_a_thread(&gate);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "an output went before the commit");
        assert!(!gate.console_may_write());
        gate.commit();
        assert!(gate.console_may_write());
        assert_eq!(waiter.join().unwrap(), Release::Now);
        assert!(gate.is_committed());
        assert_eq!(gate.held_requests(), 1);
        // Later outputs go at once, and are not counted as held.
        assert_eq!(gate.before_output(&BATCH), Release::Now);
        assert_eq!(gate.held_requests(), 1);
    }

    #[test]
    fn a_discarded_gate_never_releases() {
        let gate = Arc::new(CommitGate::default());
        let waiter = output_in_a_thread(&gate);
        std::thread::sleep(Duration::from_millis(20));
        gate.discard();
        assert_eq!(waiter.join().unwrap(), Release::AtCheckpoint);
        // A commit after the discard changes nothing.
        gate.commit();
        assert!(!gate.is_committed());
        assert!(!gate.console_may_write());
        assert_eq!(gate.before_output(&BATCH), Release::AtCheckpoint);
        assert_eq!(gate.checkpoint_interval(), None);
    }
}
