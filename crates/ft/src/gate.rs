//! The output gate of a protected VM: one sync (epoch) per batch of outputs
//! (or per period).
//!
//! A sync: pause the vCPUs, harvest the pages dirtied since the last sync
//! (guest writes from the KVM dirty ring, VMM writes from its own queue),
//! copy them and save the whole VM state, **resume the vCPUs**, then send
//! the epoch; the outputs go once the standby acknowledged it. The guest is
//! paused only for the capture; the transfer overlaps with its execution,
//! while the outputs — the only thing the outside world can see — wait.
//!
//! In event-driven mode the device event loop does not wait either: the
//! gate answers [`Release::WhenConfirmed`] with the epoch, and the loop
//! serves received frames and other queues — and captures the next epoch,
//! up to `epochs_in_flight` unacknowledged at once — until the link's
//! socket says the acknowledgement came ([`OutputGate::confirmed`]). The
//! standby takes epochs in order, so each one's state is sent as a delta
//! against the previous epoch *sent*.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm::machine::{MachineCore, PauseLength};
use vmm::memory::GuestMemoryMmap;
use vmm::output::{OutputEvent, OutputGate, Release};
use vmm::persist::format;

use transfer::message::{Kind, Message};
use transfer::pages::{PageFrame, MAX_PAGES_PER_FRAME};
use transfer::precopy::read_page;
use transfer::TransferError;

use crate::epoch::pack_state;
use crate::kept::{KeptPages, COLD_RESET};
use crate::link::Link;
use crate::status::{FtShared, FtState};
use crate::{FtError, SyncMode};

/// The output gate of a protected VM.
pub struct FtGate {
    core: Arc<MachineCore>,
    mode: SyncMode,
    link: Mutex<Option<Arc<Link>>>,
    /// The last epoch captured and sent.
    epoch: AtomicU64,
    /// The last epoch sent's state (the next one is sent as a delta).
    prev_state: Mutex<Vec<u8>>,
    /// Epochs sent, not yet acknowledged, oldest first.
    in_flight: Mutex<VecDeque<SentEpoch>>,
    /// How many epochs may be unacknowledged at once (event-driven mode).
    epochs_in_flight: usize,
    /// Page frames reused by every sync.
    frames: Mutex<Vec<PageFrame>>,
    /// Keep the vCPUs paused until the standby acknowledged (the paper's
    /// way) instead of resuming them once the epoch is captured.
    hold_vcpus: bool,
    /// Pages the guest rewrites from sync to sync are left writable (so it
    /// takes no write-protection fault on them), up to this many (see
    /// `DirtyTracker::harvest_paused_keep_writable`). Each costs a 4 KiB
    /// comparison per sync, and is sent only when it changed.
    keep_writable: usize,
    /// The standby's copy of the pages left writable.
    kept: Mutex<KeptPages>,
    shared: Arc<FtShared>,
}

/// An epoch on its way: what its acknowledgement completes in the metrics.
#[derive(Debug)]
struct SentEpoch {
    epoch: u64,
    pages: u64,
    bytes: u64,
    outputs: u64,
    pause: Duration,
    started: Instant,
}

impl std::fmt::Debug for FtGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FtGate")
            .field("mode", &self.mode)
            .field("epoch", &self.epoch.load(Ordering::SeqCst))
            .field("link", &self.current_link())
            .finish()
    }
}

/// Reads pages `pfns` from guest memory into the frames of `pool` (grown as
/// needed, reused from sync to sync: no allocation and no page faults on
/// the guest's pause path), zero pages as markers, each page copied once,
/// straight into its frame. Returns how many frames of `pool` hold pages.
fn fill_frames(
    mem: &GuestMemoryMmap,
    pfns: &[u64],
    pool: &mut Vec<PageFrame>,
) -> Result<usize, TransferError> {
    let mut used = 0;
    for chunk in pfns.chunks(MAX_PAGES_PER_FRAME) {
        if pool.len() == used {
            pool.push(PageFrame::new());
        }
        let frame = &mut pool[used];
        frame.clear();
        for &pfn in chunk {
            frame.push_with(pfn, false, |data| read_page(mem, pfn, data))?;
        }
        used += 1;
    }
    Ok(used)
}

impl FtGate {
    /// A gate for the VM of `core`, protected over `link`.
    pub(crate) fn new(
        core: Arc<MachineCore>,
        mode: SyncMode,
        link: Arc<Link>,
        keep_writable: usize,
        hold_vcpus: bool,
        epochs_in_flight: usize,
        shared: Arc<FtShared>,
    ) -> Self {
        FtGate {
            core,
            mode,
            link: Mutex::new(Some(link)),
            epoch: AtomicU64::new(0),
            prev_state: Mutex::new(Vec::new()),
            in_flight: Mutex::new(VecDeque::new()),
            epochs_in_flight: epochs_in_flight.max(1),
            frames: Mutex::new(Vec::new()),
            hold_vcpus,
            keep_writable,
            kept: Mutex::new(KeptPages::default()),
            shared,
        }
    }

