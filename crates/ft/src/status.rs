//! Fault-tolerance state and metrics, shared between the synchronizing
//! threads and the API thread (`GET /vm/ft`, `kemarictl ft status`).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use serde::Serialize;
use transfer::ProgressCell;

use crate::rate::WindowedRate;

/// Where a VMM stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FtState {
    /// No fault tolerance.
    Unprotected,
    /// Primary: initial synchronization under way.
    Syncing,
    /// Primary: every output waits for the standby's acknowledgement.
    Protected,
    /// Primary: the standby was lost; running unprotected.
    Degraded,
    /// Standby: receiving synchronizations.
    Standby,
    /// Standby: primary lost, taking over.
    FailingOver,
    /// Standby that took over: the VM runs here (unprotected).
    FailedOver,
}

/// Progress of the initial synchronization.
#[derive(Debug, Clone, Serialize)]
pub struct InitialProgress {
    /// Pre-copy round (1 = every page in use).
    pub round: u32,
    /// Pages of the round sent.
    pub pages_sent: u64,
    /// Pages in the round.
    pub pages_total: u64,
    /// Payload bytes sent so far.
    pub bytes_sent: u64,
}

/// Durations kept for the percentiles.
const HISTORY: usize = 4096;

/// The figures the API reports.
#[derive(Debug, Clone, Serialize)]
pub struct FtReport {
    /// "primary", "standby" or "none".
    pub role: &'static str,
    /// State.
    pub state: FtState,
    /// "event" or "periodic".
    pub mode: String,
    /// Checkpoint period for "periodic", ms.
    pub period_ms: Option<u64>,
    /// The other end.
    pub peer: String,
    /// Last complete epoch (sent and acknowledged, or received and applied).
    pub epoch: u64,
    /// Syncs (epochs) since protection began.
    pub syncs: u64,
    /// Syncs per second over the last 10 s (since the first sync if that
    /// is shorter; never over less than a second).
    pub syncs_per_s: f64,
    /// Output requests released after a sync.
    pub outputs: u64,
    /// Pages sent (or received) in epochs.
    pub pages: u64,
    /// Mean pages per sync.
    pub pages_per_sync: f64,
    /// Primary: pages left writable after the last sync (the guest rewrites
    /// them without a write-protection fault; see `keep_writable_pages`).
    pub kept_writable_pages: u64,
    /// Primary: kept pages found unchanged at a sync and so not sent.
    pub unchanged_pages_skipped: u64,
    /// Primary, event-driven: most epochs unacknowledged at once
    /// (`epochs_in_flight`).
    pub epochs_in_flight: Option<usize>,
    /// Primary: epochs sent and not yet acknowledged, now.
    pub epochs_unacknowledged: u64,
    /// Mean payload bytes per sync.
    pub bytes_per_sync: f64,
    /// Sync-link payload bytes sent and received, initial copy included.
    pub link_bytes: u64,
    /// Guest pause per sync (capture of pages and state), microseconds: p50.
    pub pause_us_p50: u64,
    /// Guest pause per sync, p99.
    pub pause_us_p99: u64,
    /// Output delay per sync (pause + transfer + acknowledgement), p50.
    pub sync_us_p50: u64,
    /// Output delay per sync, p99.
    pub sync_us_p99: u64,
    /// Initial synchronization time, ms.
    pub initial_sync_ms: Option<u64>,
    /// Initial synchronization progress: pre-copy round (1 = every page in
    /// use), pages of it sent and its total; null once protected.
    pub initial_progress: Option<InitialProgress>,
    /// Failovers performed by this VMM.
    pub failovers: u64,
    /// Failover time (primary lost to VM running), ms.
    pub failover_ms: Option<u64>,
    /// Last error (why degraded, why the failover happened).
    pub last_error: Option<String>,
}

#[derive(Debug)]
struct Inner {
    role: &'static str,
    state: FtState,
    mode: String,
    period_ms: Option<u64>,
    peer: String,
    epoch: u64,
    syncs: u64,
    outputs: u64,
    pages: u64,
    sync_bytes: u64,
    link_bytes: u64,
    kept: u64,
    skipped: u64,
    epochs_in_flight: Option<usize>,
    unacked: u64,
    pauses: VecDeque<u32>,
    delays: VecDeque<u32>,
    sync_rate: WindowedRate,
    initial_sync_ms: Option<u64>,
    failovers: u64,
    failover_ms: Option<u64>,
    last_error: Option<String>,
}

