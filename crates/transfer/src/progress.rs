//! Live progress of a hand-over, written by the thread that runs it and
//! read by the API at any time (`GET /vm/migration`, `GET /vm/operation`).
//! The counters that change with every frame are atomics, so a reader
//! never waits for the sender and the sender never waits for a reader.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

/// A copy of the progress.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Progress {
    /// "idle", "running", "completed", "failed", "cancelled".
    pub status: String,
    /// What the hand-over is doing now ("connecting", "round 1", "pausing",
    /// "committing"…).
    pub phase: String,
    /// The other end.
    pub to: String,
    /// Current pre-copy round (1 = every page in use).
    pub round: u32,
    /// Pages of the current round sent.
    pub round_pages_sent: u64,
    /// Pages the current round sends (0 when not known yet).
    pub round_pages_total: u64,
    /// Payload bytes sent so far.
    pub bytes_sent: u64,
    /// Pages sent so far.
    pub pages_sent: u64,
    /// Bandwidth measured end to end over the whole transfer so far, MB/s.
    pub rate_mb_s: f64,
    /// Pages dirtied per second since the harvest before the last one.
    pub dirty_pages_per_s: f64,
    /// Pages still to send (last harvest).
    pub remaining_pages: u64,
    /// Remaining pages over bandwidth, ms.
    pub estimated_downtime_ms: f64,
    /// Time since the start, ms.
    pub elapsed_ms: u64,
    /// Final report: guest paused time as the source saw it (pause to
    /// commit), ms.
    pub downtime_ms: Option<f64>,
    /// Final report: pause to the destination's `Running`, ms (None if it
    /// did not confirm).
    pub running_ms: Option<f64>,
    /// Final report: the whole hand-over, ms.
    pub total_ms: Option<f64>,
    /// Why the last round was the last ("converged", "round limit").
    pub stop_reason: Option<String>,
    /// Failure reason.
    pub error: Option<String>,
}

/// The shared, updatable progress of one hand-over.
#[derive(Debug, Default)]
pub struct ProgressCell {
    inner: Mutex<Progress>,
    started: Mutex<Option<Instant>>,
    bytes_sent: AtomicU64,
    pages_sent: AtomicU64,
    round_pages_sent: AtomicU64,
}

impl ProgressCell {
    /// A hand-over to `to` starts now.
    pub fn start(&self, to: &str) {
        *self.lock() = Progress {
            status: "running".into(),
            phase: "connecting".into(),
            to: to.into(),
            ..Default::default()
        };
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        for a in [&self.bytes_sent, &self.pages_sent, &self.round_pages_sent] {
            a.store(0, Ordering::Relaxed);
        }
    }

    /// Changes the fields `f` sets.
    pub fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.lock());
    }

    /// The phase.
    pub fn phase(&self, phase: &str) {
        self.update(|p| p.phase = phase.to_owned());
    }

    /// A new round of `total` pages (0: not known yet) begins.
    pub fn round(&self, round: u32, total: u64) {
        self.round_pages_sent.store(0, Ordering::Relaxed);
        self.update(|p| {
            p.round = round;
            p.round_pages_total = total;
            p.phase = format!("round {round}");
        });
    }

    /// `pages` more pages sent in the current round; `bytes_sent` and
    /// `pages_sent` so far in all.
    pub fn sent(&self, pages: u64, bytes_sent: u64, pages_sent: u64) {
        self.round_pages_sent.fetch_add(pages, Ordering::Relaxed);
        self.bytes_sent.store(bytes_sent, Ordering::Relaxed);
        self.pages_sent.store(pages_sent, Ordering::Relaxed);
    }

    /// A one-step operation (a snapshot's memory image) is `done` of
    /// `total` pages through, `bytes` written.
    pub fn step(&self, done: u64, total: u64, bytes: u64) {
        self.round_pages_sent.store(done, Ordering::Relaxed);
        self.pages_sent.store(done, Ordering::Relaxed);
        self.bytes_sent.store(bytes, Ordering::Relaxed);
        self.update(|p| p.round_pages_total = total);
    }

    /// It ended: `status` ("completed", "failed", "cancelled") and, for a
    /// failure, why.
    pub fn finish(&self, status: &str, error: Option<String>) {
        let elapsed = self.elapsed_ms();
        self.update(|p| {
            p.status = status.into();
            p.phase = status.into();
            p.error = error;
            p.elapsed_ms = elapsed;
        });
    }

    fn elapsed_ms(&self) -> u64 {
        self.started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(0, |t| t.elapsed().as_millis() as u64)
    }

    /// A copy, with the counters as they are now.
    pub fn snapshot(&self) -> Progress {
        let mut p = self.lock().clone();
        p.bytes_sent = p.bytes_sent.max(self.bytes_sent.load(Ordering::Relaxed));
        p.pages_sent = p.pages_sent.max(self.pages_sent.load(Ordering::Relaxed));
        p.round_pages_sent = self.round_pages_sent.load(Ordering::Relaxed);
        if p.status == "running" {
            p.elapsed_ms = self.elapsed_ms();
        }
        p
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_advance_without_the_lock_and_the_end_is_kept() {
        let c = ProgressCell::default();
        assert_eq!(c.snapshot().status, "");
        c.start("h:1");
        c.round(1, 1000);
        c.sent(256, 1 << 20, 256);
        c.sent(256, 2 << 20, 512);
        let p = c.snapshot();
        assert_eq!(
            (
                p.status.as_str(),
                p.phase.as_str(),
                p.round_pages_sent,
                p.bytes_sent
            ),
            ("running", "round 1", 512, 2 << 20)
        );
        c.finish("failed", Some("why".into()));
        let p = c.snapshot();
        assert_eq!(
            (p.status.as_str(), p.error.as_deref()),
            ("failed", Some("why"))
        );
        assert_eq!(p.pages_sent, 512);
    }
}
