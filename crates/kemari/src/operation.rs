//! Long operations (migrate, migrate-local, warm-restart, snapshot, ft
//! start): at most one at a time, each with an id, a kind, a phase, live
//! progress, a cancel switch and, once it ends, its result or error — what
//! `GET /vm/operation` shows while a worker thread runs it and the API
//! stays free. A follower (`?follow`) gets the operation's view as one JSON
//! line at every change, the last one when it ended.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use transfer::{Cancel, CancelOutcome, ProgressCell};

use crate::metrics::OperationMetrics;

/// What a long operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Live migration over TCP.
    Migrate,
    /// Zero-copy migration on this host.
    MigrateLocal,
    /// Warm restart.
    WarmRestart,
    /// Full snapshot.
    Snapshot,
    /// Fault-tolerance initial synchronization.
    FtStart,
}

impl OpKind {
    /// The operator's name for it.
    pub fn describe(self) -> &'static str {
        match self {
            OpKind::Migrate => "live migration",
            OpKind::MigrateLocal => "zero-copy migration",
            OpKind::WarmRestart => "warm restart",
            OpKind::Snapshot => "snapshot",
            OpKind::FtStart => "fault-tolerance start",
        }
    }

    /// As serialized (a metric's label).
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Migrate => "migrate",
            OpKind::MigrateLocal => "migrate_local",
            OpKind::WarmRestart => "warm_restart",
            OpKind::Snapshot => "snapshot",
            OpKind::FtStart => "ft_start",
        }
    }
}

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpStatus {
    /// A worker runs it.
    Running,
    /// It succeeded.
    Completed,
    /// It failed; the VM runs on here (unless it had passed its commit
    /// point, which the error then says).
    Failed,
    /// It was cancelled; the VM runs on here.
    Cancelled,
}

/// One operation, running or the last one.
struct Record {
    id: u64,
    kind: OpKind,
    target: String,
    started: Instant,
    ended: Option<Instant>,
    status: OpStatus,
    progress: Arc<ProgressCell>,
    cancel: Arc<Cancel>,
    result: Option<Value>,
    error: Option<String>,
}

impl Record {
    fn view(&self) -> Value {
        let progress = self.progress.snapshot();
        let elapsed = self.ended.unwrap_or_else(Instant::now) - self.started;
        json!({
            "id": self.id,
            "kind": self.kind,
            "target": self.target,
            "status": self.status,
            "phase": if self.status == OpStatus::Running { progress.phase.clone() } else { String::new() },
            "elapsed_ms": elapsed.as_millis() as u64,
            "progress": progress,
            "result": self.result,
            "error": self.error,
        })
    }
}

/// Why an operation could not start or be cancelled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// Another one runs.
    #[error("a {running} is running (operation {id}): wait for it, or cancel it with `kemarictl operation cancel`")]
    Busy {
        /// What runs.
        running: &'static str,
        /// Its id.
        id: u64,
    },
    /// Nothing to cancel.
    #[error("no long operation is running")]
    NothingRunning,
    /// Past its commit point.
    #[error("too late to cancel the {0}: it passed its commit point (the other end owns the VM)")]
    TooLate(&'static str),
}

/// The operations of this VMM.
#[derive(Default)]
pub struct Operations {
    inner: Mutex<Inner>,
    changed: Condvar,
    /// How many ended, how, and the hand-overs' downtime (`GET /metrics`).
    pub metrics: OperationMetrics,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    current: Option<Record>,
    /// Bumped at every change (followers wake on it).
    version: u64,
    /// Followers that have not yet sent their last line.
    followers: usize,
}

/// A started operation, for the worker that runs it.
#[derive(Clone)]
pub struct Started {
    /// Its id.
    pub id: u64,
    /// Where it reports progress.
    pub progress: Arc<ProgressCell>,
    /// Its cancel switch.
    pub cancel: Arc<Cancel>,
}

