//! A long operation runs on a worker thread that owns the machine for its
//! duration (Cloud Hypervisor's migration worker idea): the main loop stays
//! free to take events and answer the API, which reads progress from
//! [`Shared`](super::shared::Shared). When the operation ends, the worker
//! hands the machine back to the main loop with what comes next.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use vmm::machine::{Machine, RunState};
use vmm::persist::snapshot;

use ft::gate::FtGate;
use ft::primary::FtStartOptions;
use transfer::modes::{live, local, warm};
use transfer::precopy::DowntimeEstimate;
use transfer::{ProgressCell, TransferError};

use crate::operation::{OpKind, Started};

use super::ending::release_backends;
use super::shared::Shared;

/// A long operation and its parameters (checked before it starts).
pub enum Op {
    /// Live migration to `to`.
    Migrate {
        /// Destination.
        to: String,
        /// Pre-shared key.
        key: Vec<u8>,
        /// An authenticated but unencrypted link.
        plaintext: bool,
        /// TCP connections (1 = the main one only).
        connections: u8,
        /// When to stop pre-copying.
        rule: DowntimeEstimate,
        /// The bandwidth cap of the rounds while the guest runs.
        throttle: Option<transfer::throttle::Throttle>,
    },
    /// Zero-copy migration to the kemari listening on `socket`.
    MigrateLocal {
        /// Its socket.
        socket: PathBuf,
    },
    /// Warm restart into `dir`.
    WarmRestart {
        /// The state directory.
        dir: PathBuf,
    },
    /// Full snapshot into `dir`, and the end of this VMM if `exit`.
    Snapshot {
        /// The snapshot directory.
        dir: PathBuf,
        /// Suspend to disk.
        exit: bool,
        /// Replace a snapshot already in `dir`.
        force: bool,
    },
    /// Fault tolerance with a standby.
    FtStart(Box<FtStartOptions>),
}

impl Op {
    /// Its kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Migrate { .. } => OpKind::Migrate,
            Op::MigrateLocal { .. } => OpKind::MigrateLocal,
            Op::WarmRestart { .. } => OpKind::WarmRestart,
            Op::Snapshot { .. } => OpKind::Snapshot,
            Op::FtStart(_) => OpKind::FtStart,
        }
    }

    /// Where it goes (for the operation's view).
    pub fn target(&self) -> String {
        match self {
            Op::Migrate { to, .. } => to.clone(),
            Op::MigrateLocal { socket } => socket.display().to_string(),
            Op::WarmRestart { dir } | Op::Snapshot { dir, .. } => dir.display().to_string(),
            Op::FtStart(o) => o.peer.clone(),
        }
    }
}

/// What the main loop does once the machine is back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Keep running the VM.
    Continue,
    /// The VM was saved to end: end this VMM.
    Exit,
    /// The VM runs in another process now: report, then end this VMM at
    /// idle priority (see [`finish_at_idle_priority`](super::ending::finish_at_idle_priority)).
    HandedOver,
}

/// An operation's end, handed back to the main loop.
pub struct Done {
    /// The operation.
    pub id: u64,
    /// The machine, back.
    pub machine: Machine,
    /// Its result (the operation's final report), or the error and
    /// whether it was a cancel.
    pub result: Result<Value, (String, bool)>,
    /// What comes next.
    pub after: After,
    /// Fault tolerance's gate, once protected.
    pub gate: Option<Arc<FtGate>>,
}

/// Runs `op` on `machine` in a worker thread; `done` gets the machine back.
/// If no thread can be started, the machine comes back with the error.
pub fn spawn(
    op: Op,
    machine: Machine,
    started: Started,
    shared: Arc<Shared>,
    done: impl FnOnce(Done) + Send + 'static,
) -> Result<(), (std::io::Error, Option<Machine>)> {
    let name = format!("op-{}", started.id);
    let slot = Arc::new(std::sync::Mutex::new(Some(machine)));
    let in_thread = slot.clone();
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let Some(machine) = in_thread.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        done(run(op, machine, &started, &shared));
    });
    if let Err(e) = spawned {
        // Nothing ran: the machine is still in the slot.
        let machine = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        return Err((e, machine));
    }
    Ok(())
}

fn failed(what: &str, e: &dyn std::fmt::Display, cancelled: bool) -> (String, bool) {
    (format!("{what} failed: {e}"), cancelled)
}

fn transfer_failed(what: &str, e: &TransferError) -> (String, bool) {
    if e.is_cancelled() {
        (format!("{what} {e}"), true)
    } else {
        failed(what, e, false)
    }
}

