//! The fence on a machine's outputs: the right of this copy of the VM to
//! let anything out at all.
//!
//! Fault tolerance across hosts may arbitrate who runs a VM with a lease
//! (etcd, see the `ft` crate's `fence::etcd`): the copy holding it may
//! produce outputs, and once it can no longer be sure it holds it, another
//! copy may already run. Every gate a machine is given is wrapped in a
//! [`FencedGate`] over the machine's [`FenceSlot`]; until a fence is put in
//! the slot, outputs pass as the gate decides. Once the fence says it no
//! longer holds, no output — disk request, frame, console byte — goes
//! again: the batch is held for good ([`Release::AtCheckpoint`] with no
//! checkpoint to come, or a checkpoint answering the same).

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::{OutputEvent, OutputGate, Release};

/// Whether this copy of the VM may let outputs out.
pub trait OutputFence: Send + Sync + fmt::Debug {
    /// True while the copy holds its right to run the VM. Once false, it
    /// must stay false. Called before every batch of outputs and every
    /// console write (from a vCPU thread): it must not block.
    fn holds(&self) -> bool;
}

/// Where a machine's fence goes; empty until one is put in, and it is put
/// in once.
#[derive(Debug, Default)]
pub struct FenceSlot(OnceLock<Arc<dyn OutputFence>>);

impl FenceSlot {
    /// A slot holding `fence` from the start.
    pub fn with(fence: Arc<dyn OutputFence>) -> Self {
        let slot = FenceSlot::default();
        slot.set(fence);
        slot
    }

    /// Puts `fence` in; false if the slot already had one (kept).
    pub fn set(&self, fence: Arc<dyn OutputFence>) -> bool {
        self.0.set(fence).is_ok()
    }

    /// The fence set, if any.
    pub fn fence(&self) -> Option<Arc<dyn OutputFence>> {
        self.0.get().cloned()
    }

    /// Whether outputs may go: no fence, or a fence that holds.
    pub fn holds(&self) -> bool {
        self.0.get().is_none_or(|f| f.holds())
    }
}

/// A gate behind the machine's fence: `inner` decides as ever (a sync
/// first, a checkpoint), then the outputs go only if the fence holds.
#[derive(Debug)]
pub struct FencedGate {
    slot: Arc<FenceSlot>,
    inner: Arc<dyn OutputGate>,
}

impl FencedGate {
    /// `inner` behind the fence in `slot`.
    pub fn wrap(slot: Arc<FenceSlot>, inner: Arc<dyn OutputGate>) -> Arc<dyn OutputGate> {
        Arc::new(FencedGate { slot, inner })
    }

    fn fenced(&self, release: Release) -> Release {
        if release != Release::AtCheckpoint && !self.slot.holds() {
            Release::AtCheckpoint
        } else {
            release
        }
    }
}

impl OutputGate for FencedGate {
    fn before_output(&self, batch: &[OutputEvent]) -> Release {
        self.fenced(self.inner.before_output(batch))
    }

    fn checkpoint_interval(&self) -> Option<Duration> {
        self.inner.checkpoint_interval()
    }

    fn checkpoint(&self, batch: &[OutputEvent]) -> Release {
        self.fenced(self.inner.checkpoint(batch))
    }

    fn console_may_write(&self) -> bool {
        self.inner.console_may_write() && self.slot.holds()
    }

    /// The inner gate's confirmations (it consumes what woke the loop),
    /// none once the fence no longer holds: held outputs stay held.
    fn confirmed(&self) -> u64 {
        let confirmed = self.inner.confirmed();
        if self.slot.holds() {
            confirmed
        } else {
            0
        }
    }

    fn confirmation_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.inner.confirmation_fds()
    }

    fn max_unconfirmed(&self) -> usize {
        self.inner.max_unconfirmed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{OutputKind, PassThroughGate};
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Debug, Default)]
    struct Switch(AtomicBool);

    impl OutputFence for Switch {
        fn holds(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }

    const BATCH: [OutputEvent; 1] = [OutputEvent {
        device: 0,
        kind: OutputKind::NetTransmits,
        requests: 1,
    }];

    #[test]
    fn outputs_pass_until_a_fence_stops_holding() {
        let slot = Arc::new(FenceSlot::default());
        let gate = FencedGate::wrap(slot.clone(), Arc::new(PassThroughGate));
        // No fence: the inner gate decides.
        assert_eq!(gate.before_output(&BATCH), Release::Now);
        assert!(gate.console_may_write());
        let fence = Arc::new(Switch(AtomicBool::new(true)));
        assert!(slot.set(fence.clone()));
        assert!(!slot.set(Arc::new(Switch::default())), "set once");
        assert_eq!(gate.before_output(&BATCH), Release::Now);
        assert_eq!(gate.checkpoint(&BATCH), Release::Now);
        fence.0.store(false, Ordering::SeqCst);
        assert_eq!(gate.before_output(&BATCH), Release::AtCheckpoint);
        assert_eq!(gate.checkpoint(&BATCH), Release::AtCheckpoint);
        assert!(!gate.console_may_write());
    }

    /// Confirms every ticket it hands out at once.
    #[derive(Debug)]
    struct Confirmed;

    impl OutputGate for Confirmed {
        fn before_output(&self, _batch: &[OutputEvent]) -> Release {
            Release::WhenConfirmed(7)
        }
        fn confirmed(&self) -> u64 {
            7
        }
    }

    #[test]
    fn a_batch_waiting_for_a_confirmation_never_goes_once_the_fence_is_lost() {
        let fence = Arc::new(Switch(AtomicBool::new(true)));
        let gate = FencedGate::wrap(
            Arc::new(FenceSlot::with(fence.clone())),
            Arc::new(Confirmed),
        );
        assert_eq!(gate.before_output(&BATCH), Release::WhenConfirmed(7));
        assert_eq!(gate.confirmed(), 7);
        // Lost between the epoch and its acknowledgement: held for good.
        fence.0.store(false, Ordering::SeqCst);
        assert_eq!(gate.confirmed(), 0);
        assert_eq!(gate.before_output(&BATCH), Release::AtCheckpoint);
    }
}
