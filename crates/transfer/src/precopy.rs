//! The one pre-copy loop (live migration and the fault-tolerance initial
//! synchronization), with a pluggable rule for when to stop.
//!
//! Round 1 sends every non-zero page of the memory file's data extents
//! (memory the guest never touched is a hole and is skipped; the receiver's
//! memory is fresh, hence zero) in ascending page order. Every 2,048 pages it
//! harvests the dirty tracker without kicking the vCPUs: a page dirtied
//! *ahead* of the cursor is read by this round after that write anyway, so
//! only the others wait for round 2. Each later round harvests the tracker
//! (KVM's dirty ring plus the VMM's own writes, O(dirty)) and sends those
//! pages, zero pages as markers. Every round ends with `RoundEnd` and waits
//! for `RoundAck`, so bandwidth is measured end to end and nothing is left in
//! socket buffers when the guest pauses. After each harvest the
//! [`StopRule`] decides: another round, or stop (the caller then pauses the
//! guest and sends what is left with the state).

use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::machine::{Machine, MachineError};
use vmm::memory::GuestMemoryMmap;

use crate::cancel::Cancel;
use crate::error::TransferError;
use crate::link::RoundLink;
use crate::pages::{ranges_of_extents, will_visit, PageFrame, PAGE};
use crate::progress::ProgressCell;
use crate::sys;
use crate::throttle::Throttle;

/// Pages round 1 sends between two harvests of the dirty tracker (8 MiB).
const ROUND1_HARVEST_PAGES: usize = 2048;

/// Reads guest pages straight from the guest's memory mapping into a frame
/// built in place (one copy per page, no allocation per page) and sends
/// each frame when full.
pub struct PageSender<'m> {
    memory: &'m GuestMemoryMmap,
    frame: PageFrame,
    /// The bandwidth cap of the rounds the guest runs through, if any.
    throttle: Option<Throttle>,
    /// Pages sent so far.
    pub pages: u64,
}

impl<'m> PageSender<'m> {
    /// A sender reading from `memory`.
    pub fn new(memory: &'m GuestMemoryMmap) -> Self {
        PageSender {
            memory,
            frame: PageFrame::new(),
            throttle: None,
            pages: 0,
        }
    }

    /// Caps the bandwidth of the frames sent by [`page`](Self::page) and
    /// [`flush`](Self::flush) (the rounds while the guest runs; not what
    /// [`take_payload`](Self::take_payload) gives to the pause).
    pub fn with_throttle(mut self, throttle: Option<Throttle>) -> Self {
        self.throttle = throttle;
        self
    }

    /// Queues page `pfn` of round `round`; `skip_zero` drops zero pages
    /// (the receiver's fresh memory is zero) instead of sending a marker.
    pub fn page<L: RoundLink + ?Sized>(
        &mut self,
        link: &mut L,
        round: u32,
        pfn: u64,
        skip_zero: bool,
    ) -> Result<(), TransferError> {
        let memory = self.memory;
        // The guest may be writing this page right now: what is read here
        // is at least as new as the write that made it dirty, and any later
        // write is harvested and sent again.
        self.frame
            .push_with(pfn, skip_zero, |data| read_page(memory, pfn, data))?;
        if self.frame.is_full() {
            self.flush(link, round)?;
        }
        Ok(())
    }

    /// Sends the pages queued, if any.
    pub fn flush<L: RoundLink + ?Sized>(
        &mut self,
        link: &mut L,
        round: u32,
    ) -> Result<(), TransferError> {
        if self.frame.count() == 0 {
            return Ok(());
        }
        let n = self.frame.count() as u64;
        let bytes = self.frame.payload(round).len() as u64;
        // The cap holds the sum over every stream the frames go to.
        if let Some(t) = &mut self.throttle {
            t.wait(bytes);
        }
        link.send_frame(&mut self.frame, round)?;
        self.pages += n;
        Ok(())
    }

    /// The pages queued as a payload of round `round`, if any; counted as
    /// sent (the caller sends them, e.g. with the state in one write).
    pub fn take_payload(&mut self, round: u32) -> Option<&[u8]> {
        if self.frame.count() == 0 {
            return None;
        }
        self.pages += self.frame.count() as u64;
        let payload = self.frame.payload(round);
        Some(payload)
    }