impl Operations {
    /// Starts an operation of `kind` towards `target`, reporting to
    /// `progress`; refused while another runs.
    pub fn begin(
        &self,
        kind: OpKind,
        target: &str,
        progress: Arc<ProgressCell>,
    ) -> Result<Started, OpError> {
        let mut inner = self.lock();
        if let Some(r) = inner
            .current
            .as_ref()
            .filter(|r| r.status == OpStatus::Running)
        {
            return Err(OpError::Busy {
                running: r.kind.describe(),
                id: r.id,
            });
        }
        inner.next_id += 1;
        let id = inner.next_id;
        let cancel = Arc::new(Cancel::new());
        inner.current = Some(Record {
            id,
            kind,
            target: target.to_owned(),
            started: Instant::now(),
            ended: None,
            status: OpStatus::Running,
            progress: progress.clone(),
            cancel: cancel.clone(),
            result: None,
            error: None,
        });
        inner.version += 1;
        self.changed.notify_all();
        tracing::info!(id, kind = kind.describe(), target, "operation started");
        Ok(Started {
            id,
            progress,
            cancel,
        })
    }

    /// Operation `id` ended with `outcome` (its result, or its error and
    /// whether it was a cancel).
    pub fn finish(&self, id: u64, outcome: Result<Value, (String, bool)>) {
        let mut inner = self.lock();
        let Some(r) = inner.current.as_mut().filter(|r| r.id == id) else {
            return;
        };
        r.ended = Some(Instant::now());
        let outcome = match outcome {
            Ok(v) => {
                r.status = OpStatus::Completed;
                r.result = Some(v);
                "completed"
            }
            Err((e, cancelled)) => {
                r.status = if cancelled {
                    OpStatus::Cancelled
                } else {
                    OpStatus::Failed
                };
                r.error = Some(e);
                if cancelled {
                    "cancelled"
                } else {
                    "failed"
                }
            }
        };
        self.metrics
            .ended(r.kind.as_str(), outcome, r.result.as_ref());
        tracing::info!(id, kind = r.kind.describe(), status = ?r.status, "operation ended");
        inner.version += 1;
        self.changed.notify_all();
    }

    /// The running (or last) operation, as the API shows it.
    pub fn view(&self) -> Option<Value> {
        self.lock().current.as_ref().map(Record::view)
    }

    /// The progress of operation `id` while it runs.
    pub fn progress(&self, id: u64) -> Option<transfer::Progress> {
        self.lock()
            .current
            .as_ref()
            .filter(|r| r.id == id && r.status == OpStatus::Running)
            .map(|r| r.progress.snapshot())
    }

    /// The running operation's kind and id, if one runs.
    pub fn running(&self) -> Option<(OpKind, u64)> {
        self.lock()
            .current
            .as_ref()
            .filter(|r| r.status == OpStatus::Running)
            .map(|r| (r.kind, r.id))
    }

    /// Cancels the running operation (of `kind`, if given).
    pub fn cancel(&self, kind: Option<OpKind>) -> Result<u64, OpError> {
        let (id, what, cancel) = {
            let inner = self.lock();
            let r = inner
                .current
                .as_ref()
                .filter(|r| r.status == OpStatus::Running)
                .filter(|r| kind.is_none_or(|k| k == r.kind))
                .ok_or(OpError::NothingRunning)?;
            (r.id, r.kind.describe(), r.cancel.clone())
        };
        match cancel.cancel() {
            CancelOutcome::Cancelling | CancelOutcome::AlreadyCancelled => {
                tracing::info!(id, "operation cancel requested");
                Ok(id)
            }
            CancelOutcome::TooLate => Err(OpError::TooLate(what)),
        }
    }