/// Shared state and metrics.
#[derive(Debug)]
pub struct FtShared {
    inner: Mutex<Inner>,
    /// Progress of the initial synchronization (the transfer layer's
    /// pre-copy writes it).
    pub initial: std::sync::Arc<ProgressCell>,
    /// Guest pause per sync, seconds, over the process's life (every
    /// protection; `GET /metrics`).
    pub pause_seconds: Histogram,
    /// Output delay per sync (pause + transfer + acknowledgement), seconds,
    /// over the process's life.
    pub sync_seconds: Histogram,
}

/// Bounds of [`FtShared::pause_seconds`]: 10 µs to ~0.3 s.
fn pause_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(10e-6, 2.0, 16)
}

/// Bounds of [`FtShared::sync_seconds`]: 50 µs to ~1.6 s.
fn sync_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(50e-6, 2.0, 16)
}

impl Default for FtShared {
    fn default() -> Self {
        FtShared {
            inner: Mutex::new(Inner {
                role: "none",
                state: FtState::Unprotected,
                mode: String::new(),
                period_ms: None,
                peer: String::new(),
                epoch: 0,
                syncs: 0,
                outputs: 0,
                pages: 0,
                sync_bytes: 0,
                link_bytes: 0,
                kept: 0,
                skipped: 0,
                epochs_in_flight: None,
                unacked: 0,
                pauses: VecDeque::new(),
                delays: VecDeque::new(),
                sync_rate: WindowedRate::default(),
                initial_sync_ms: None,
                failovers: 0,
                failover_ms: None,
                last_error: None,
            }),
            initial: Default::default(),
            pause_seconds: Histogram::new(pause_buckets()),
            sync_seconds: Histogram::new(sync_buckets()),
        }
    }
}

fn percentile(values: &VecDeque<u32>, p: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let mut v: Vec<u32> = values.iter().copied().collect();
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    u64::from(v[i.min(v.len() - 1)])
}

fn push(q: &mut VecDeque<u32>, d: Duration) {
    if q.len() == HISTORY {
        q.pop_front();
    }
    q.push_back(u32::try_from(d.as_micros()).unwrap_or(u32::MAX));
}

impl FtShared {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A new protection begins (primary) or is awaited (standby).
    pub fn begin(
        &self,
        role: &'static str,
        state: FtState,
        peer: &str,
        mode: &str,
        period: Option<Duration>,
    ) {
        self.with(|i| {
            i.role = role;
            i.state = state;
            i.peer = peer.to_owned();
            i.mode = mode.to_owned();
            i.period_ms = period.map(|p| p.as_millis() as u64);
            i.epoch = 0;
            i.syncs = 0;
            i.kept = 0;
            i.skipped = 0;
            i.epochs_in_flight = None;
            i.unacked = 0;
            i.outputs = 0;
            i.pages = 0;
            i.sync_bytes = 0;
            i.link_bytes = 0;
            i.pauses.clear();
            i.delays.clear();
            i.sync_rate.clear();
            i.initial_sync_ms = None;
            i.last_error = None;
        })
    }

    /// The primary's limit of epochs unacknowledged at once.
    pub fn set_epochs_in_flight(&self, n: usize) {
        self.with(|i| i.epochs_in_flight = Some(n));
    }

    /// Epochs sent and not yet acknowledged, now.
    pub fn set_unacknowledged(&self, n: u64) {
        self.with(|i| i.unacked = n);
    }

    /// Sets the state.
    pub fn set_state(&self, state: FtState) {
        self.with(|i| i.state = state)
    }

    /// The current state.
    pub fn state(&self) -> FtState {
        self.with(|i| i.state)
    }

    /// Records why things went wrong.
    pub fn set_error(&self, e: impl Into<String>) {
        let e = e.into();
        self.with(|i| i.last_error = Some(e))
    }

    /// The initial synchronization took `d`.
    pub fn initial_sync_done(&self, d: Duration, link_bytes: u64) {
        self.with(|i| {
            i.initial_sync_ms = Some(d.as_millis() as u64);
            i.link_bytes = link_bytes;
        })
    }