    /// Empties the frame after [`take_payload`](Self::take_payload)'s
    /// bytes were sent.
    pub fn clear(&mut self) {
        self.frame.clear();
    }
}

/// Reads guest page `pfn` into `buf` (one page long).
pub fn read_page(mem: &GuestMemoryMmap, pfn: u64, buf: &mut [u8]) -> Result<(), TransferError> {
    let addr = pfn
        .checked_mul(PAGE as u64)
        .ok_or_else(|| TransferError::Memory(format!("page {pfn:#x} is not RAM")))?;
    mem.read_slice(buf, GuestAddress(addr))
        .map_err(|e| TransferError::Memory(format!("page {pfn:#x}: {e}")))
}

/// What the loop knows after a harvest.
#[derive(Debug, Clone, Copy)]
pub struct RoundFacts {
    /// The round just acknowledged (1 = the full copy).
    pub round: u32,
    /// Pages dirty now (what the next round, or the pause, would send).
    pub remaining: u64,
    /// Pages the last round sent.
    pub sent_last_round: u64,
    /// Remaining pages over the bandwidth measured so far.
    pub estimate: Duration,
}

/// What the rule decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send the dirty pages while the guest runs, then harvest again.
    Iterate,
    /// Stop now, for this reason ("converged", "round limit").
    Stop(&'static str),
}

/// When to stop pre-copying.
pub trait StopRule {
    /// Decides after a harvest.
    fn decide(&mut self, facts: &RoundFacts) -> Decision;
}

/// Live migration's rule (docs/migration-protocol.md): pause when the pages
/// still dirty would move within `settle` (another round cannot gain
/// anything), or when they fit `max_downtime` and the last round did not
/// shrink the dirty set by a quarter; otherwise iterate, up to
/// `max_rounds`.
#[derive(Debug, Clone, Copy)]
pub struct DowntimeEstimate {
    /// Pause once the rest is estimated to move within this.
    pub max_downtime: Duration,
    /// Pause after this many rounds whatever remains.
    pub max_rounds: u32,
    /// Pause at once when the rest moves within this (capped at
    /// `max_downtime`).
    pub settle: Duration,
}

impl Default for DowntimeEstimate {
    fn default() -> Self {
        DowntimeEstimate {
            max_downtime: Duration::from_millis(300),
            max_rounds: 30,
            settle: Duration::from_millis(1),
        }
    }
}

impl StopRule for DowntimeEstimate {
    fn decide(&mut self, f: &RoundFacts) -> Decision {
        let settle = self.settle.min(self.max_downtime);
        let not_shrinking = f.remaining.saturating_mul(4) >= f.sent_last_round.saturating_mul(3);
        if f.estimate <= settle || (f.estimate <= self.max_downtime && not_shrinking) {
            Decision::Stop("converged")
        } else if f.round >= self.max_rounds {
            Decision::Stop("round limit")
        } else {
            Decision::Iterate
        }
    }
}

/// Fault tolerance's rule: the first image only has to be complete, so
/// stop once few pages are dirty or after a few rounds; the first epoch
/// then carries the rest.
#[derive(Debug, Clone, Copy)]
pub struct FirstConvergence {
    /// Few enough dirty pages to stop.
    pub enough_pages: u64,
    /// Rounds at most.
    pub max_rounds: u32,
}

impl Default for FirstConvergence {
    fn default() -> Self {
        FirstConvergence {
            enough_pages: 512,
            max_rounds: 5,
        }
    }
}

impl StopRule for FirstConvergence {
    fn decide(&mut self, f: &RoundFacts) -> Decision {
        if f.remaining <= self.enough_pages {
            Decision::Stop("converged")
        } else if f.round >= self.max_rounds {
            Decision::Stop("round limit")
        } else {
            Decision::Iterate
        }
    }
}

/// Where the pre-copy ended.
#[derive(Debug)]
pub struct PreCopied {
    /// Pages dirty at the last harvest: they go with the guest paused.
    pub carry: Vec<u64>,
    /// The last round sent.
    pub rounds: u32,
    /// Why it stopped.
    pub stop_reason: &'static str,
    /// Pages sent.
    pub pages: u64,
}