fn run(op: Op, mut machine: Machine, started: &Started, shared: &Shared) -> Done {
    let id = started.id;
    let what = op.kind().describe();
    let (result, after, gate) = match op {
        Op::Migrate {
            to,
            key,
            plaintext,
            connections,
            rule,
            throttle,
        } => {
            match live::migrate_out(
                &mut machine,
                &to,
                transfer::channel::Auth::psk(&key, plaintext),
                rule,
                live::LinkOptions {
                    throttle,
                    connections,
                },
                &started.cancel,
                &started.progress,
            ) {
                Ok(report) => (Ok(json!(report)), After::HandedOver, None),
                Err(e) => (Err(transfer_failed(what, &e)), After::Continue, None),
            }
        }
        Op::MigrateLocal { socket } => {
            match local::migrate_out(&mut machine, &socket, &started.cancel, &started.progress) {
                Ok(report) => {
                    tracing::info!(?report, "zero-copy migration done: exiting");
                    (Ok(json!(report)), After::HandedOver, None)
                }
                Err(e) => (Err(transfer_failed(what, &e)), After::Continue, None),
            }
        }
        Op::WarmRestart { dir } => {
            match warm::restart_out(&mut machine, &dir, &started.cancel, &started.progress) {
                Ok(report) => {
                    let after = if report.successor.is_some() {
                        After::HandedOver
                    } else {
                        After::Exit
                    };
                    (Ok(json!(report)), after, None)
                }
                // The state is saved all the same: nothing is lost.
                Err(e) if started.cancel.is_committed() => (
                    Err((
                        format!(
                            "state saved in {}, but the successor failed ({e}): `kemari --restore {}` resumes the VM",
                            dir.display(),
                            dir.display()
                        ),
                        false,
                    )),
                    After::Exit,
                    None,
                ),
                Err(e) => (Err(transfer_failed(what, &e)), After::Continue, None),
            }
        }
        Op::Snapshot { dir, exit, force } => {
            match snapshot_full(&mut machine, &dir, exit, force, started) {
                Ok(v) if exit => (Ok(v), After::Exit, None),
                Ok(v) => (Ok(v), After::Continue, None),
                Err(e) => (Err(e), After::Continue, None),
            }
        }
        Op::FtStart(opts) => {
            match ft::primary::start(&mut machine, &opts, &shared.ft, &started.cancel) {
                Ok(gate) => (Ok(json!(shared.ft.report())), After::Continue, Some(gate)),
                Err(ft::FtError::Transfer(e)) => {
                    (Err(transfer_failed(what, &e)), After::Continue, None)
                }
                Err(e) => (Err(failed(what, &e, false)), After::Continue, None),
            }
        }
    };
    Done {
        id,
        machine,
        result,
        after,
        gate,
    }
}

/// A snapshot's memory image so far: pages of guest memory gone through
/// (the bar) and their bytes.
fn image_progress(progress: &ProgressCell, done: u64, all: u64) {
    const PAGE: u64 = 4096;
    progress.step(done / PAGE, all / PAGE, done);
}

/// Pauses the machine (if it runs), saves its state and its memory image
/// into `dir`, then resumes it — or, with `exit`, lets go of its backends
/// for the VMM to end (suspend to disk). On failure the machine runs on. A
/// snapshot already in `dir` is refused before the pause unless `force`.
fn snapshot_full(
    machine: &mut Machine,
    dir: &std::path::Path,
    exit: bool,
    force: bool,
    started: &Started,
) -> Result<Value, (String, bool)> {
    let progress: &ProgressCell = &started.progress;
    progress.start(&dir.display().to_string());
    if let Err(e) = snapshot::check_target(dir, force) {
        progress.finish("failed", Some(e.to_string()));
        return Err((format!("snapshot refused: {e}"), false));
    }
    // Once paused, the snapshot completes (or fails): no cancel.
    started
        .cancel
        .commit("pausing the VM")
        .map_err(|e| (format!("snapshot {e}"), true))?;
    let t = Instant::now();
    let was_running = machine.state() == RunState::Running;
    progress.phase("paused: saving the state and the memory image");
    let saved = machine
        .pause_and_save()
        .map_err(|e| e.to_string())
        .and_then(|state| {
            snapshot::save_full(dir, &state, machine.memory_file(), force, &|done, all| {
                image_progress(progress, done, all)
            })
            .map_err(|e| e.to_string())
        });
    let stats = match saved {
        Ok(stats) => stats,
        Err(e) => {
            if was_running && machine.state() == RunState::Paused {
                if let Err(re) = machine.resume() {
                    tracing::error!(error = %re, "cannot resume the VM after a failed snapshot");
                }
            }
            progress.finish("failed", Some(e.clone()));
            return Err((format!("snapshot failed: {e}"), false));
        }
    };
    let paused_ms = t.elapsed().as_millis() as u64;
    tracing::info!(dir = %dir.display(), paused_ms, "snapshot written");
    let body = json!({
        "dir": dir,
        "state_bytes": stats.state_bytes,
        "memory_bytes_written": stats.memory.bytes_written,
        "memory_bytes_scanned": stats.memory.bytes_scanned,
        "memory_extents": stats.memory.extents,
        "paused_ms": paused_ms,
        "exit": exit,
    });
    if exit {
        drop(release_backends(machine));
    } else if was_running {
        if let Err(e) = machine.resume() {
            progress.finish("failed", Some(e.to_string()));
            return Err((
                format!("snapshot written, but the VM cannot resume: {e}"),
                false,
            ));
        }
    }
    progress.finish("completed", None);
    Ok(body)
}
