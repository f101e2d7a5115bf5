//! Zero-copy local migration (VMBeam): move a running VM into another
//! kemari process on the same host by handing over its guest memory *file
//! descriptor* (and its TAPs') with the offer instead of copying memory. No
//! pre-copy: the guest runs until the one short pause in which its small
//! state moves.
//!
//! The destination restores the VM paused and runs it only at `Commit`:
//! the memory is shared, so the source must never be able to resume on it
//! once the destination ran. After `Commit` the source never resumes, even
//! if the destination vanishes — losing the VM is preferable to two copies
//! running on one memory. The source waits for `Running` before it exits:
//! its exit takes CPU time the destination's vCPU needs to start (0.4 ms
//! more guest downtime here without the wait).

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use vmm::config::MachineConfig;
use vmm::machine::{Machine, RunState};
use vmm::vstate::VmEventSink;

use crate::cancel::Cancel;
use crate::channel::{Auth, Channel};
use crate::destination::{self, BuiltAhead, RunAs, Target};
use crate::error::{Peer, TransferError};
use crate::message::Mode;
use crate::progress::ProgressCell;
use crate::source::{self, Delivery};
use crate::sys;

/// How long either side waits for the other at each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Figures of one migration, as the source saw them.
#[derive(Debug, Clone, Serialize)]
pub struct LocalReport {
    /// Connect to commit, ms.
    pub total_ms: f64,
    /// vCPUs paused to the commit, ms (the guest's downtime as the source
    /// measures it).
    pub downtime_ms: f64,
    /// The destination's restore time, ms.
    pub restore_ms: f64,
    /// vCPUs paused to the destination's `Running`, ms; None if it did not
    /// confirm (the VM is its all the same after `Commit`).
    pub running_ms: Option<f64>,
    /// Bytes of VM state sent (guest memory: none).
    pub state_bytes: usize,
}

/// Source side: migrates `machine` into the kemari listening on `socket`.
/// On success the caller must end without resuming the machine; on error
/// the machine runs again (if it ran) and the error says why.
pub fn migrate_out(
    machine: &mut Machine,
    socket: &Path,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<LocalReport, TransferError> {
    let was_running = machine.state() == RunState::Running;
    progress.start(&socket.display().to_string());
    let started = std::time::Instant::now();
    let result = migrate_out_inner(machine, socket, cancel, progress);
    let result = cancel.explain(result, progress.snapshot().phase.as_str());
    match &result {
        Ok(_) => progress.finish("completed", None),
        Err(e) => {
            if was_running && machine.state() == RunState::Paused && !cancel.is_committed() {
                if let Err(re) = machine.resume() {
                    tracing::error!(error = %re, "cannot resume the VM after a failed migration");
                }
            }
            tracing::warn!(error = %e, "zero-copy migration failed: the VM keeps running here");
            let status = if e.is_cancelled() {
                "cancelled"
            } else {
                "failed"
            };
            progress.finish(status, Some(e.to_string()));
        }
    }
    let handed = result?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Ok(LocalReport {
        total_ms: ms(started.elapsed()),
        downtime_ms: ms(handed.downtime),
        restore_ms: handed.restore_ms,
        running_ms: handed.running.map(ms),
        state_bytes: handed.state_bytes,
    })
}

fn migrate_out_inner(
    machine: &mut Machine,
    socket: &Path,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<source::HandedOver, TransferError> {
    let stream = UnixStream::connect(socket).map_err(|source| TransferError::Connect {
        peer: Peer::Destination,
        addr: socket.display().to_string(),
        source,
    })?;
    // The memory goes with the offer: only to a process of this user.
    check_same_user(&stream)?;
    cancel.watch_unix(&stream);
    stream
        .set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(TransferError::file(socket.display()))?;
    let mut ch = Channel::connect(stream, Auth::Local, Peer::Destination)?;
    ch.note_timeout(Some(STEP_TIMEOUT));
    let mut fds = vec![machine.memory_file().file().as_raw_fd()];
    fds.extend(machine.tap_fds());
    source::offer(&mut ch, Mode::Local, machine, &fds, progress)?;
    let handed =
        source::pause_and_hand_over(&mut ch, machine, None, Delivery::Inline, cancel, progress)?;
    // What went over the socket (the state; the memory went as an fd), so
    // that the operation's progress says what its report says.
    progress.sent(0, ch.bytes_sent, 0);
    Ok(handed)
}

/// Destination side: waits on `socket` for one source on this host, takes
/// its VM over and returns it running. With `memory_file` (the source VM's
/// named memory file), the KVM VM and its memory slots are built before
/// the source connects, so that nothing of KVM's O(memory) set-up is left
/// for the migration itself. `adjust` may change the saved configuration
/// (this process's serial output). On failure nothing of the VM runs here.
pub fn migrate_in(
    socket: &Path,
    memory_file: Option<&Path>,
    events: VmEventSink,
    adjust: &mut dyn FnMut(&mut MachineConfig),
) -> Result<Machine, TransferError> {
    let built_ahead = memory_file.map(BuiltAhead::new).transpose()?;
    let listener =
        vmm::unix_socket::bind_listening(socket).map_err(|source| TransferError::Listen {
            addr: socket.display().to_string(),
            source,
        })?;
    tracing::info!(socket = %socket.display(), "waiting for a zero-copy migration");
    crate::listening::listening(&socket.display().to_string());
    let (stream, _) = listener
        .accept()
        .map_err(|e| TransferError::io(Peer::Source, "accepting", None, e))?;
    drop(listener);
    let _ = std::fs::remove_file(socket);
    check_same_user(&stream)?;
    stream
        .set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(TransferError::file(socket.display()))?;
    let mut ch = Channel::accept(stream, Auth::Local, Peer::Source)?;
    ch.note_timeout(Some(STEP_TIMEOUT));
    let machine = destination::receive(
        &mut ch,
        Mode::Local.name(),
        &mut Target::OfferedMemory { built_ahead },
        RunAs::PausedUntilCommit,
        events,
        adjust,
    )?;
    tracing::info!("zero-copy migration: VM taken over and running");
    Ok(machine)
}

/// A local hand-over's only credential: the peer runs as this user (or
/// root).
pub(crate) fn check_same_user(stream: &UnixStream) -> Result<(), TransferError> {
    let uid =
        sys::peer_uid(stream.as_fd()).map_err(TransferError::file("the peer's credentials"))?;
    let me = sys::euid();
    if uid != me && uid != 0 {
        return Err(TransferError::Mismatch(format!(
            "the process at the other end of the socket runs as uid {uid}, this kemari as {me}: refused"
        )));
    }
    Ok(())
}
