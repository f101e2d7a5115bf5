//! `operation_progress` events: while a long operation runs, its progress
//! (phase, round, bytes and pages sent) goes to the event stream at each
//! new phase or round and at most once a [`PERIOD`] otherwise, between
//! its `operation_started` and its `operation_completed` (`_failed`,
//! `_cancelled`).
//!
//! A thread per operation looks at the progress every [`LOOK_EVERY`]. It
//! publishes only while [`ProgressGate`] is open for its operation; the
//! controller closes the gate before it publishes the operation's end, so
//! no progress event ever follows the end.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use transfer::Progress;

use super::shared::Shared;
use crate::operation::OpKind;

/// Longest time between two progress events of a running operation.
pub const PERIOD: Duration = Duration::from_secs(1);

/// How often the progress is looked at (a new phase or round is
/// published within this).
pub const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Which operation may publish progress now (none once it ended).
#[derive(Debug, Default)]
pub struct ProgressGate(Mutex<Option<u64>>);

impl ProgressGate {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Operation `id` started: its progress may be published.
    pub fn open(&self, id: u64) {
        *self.lock() = Some(id);
    }

    /// The operation ended: nothing more of its progress is published
    /// (an event being published finishes first).
    pub fn close(&self) {
        *self.lock() = None;
    }
}

/// Publishes the progress of operation `id` until the gate closes.
pub fn watch(shared: &Arc<Shared>, id: u64, kind: OpKind) {
    let shared = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("progress-{id}"))
        .spawn(move || run(&shared, id, kind));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no progress events for this operation");
    }
}

fn run(shared: &Shared, id: u64, kind: OpKind) {
    let mut last: Option<(Instant, String, u32)> = None;
    loop {
        std::thread::sleep(LOOK_EVERY);
        let gate = shared.progress_gate.lock();
        if *gate != Some(id) {
            return;
        }
        let Some(p) = shared.operations.progress(id) else {
            return;
        };
        if p.phase.is_empty() {
            continue;
        }
        let due = match &last {
            None => true,
            Some((at, phase, round)) => {
                *phase != p.phase || *round != p.round || at.elapsed() >= PERIOD
            }
        };
        if due {
            shared
                .events
                .publish("operation_progress", details(id, kind, &p));
            last = Some((Instant::now(), p.phase.clone(), p.round));
        }
        drop(gate);
    }
}

/// The event's fields.
fn details(id: u64, kind: OpKind, p: &Progress) -> serde_json::Value {
    json!({
        "operation": id,
        "kind": kind,
        "phase": p.phase,
        "round": p.round,
        "round_pages_sent": p.round_pages_sent,
        "round_pages_total": p.round_pages_total,
        "bytes_sent": p.bytes_sent,
        "pages_sent": p.pages_sent,
        "remaining_pages": p.remaining_pages,
        "rate_mb_s": p.rate_mb_s,
        "elapsed_ms": p.elapsed_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_gate_admits_no_operation() {
        let g = ProgressGate::default();
        assert_eq!(*g.lock(), None);
        g.open(3);
        assert_eq!(*g.lock(), Some(3));
        g.close();
        assert_eq!(*g.lock(), None);
    }

    #[test]
    fn details_carry_the_operation_and_its_counters() {
        let p = Progress {
            phase: "round 2".into(),
            round: 2,
            bytes_sent: 4096,
            ..Progress::default()
        };
        let d = details(7, OpKind::Migrate, &p);
        assert_eq!(d["operation"], 7);
        assert_eq!(d["kind"], "migrate");
        assert_eq!(d["round"], 2);
        assert_eq!(d["bytes_sent"], 4096);
    }
}