/// Runs the pre-copy of `machine` (dirty tracking is started here, before
/// round 1, so nothing written during it is missed) over `link`, pages
/// read through `sender`, until `rule` stops it; checks `cancel` between
/// harvests and reports to `progress`. On error the caller stops dirty
/// tracking and resumes what it paused.
pub fn run<L: RoundLink + ?Sized>(
    machine: &Machine,
    link: &mut L,
    sender: &mut PageSender<'_>,
    rule: &mut dyn StopRule,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<PreCopied, TransferError> {
    let t = Instant::now();
    // Not in the pause, which is a long way off yet.
    machine.prepare_to_save();
    machine.start_dirty_log()?;
    tracing::debug!(
        ms = t.elapsed().as_secs_f64() * 1000.0,
        "pre-copy: dirty logging on"
    );
    let mem_size = machine.memory_file().size();
    let started = Instant::now();
    // Bandwidth over the whole transfer (every round's bytes over every
    // round's time), not over the last round alone: a small last round is
    // dominated by fixed costs and would understate it.
    let mut send_bytes = 0u64;
    let mut send_time = Duration::ZERO;

    let mut round = 1u32;
    let t_round = Instant::now();
    let bytes_before = link.bytes_sent();
    let visit = ranges_of_extents(
        &sys::data_extents(machine.memory_file().file(), mem_size),
        mem_size,
    );
    let total: u64 = visit.iter().map(|&(a, b)| b - a).sum();
    progress.round(1, total);
    link.set_phase("sending memory (round 1)".into());
    let mut early: Vec<u64> = Vec::new();
    let mut since_harvest = 0usize;
    let mut skipped = 0usize;
    let mut harvest_time = Duration::ZERO;
    for (i, &(first, end)) in visit.iter().enumerate() {
        for pfn in first..end {
            sender.page(link, round, pfn, true)?;
            since_harvest += 1;
            if since_harvest == ROUND1_HARVEST_PAGES {
                since_harvest = 0;
                progress.sent(ROUND1_HARVEST_PAGES as u64, link.bytes_sent(), sender.pages);
                let ahead = &visit[i..];
                // Without kicking the vCPUs: a page still in a CPU buffer
                // is merely reported later, and resent then.
                let th = Instant::now();
                let got = machine
                    .dirty_tracker()
                    .harvest()
                    .map_err(MachineError::from)?;
                harvest_time += th.elapsed();
                let n = got.len();
                let before = early.len();
                early.extend(got.into_iter().filter(|&p| !will_visit(ahead, pfn, p)));
                skipped += n - (early.len() - before);
                cancel.check("sending memory (round 1)")?;
            }
        }
    }
    sender.flush(link, round)?;
    progress.sent(since_harvest as u64, link.bytes_sent(), sender.pages);
    link.set_phase("waiting for the end of round 1 to be acknowledged".into());
    link.end_round(round, sender.pages)?;
    tracing::debug!(
        skipped,
        harvest_ms = harvest_time.as_secs_f64() * 1000.0,
        "round 1: pages dirtied ahead of the cursor, not resent; time in harvests"
    );
    let mut sent_last_round = sender.pages;
    note_round(
        round,
        sent_last_round,
        link.bytes_sent() - bytes_before,
        t_round.elapsed(),
    );
    send_bytes += link.bytes_sent() - bytes_before;
    send_time += t_round.elapsed();
    let mut last_harvest = t_round;
    loop {
        let mut dirty = machine.harvest_dirty()?;
        if !early.is_empty() {
            dirty.append(&mut early);
            dirty.sort_unstable();
            dirty.dedup();
        }
        let dirty_rate = dirty.len() as f64 / last_harvest.elapsed().as_secs_f64().max(1e-6);
        last_harvest = Instant::now();
        let bw = send_bytes.max(1) as f64 / send_time.as_secs_f64().max(1e-6);
        let estimate = Duration::from_secs_f64(dirty.len() as f64 * PAGE as f64 / bw);
        progress.update(|p| {
            p.round = round;
            p.bytes_sent = link.bytes_sent();
            p.pages_sent = sender.pages;
            p.rate_mb_s = bw / 1e6;
            p.dirty_pages_per_s = dirty_rate;
            p.remaining_pages = dirty.len() as u64;
            p.estimated_downtime_ms = estimate.as_secs_f64() * 1000.0;
            p.elapsed_ms = started.elapsed().as_millis() as u64;
        });
        cancel.check(&format!("pre-copying (after round {round})"))?;
        let facts = RoundFacts {
            round,
            remaining: dirty.len() as u64,
            sent_last_round,
            estimate,
        };
        if let Decision::Stop(reason) = rule.decide(&facts) {
            return Ok(PreCopied {
                carry: dirty,
                rounds: round,
                stop_reason: reason,
                pages: sender.pages,
            });
        }
        round += 1;
        let t_round = Instant::now();
        let (before, pages_before) = (link.bytes_sent(), sender.pages);
        progress.round(round, dirty.len() as u64);
        link.set_phase(format!("sending memory (round {round})"));
        for (i, pfn) in dirty.into_iter().enumerate() {
            sender.page(link, round, pfn, false)?;
            if i % 256 == 255 {
                progress.sent(256, link.bytes_sent(), sender.pages);
            }
        }
        sender.flush(link, round)?;
        link.set_phase(format!(
            "waiting for the end of round {round} to be acknowledged"
        ));
        link.end_round(round, sender.pages)?;
        sent_last_round = sender.pages - pages_before;
        let took = t_round.elapsed();
        note_round(round, sent_last_round, link.bytes_sent() - before, took);
        send_bytes += link.bytes_sent() - before;
        send_time += took;
    }
}

fn note_round(round: u32, pages: u64, bytes: u64, took: Duration) {
    tracing::debug!(
        round,
        pages,
        bytes,
        cpu_ms = sys::thread_cpu_ms(),
        ms = took.as_secs_f64() * 1000.0,
        mb_s = bytes as f64 / took.as_secs_f64().max(1e-6) / 1e6,
        "pre-copy round sent"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(round: u32, estimate_ms: u64, remaining: u64, sent_last_round: u64) -> RoundFacts {
        RoundFacts {
            round,
            remaining,
            sent_last_round,
            estimate: Duration::from_millis(estimate_ms),
        }
    }

    #[test]
    fn the_downtime_rule() {
        let mut limits = DowntimeEstimate {
            max_downtime: Duration::from_millis(300),
            max_rounds: 5,
            settle: Duration::from_millis(1),
        };
        let converged = Decision::Stop("converged");
        let limit = Decision::Stop("round limit");
        // Little left: pause at once, whatever the trend.
        assert_eq!(limits.decide(&facts(1, 1, 10, 1)), converged);
        // Within the limit but shrinking fast: another round pays.
        assert_eq!(limits.decide(&facts(1, 10, 1500, 16000)), Decision::Iterate);
        // Within the limit and no longer shrinking: pause.
        assert_eq!(limits.decide(&facts(3, 10, 1400, 1500)), converged);
        // Over the limit: iterate up to the round limit.
        assert_eq!(limits.decide(&facts(3, 400, 9000, 9000)), Decision::Iterate);
        assert_eq!(limits.decide(&facts(5, 400, 9000, 9000)), limit);
        assert_eq!(limits.decide(&facts(5, 10, 1500, 16000)), limit);
        // The settle time never exceeds the downtime limit.
        limits.max_downtime = Duration::from_micros(100);
        assert_eq!(limits.decide(&facts(1, 1, 10, 10000)), Decision::Iterate);
    }

    #[test]
    fn the_first_convergence_rule() {
        let mut rule = FirstConvergence::default();
        assert_eq!(
            rule.decide(&facts(1, 0, 512, 9)),
            Decision::Stop("converged")
        );
        assert_eq!(rule.decide(&facts(1, 0, 513, 9)), Decision::Iterate);
        assert_eq!(
            rule.decide(&facts(5, 0, 9999, 9)),
            Decision::Stop("round limit")
        );
    }
}