    /// One complete epoch: `pages` pages, `bytes` payload bytes, the guest
    /// paused `pause`, outputs delayed `delay`.
    pub fn record_sync(
        &self,
        epoch: u64,
        pages: u64,
        bytes: u64,
        outputs: u64,
        pause: Duration,
        delay: Duration,
    ) {
        self.with(|i| {
            i.sync_rate.record(Instant::now());
            i.epoch = epoch;
            i.syncs += 1;
            i.pages += pages;
            i.outputs += outputs;
            i.sync_bytes += bytes;
            i.link_bytes += bytes;
            push(&mut i.pauses, pause);
            push(&mut i.delays, delay);
        });
        self.pause_seconds.observe(pause.as_secs_f64());
        self.sync_seconds.observe(delay.as_secs_f64());
    }

    /// Primary: `kept` pages left writable after a sync, `skipped` of them
    /// not sent because unchanged.
    pub fn record_kept(&self, kept: u64, skipped: u64) {
        self.with(|i| {
            i.kept = kept;
            i.skipped += skipped;
        })
    }

    /// Link bytes outside epochs (heartbeats, pre-copy).
    pub fn add_link_bytes(&self, bytes: u64) {
        self.with(|i| i.link_bytes += bytes)
    }

    /// A failover completed in `d`.
    pub fn failed_over(&self, d: Duration) {
        self.with(|i| {
            i.failovers += 1;
            i.failover_ms = Some(d.as_millis() as u64);
            i.state = FtState::FailedOver;
            i.role = "none";
        })
    }

    /// The figures.
    pub fn report(&self) -> FtReport {
        let initial = self.initial.snapshot();
        self.with(|i| {
            let per = |x: u64| {
                if i.syncs == 0 {
                    0.0
                } else {
                    x as f64 / i.syncs as f64
                }
            };
            FtReport {
                role: i.role,
                state: i.state,
                mode: i.mode.clone(),
                period_ms: i.period_ms,
                peer: i.peer.clone(),
                epoch: i.epoch,
                syncs: i.syncs,
                syncs_per_s: i.sync_rate.per_second(Instant::now()),
                outputs: i.outputs,
                pages: i.pages,
                pages_per_sync: per(i.pages),
                kept_writable_pages: i.kept,
                epochs_in_flight: i.epochs_in_flight,
                epochs_unacknowledged: i.unacked,
                unchanged_pages_skipped: i.skipped,
                bytes_per_sync: per(i.sync_bytes),
                link_bytes: i.link_bytes,
                pause_us_p50: percentile(&i.pauses, 0.5),
                pause_us_p99: percentile(&i.pauses, 0.99),
                sync_us_p50: percentile(&i.delays, 0.5),
                sync_us_p99: percentile(&i.delays, 0.99),
                initial_sync_ms: i.initial_sync_ms,
                initial_progress: (i.state == FtState::Syncing).then_some(InitialProgress {
                    round: initial.round,
                    pages_sent: initial.round_pages_sent,
                    pages_total: initial.round_pages_total,
                    bytes_sent: initial.bytes_sent,
                }),
                failovers: i.failovers,
                failover_ms: i.failover_ms,
                last_error: i.last_error.clone(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_means() {
        let s = FtShared::default();
        s.begin("primary", FtState::Syncing, "h:1", "event", None);
        s.initial.start("h:1");
        s.initial.round(1, 100);
        s.initial.sent(10, 4096, 10);
        let p = s.report().initial_progress.expect("progress while syncing");
        assert_eq!(
            (p.round, p.pages_sent, p.pages_total, p.bytes_sent),
            (1, 10, 100, 4096)
        );
        s.set_state(FtState::Protected);
        assert!(s.report().initial_progress.is_none());
        for k in 1..=100u64 {
            s.record_sync(
                k,
                2,
                100,
                1,
                Duration::from_micros(k),
                Duration::from_micros(10 * k),
            );
        }
        let r = s.report();
        assert_eq!((r.epoch, r.syncs, r.pages, r.outputs), (100, 100, 200, 100));
        assert_eq!(r.pause_us_p50, 51);
        assert_eq!(r.pause_us_p99, 99);
        assert_eq!(r.sync_us_p99, 990);
        assert!((r.bytes_per_sync - 100.0).abs() < 1e-9);
        assert_eq!(r.state, FtState::Protected);
    }
}