    fn current_link(&self) -> Option<Arc<Link>> {
        self.link.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Captures and sends one epoch (plus pages `extra` found dirty
    /// earlier), and waits for its acknowledgement.
    pub(crate) fn sync_epoch(
        &self,
        link: &Link,
        batch: &[OutputEvent],
        extra: Vec<u64>,
    ) -> Result<(), FtError> {
        let epoch = self.capture_and_send(link, batch, extra)?;
        link.wait("waiting for the standby to acknowledge an epoch", |l| {
            l.acked() >= epoch
        })?;
        self.complete(link.acked());
        Ok(())
    }

    /// Records the epochs up to `acked` as done (metrics, status).
    fn complete(&self, acked: u64) {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        while in_flight.front().is_some_and(|e| e.epoch <= acked) {
            let Some(e) = in_flight.pop_front() else {
                break;
            };
            tracing::debug!(
                epoch = e.epoch,
                acked_us = e.started.elapsed().as_micros() as u64,
                "epoch acknowledged"
            );
            self.shared.record_sync(
                e.epoch,
                e.pages,
                e.bytes,
                e.outputs,
                e.pause,
                e.started.elapsed(),
            );
        }
        self.shared.set_unacknowledged(in_flight.len() as u64);
    }

    /// Captures one epoch (plus pages `extra` found dirty earlier) and
    /// sends it; returns its number.
    fn capture_and_send(
        &self,
        link: &Link,
        batch: &[OutputEvent],
        extra: Vec<u64>,
    ) -> Result<u64, FtError> {
        let started = Instant::now();
        let epoch = self.epoch.load(Ordering::SeqCst) + 1;
        let mut pool = self.frames.lock().unwrap_or_else(|p| p.into_inner());
        // Each vCPU saves its own state as soon as it has stopped.
        let vcpus = self.core.pause_and_save_vcpus(PauseLength::Brief);
        let t_paused = started.elapsed();
        let captured = (|| -> Result<_, FtError> {
            let vcpus = vcpus?;
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            // Pages that stopped changing are re-protected (all pages are: a
            // reset cannot choose), so the writable set follows what the
            // guest rewrites now.
            let max_writable = if kept.cold() >= COLD_RESET {
                0
            } else {
                self.keep_writable
            };
            let harvest = self.core.harvest_dirty_paused_keep_writable(max_writable)?;
            let t_harvest = started.elapsed();
            let mem = self.core.guest_memory();
            let mut pfns = harvest.dirty;
            let carried = harvest.carried.len();
            let changed = kept.changed(mem, &harvest.carried)?;
            let kept_stats = (harvest.kept.len() as u64, (carried - changed.len()) as u64);
            pfns.extend(changed);
            if !extra.is_empty() {
                pfns.extend(extra);
                pfns.sort_unstable();
                pfns.dedup();
            }
            let frames = fill_frames(mem, &pfns, &mut pool)?;
            kept.refresh(mem, &harvest.kept, &pfns)?;
            let t_pages = started.elapsed();
            let state = self.core.state_with_vcpus(vcpus)?;
            tracing::debug!(
                epoch,
                pages = pfns.len(),
                carried,
                kept = harvest.kept.len(),
                paused_us = t_paused.as_micros() as u64,
                harvested_us = t_harvest.as_micros() as u64,
                copied_us = t_pages.as_micros() as u64,
                saved_us = started.elapsed().as_micros() as u64,
                "sync capture"
            );
            Ok((pfns.len() as u64, frames, state, kept_stats))
        })();
        let hold = self.hold_vcpus && captured.is_ok();
        let resumed = if hold {
            Ok(())
        } else {
            self.core.resume_vcpus()
        };
        let pause = started.elapsed();
        let (pages, frames, state, (kept, skipped)) = captured?;
        resumed?;
        self.shared.record_kept(kept, skipped);
        let result = self.send_epoch(
            link,
            epoch,
            batch,
            pages,
            &mut pool[..frames],
            state,
            started,
            pause,
        );
        if hold {
            // The paper's way: the guest waits for the acknowledgement too.
            let acked = result.as_ref().map_err(|_| ()).and_then(|_| {
                link.wait("waiting for the standby to acknowledge an epoch", |l| {
                    l.acked() >= epoch
                })
                .map_err(|_| ())
            });
            self.core.resume_vcpus()?;
            if acked.is_ok() {
                self.complete(link.acked());
            }
        }
        result.map(|()| epoch)
    }

    #[allow(clippy::too_many_arguments)]
    fn send_epoch(
        &self,
        link: &Link,
        epoch: u64,
        batch: &[OutputEvent],
        pages: u64,
        frames: &mut [PageFrame],
        state: vmm::persist::VmState,
        started: Instant,
        pause: Duration,
    ) -> Result<(), FtError> {
        let outputs: u64 = batch.iter().map(|e| u64::from(e.requests)).sum();
        // Encoding takes a few µs (binary state, LZ4 delta): the whole
        // epoch then goes out in one write, and the standby wakes once for
        // it. One writer lock for the whole epoch: no heartbeat may come
        // between its frames.
        let state = format::encode(&state)
            .map_err(|e| TransferError::Memory(format!("encoding the state: {e}")))?;
        let packed = {
            let prev = self.prev_state.lock().unwrap_or_else(|p| p.into_inner());
            pack_state(&state, &prev)
        };
        let packed_len = packed.len();
        let bytes = link.send(|w| {
            w.set_phase("sending an epoch");
            for f in frames.iter_mut() {
                w.send(Kind::EpochPages, f.payload(epoch as u32))?;
            }
            w.send_msg(&Message::EpochEnd {
                epoch,
                pages,
                outputs,
            })?;
            w.send(Kind::State, &packed)
        })?;
        link.note_sent(epoch);
        tracing::debug!(
            epoch,
            pause_us = pause.as_micros() as u64,
            sent_us = started.elapsed().as_micros() as u64,
            state_bytes = state.len(),
            packed_bytes = packed_len,
            "epoch sent"
        );
        self.epoch.store(epoch, Ordering::SeqCst);
        // The standby unpacks the next epoch against this one.
        *self.prev_state.lock().unwrap_or_else(|p| p.into_inner()) = state;
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        in_flight.push_back(SentEpoch {
            epoch,
            pages,
            bytes,
            outputs,
            pause,
            started,
        });
        self.shared.set_unacknowledged(in_flight.len() as u64);
        Ok(())
    }

    fn sync(&self, batch: &[OutputEvent]) {
        let Some(link) = self.current_link() else {
            return;
        };
        if let Err(e) = self.sync_epoch(&link, batch, Vec::new()) {
            self.degrade(&e.to_string());
        }
    }

    /// Event-driven: the epoch of `batch` is captured and sent; the batch
    /// goes once it is acknowledged.
    fn sync_async(&self, batch: &[OutputEvent]) -> Release {
        let Some(link) = self.current_link() else {
            return Release::Now;
        };
        if self.hold_vcpus {
            self.sync(batch);
            return Release::Now;
        }
        match self.capture_and_send(&link, batch, Vec::new()) {
            Ok(epoch) => Release::WhenConfirmed(epoch),
            Err(e) => {
                self.degrade(&e.to_string());
                Release::Now
            }
        }
    }

    /// The standby is lost: run on unprotected (outputs pass at once).
    pub fn degrade(&self, why: &str) {
        let link = self.link.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(link) = link {
            link.close();
            tracing::warn!(
                reason = why,
                "fault tolerance: standby lost, running unprotected (degraded)"
            );
            self.shared.set_error(why);
            self.shared.set_state(FtState::Degraded);
            if let Err(e) = self.core.dirty_tracker().stop() {
                tracing::warn!(error = %e, "cannot stop dirty tracking");
            }
        }
    }

    /// Ends protection normally: the standby is told to exit.
    pub fn stop(&self, reason: &str) {
        let link = self.link.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(link) = link {
            let _ = link.send_msg(&Message::Stop {
                reason: reason.to_owned(),
            });
            link.close();
            let _ = self.core.dirty_tracker().stop();
        }
        self.shared.set_state(FtState::Unprotected);
        tracing::info!(reason, "fault tolerance stopped");
    }

    /// Whether outputs currently wait for the standby.
    pub fn is_protecting(&self) -> bool {
        self.current_link().is_some()
    }
}

impl OutputGate for FtGate {
    fn before_output(&self, batch: &[OutputEvent]) -> Release {
        match self.mode {
            SyncMode::Periodic(_) if self.is_protecting() => Release::AtCheckpoint,
            SyncMode::Periodic(_) => Release::Now,
            SyncMode::EventDriven => self.sync_async(batch),
        }
    }

    fn confirmed(&self) -> u64 {
        let Some(link) = self.current_link() else {
            return u64::MAX;
        };
        match link.poll_acks() {
            Ok(acked) => {
                self.complete(acked);
                acked
            }
            Err(e) => {
                self.degrade(&e.to_string());
                u64::MAX
            }
        }
    }

    fn confirmation_fds(&self) -> Vec<std::os::fd::RawFd> {
        match (self.mode, self.current_link()) {
            (SyncMode::EventDriven, Some(link)) => vec![link.socket_fd(), link.wake_fd()],
            _ => Vec::new(),
        }
    }

    fn max_unconfirmed(&self) -> usize {
        self.epochs_in_flight
    }

    fn checkpoint_interval(&self) -> Option<Duration> {
        match self.mode {
            SyncMode::Periodic(p) => Some(p),
            SyncMode::EventDriven => None,
        }
    }

    fn checkpoint(&self, batch: &[OutputEvent]) -> Release {
        self.sync(batch);
        Release::Now
    }
}