    /// A stream of the views of operation `id`: one JSON line now, one at
    /// every change (at most every `every`), the last when it ended.
    pub fn follow(self: &Arc<Self>, id: u64, every: Duration) -> Receiver<String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(64);
        let ops = self.clone();
        self.lock().followers += 1;
        let spawned = std::thread::Builder::new()
            .name(format!("follow-{id}"))
            .spawn(move || {
                ops.feed(id, every, &tx);
                ops.lock().followers -= 1;
                ops.changed.notify_all();
            });
        if let Err(e) = spawned {
            self.lock().followers -= 1;
            tracing::warn!(error = %e, "cannot follow the operation");
        }
        rx
    }

    /// Waits (up to `grace`) until every follower has sent its last line.
    pub fn wait_followers(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let mut inner = self.lock();
        while inner.followers > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::debug!(
                    followers = inner.followers,
                    "followers still writing at the end"
                );
                return;
            }
            inner = self
                .changed
                .wait_timeout(inner, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn feed(&self, id: u64, every: Duration, tx: &SyncSender<String>) {
        let mut last = String::new();
        let mut seen = 0u64;
        loop {
            let (line, done, version) = {
                let inner = self.lock();
                let Some(r) = inner.current.as_ref().filter(|r| r.id == id) else {
                    return;
                };
                (
                    r.view().to_string(),
                    r.status != OpStatus::Running,
                    inner.version,
                )
            };
            if line != last {
                match tx.try_send(line.clone()) {
                    Ok(()) | Err(TrySendError::Full(_)) => {}
                    Err(TrySendError::Disconnected(_)) => return,
                }
                last = line;
            }
            if done {
                return;
            }
            let inner = self.lock();
            if inner.version == version && seen == version {
                let _ = self.changed.wait_timeout(inner, every);
            }
            seen = version;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_at_a_time_with_a_view_a_cancel_and_an_end() {
        let ops = Arc::new(Operations::default());
        assert!(ops.view().is_none());
        assert_eq!(ops.cancel(None), Err(OpError::NothingRunning));
        let p = Arc::new(ProgressCell::default());
        let a = ops.begin(OpKind::Migrate, "h:1", p.clone()).unwrap();
        p.start("h:1");
        p.round(1, 10);
        let busy = ops
            .begin(OpKind::Snapshot, "/s", Arc::default())
            .err()
            .unwrap();
        assert!(
            busy.to_string()
                .contains("live migration is running (operation 1)"),
            "{busy}"
        );
        let v = ops.view().unwrap();
        assert_eq!(
            (v["status"].as_str(), v["phase"].as_str()),
            (Some("running"), Some("round 1"))
        );
        assert_eq!(
            ops.cancel(Some(OpKind::Snapshot)),
            Err(OpError::NothingRunning)
        );
        assert_eq!(ops.cancel(Some(OpKind::Migrate)), Ok(1));
        assert!(a.cancel.is_cancelled());
        ops.finish(a.id, Err(("cancelled while round 1".into(), true)));
        let v = ops.view().unwrap();
        assert_eq!(v["status"], "cancelled");
        let b = ops.begin(OpKind::Snapshot, "/s", Arc::default()).unwrap();
        assert_eq!(b.id, 2);
        b.cancel.commit("x").unwrap();
        assert_eq!(ops.cancel(None), Err(OpError::TooLate("snapshot")));
    }

    #[test]
    fn a_follower_sees_each_change_and_the_end() {
        let ops = Arc::new(Operations::default());
        let p = Arc::new(ProgressCell::default());
        let s = ops.begin(OpKind::Migrate, "h:1", p.clone()).unwrap();
        let rx = ops.follow(s.id, Duration::from_millis(20));
        let first: Value = serde_json::from_str(&rx.recv().unwrap()).unwrap();
        assert_eq!(first["status"], "running");
        p.phase("round 2");
        ops.finish(s.id, Ok(json!({ "downtime_ms": 1.0 })));
        let lines: Vec<Value> = rx
            .iter()
            .map(|l| serde_json::from_str(&l).unwrap())
            .collect();
        let last = lines.last().unwrap();
        assert_eq!(last["status"], "completed");
        assert_eq!(last["result"]["downtime_ms"], 1.0);
        ops.wait_followers(Duration::from_secs(5));
        assert_eq!(ops.lock().followers, 0);
    }
}
