//! Zero-copy local migration (VMBeam): move a running VM into another kemari
//! process on the same host by handing over its guest memory *file descriptor*
//! instead of copying memory. No dirty tracking, no retransmission: the guest
//! runs until the one short pause in which its small state moves.
//!
//! ```text
//! source VMM                                        destination (kemari --incoming-local SOCK)
//!   connect ──────────────────────────────────────▶ accept (one source)
//!   Offer{config, memory size} + fds [memory, TAPs] ▶ map the same memory (no copy), check
//!   ◀────────────────────────────────────────────── Ready
//!   pause vCPUs + devices, save state
//!   State{VmState container} ─────────────────────▶ restore (paused): VM, vCPUs, devices
//!   ◀────────────────────────────────────────────── Restored
//!   Commit ───────────────────────────────────────▶ resume the guest
//!   ◀────────────────────────────────────────────── Running
//!   (exit 0)                                          ◀ continues as the VM's VMM
//! ```
//!
//! The source waits for `Running` before it exits: its exit (closing fds,
//! starting the reaper) takes CPU time the destination's vCPU needs to start
//! on this two-core host (measured: 0.4 ms more guest downtime without the
//! wait). If `Running` does not come, the source still does not resume (see
//! below); its report says the destination did not confirm.
//!
//! Failure rule: until the source sends `Commit` it owns the VM: any error, a
//! `Failed{reason}` from the destination, or a closed connection makes it
//! resume the guest and report why; the destination then discards what it
//! built. After `Commit` the source never resumes, even if the destination
//! vanishes — losing the VM is preferable to two copies running on one memory.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libc::iovec;
use serde::{Deserialize, Serialize};
use vmm::config::MachineConfig;
use vmm::machine::{Machine, MachineError, PreparedVm, RunState};
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::output::PassThroughGate;
use vmm::persist::format;
use vmm::vstate::VmEventSink;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Protocol version (2: the state travels as raw bytes after its message;
/// 3: the destination confirms `Running`).
pub const VERSION: u32 = 3;
/// Largest message accepted (a VmState container is well under this).
const MAX_MESSAGE: usize = 64 << 20;
/// Most fds one offer may carry (memory + TAPs).
const MAX_FDS: usize = 32;
/// How long either side waits for the other at each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors of a local migration.
#[derive(Debug, thiserror::Error)]
pub enum LocalMigrationError {
    /// Socket I/O.
    #[error("migration socket: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something out of order or malformed.
    #[error("migration protocol: {0}")]
    Protocol(String),
    /// The peer reported a failure.
    #[error("the destination refused the VM: {0}")]
    Refused(String),
    /// The machine failed.
    #[error(transparent)]
    Machine(#[from] MachineError),
}

/// Protocol messages (JSON, length-prefixed).
#[derive(Debug, Serialize, Deserialize)]
enum Message {
    Offer {
        version: u32,
        config: MachineConfig,
        memory_size: u64,
        taps: usize,
    },
    Ready,
    /// Followed on the stream by `bytes` raw bytes: the VmState container
    /// (format.rs), checksummed.
    State {
        bytes: u64,
    },
    Restored {
        restore_ms: u64,
    },
    Commit,
    /// The destination has resumed the guest.
    Running,
    Failed {
        reason: String,
    },
}

/// Sends one length-prefixed JSON message, with `fds` (SCM_RIGHTS) on its
/// header (also used by the warm-restart handover, `warm.rs`).
pub(crate) fn send<M: Serialize>(
    stream: &UnixStream,
    msg: &M,
    fds: &[RawFd],
) -> Result<(), LocalMigrationError> {
    send_with(stream, msg, fds, &[])
}

/// [`send`], then `trailer` (raw bytes the message announces), in one
/// system call where the socket takes it all: each write wakes the peer,
/// and inside the guest's pause on a two-core host every wake-up may cost
/// the writer its CPU.
pub(crate) fn send_with<M: Serialize>(
    stream: &UnixStream,
    msg: &M,
    fds: &[RawFd],
    trailer: &[u8],
) -> Result<(), LocalMigrationError> {
    let payload =
        serde_json::to_vec(msg).map_err(|e| LocalMigrationError::Protocol(e.to_string()))?;
    let mut frame = Vec::with_capacity(4 + payload.len() + trailer.len());
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&payload);
    frame.extend_from_slice(trailer);
    let sent = if fds.is_empty() {
        0
    } else {
        // The fds ride on the first bytes; a stream socket may take fewer
        // than all, the rest follows below.
        let n = stream
            .send_with_fds(&[&frame[..]], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        if n == 0 {
            return Err(LocalMigrationError::Protocol(
                "the socket took no byte of a message carrying fds".into(),
            ));
        }
        n
    };
    (&*stream).write_all(&frame[sent..])?;
    Ok(())
}

/// Receives one message sent by [`send`] and the fds it carried.
pub(crate) fn recv<M: serde::de::DeserializeOwned>(
    stream: &UnixStream,
) -> Result<(M, Vec<File>), LocalMigrationError> {
    let mut len = [0u8; 4];
    let mut fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [iovec {
        iov_base: len.as_mut_ptr().cast(),
        iov_len: len.len(),
    }];
    // SAFETY: the iovec points at `len`, which lives and stays borrowed for the
    // call; recvmsg writes at most 4 bytes there and fd numbers into `fds`.
    let (n, nfds) = unsafe { stream.recv_with_fds(&mut iov, &mut fds) }
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
    let files: Vec<File> = fds[..nfds]
        .iter()
        // SAFETY: each fd was just received with SCM_RIGHTS and belongs to us.
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Err(LocalMigrationError::Io(
            std::io::ErrorKind::UnexpectedEof.into(),
        ));
    }
    (&*stream).read_exact(&mut len[n..])?;
    let size = u32::from_le_bytes(len) as usize;
    if size > MAX_MESSAGE {
        return Err(LocalMigrationError::Protocol(format!(
            "message of {size} bytes exceeds the {MAX_MESSAGE}-byte limit"
        )));
    }
    let mut payload = vec![0u8; size];
    (&*stream).read_exact(&mut payload)?;
    let msg = serde_json::from_slice(&payload)
        .map_err(|e| LocalMigrationError::Protocol(format!("malformed message: {e}")))?;
    Ok((msg, files))
}

/// Figures of one migration, as the source saw them.
#[derive(Debug, Clone, Serialize)]
pub struct LocalMigrationReport {
    /// Connect to commit, in milliseconds.
    pub total_ms: f64,
    /// vCPUs paused to destination restored, in milliseconds (the guest's
    /// downtime as the source measures it).
    pub downtime_ms: f64,
    /// Destination's restore time.
    pub restore_ms: u64,
    /// vCPUs paused to the destination's `Running`, in milliseconds; None if
    /// it did not confirm (the VM is its all the same after `Commit`).
    pub running_ms: Option<f64>,
    /// Bytes of VM state sent (guest memory: 0 bytes).
    pub state_bytes: usize,
}

/// Source side: migrates `machine` into the kemari listening on `socket`. On
/// success the caller must end without resuming the machine; on error the
/// machine has been resumed (if it was running) and the error says why.
pub fn migrate_out(
    machine: &mut Machine,
    socket: &Path,
) -> Result<LocalMigrationReport, LocalMigrationError> {
    let was_running = machine.state() == RunState::Running;
    let started = Instant::now();
    let mut paused_at = None;
    let result = migrate_out_inner(machine, socket, &mut paused_at, started);
    if result.is_err() && was_running && machine.state() == RunState::Paused {
        if let Err(e) = machine.resume() {
            tracing::error!(error = %e, "cannot resume the VM after a failed migration");
        } else {
            tracing::warn!("local migration failed: the VM keeps running here");
        }
    }
    result
}

fn migrate_out_inner(
    machine: &mut Machine,
    socket: &Path,
    paused_at: &mut Option<Instant>,
    started: Instant,
) -> Result<LocalMigrationReport, LocalMigrationError> {
    let stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(STEP_TIMEOUT))?;
    // While the destination gets ready: not in the pause.
    machine.prepare_to_save();
    let taps = machine.tap_fds();
    let mut fds = vec![std::os::fd::AsRawFd::as_raw_fd(
        machine.memory_file().file(),
    )];
    fds.extend(&taps);
    send(
        &stream,
        &Message::Offer {
            version: VERSION,
            config: machine.config().clone(),
            memory_size: machine.memory_file().size(),
            taps: taps.len(),
        },
        &fds,
    )?;
    match recv(&stream)?.0 {
        Message::Ready => {}
        Message::Failed { reason } => return Err(LocalMigrationError::Refused(reason)),
        other => return Err(unexpected("Ready", &other)),
    }
    // The first encode of a process is cold (see format::warm_up): not in
    // the pause.
    format::warm_up();
    *paused_at = Some(Instant::now());
    let state = machine.pause_and_save()?;
    let t_saved = paused_at.map(|p| p.elapsed()).unwrap_or_default();
    let bytes = format::encode(&state).map_err(|e| LocalMigrationError::Protocol(e.to_string()))?;
    let state_bytes = bytes.len();
    send_with(
        &stream,
        &Message::State {
            bytes: state_bytes as u64,
        },
        &[],
        &bytes,
    )?;
    let t_sent = paused_at.map(|p| p.elapsed()).unwrap_or_default();
    let restore_ms = match recv(&stream)?.0 {
        Message::Restored { restore_ms } => restore_ms,
        Message::Failed { reason } => return Err(LocalMigrationError::Refused(reason)),
        other => return Err(unexpected("Restored", &other)),
    };
    let t_restored = paused_at.map(|p| p.elapsed()).unwrap_or_default();
    // Point of no return: from here on the destination owns the VM.
    send(&stream, &Message::Commit, &[])?;
    let downtime = paused_at.map(|p| p.elapsed()).unwrap_or_default();
    // Leave the CPU to the destination until its guest runs (no error from
    // here on can undo the migration).
    let _ = stream.set_read_timeout(Some(super::RUNNING_TIMEOUT));
    let running = paused_at.and_then(|p| {
        super::running_after_commit(
            recv(&stream).map(|(m, _)| m),
            |m| matches!(m, Message::Running),
            p,
        )
    });
    let us = |d: Duration| d.as_micros() as u64;
    tracing::debug!(
        saved_us = us(t_saved),
        sent_us = us(t_sent),
        restored_us = us(t_restored),
        committed_us = us(downtime),
        running_us = running.map(us),
        restore_ms,
        state_bytes,
        "local migration: pause timeline (from the pause)"
    );
    Ok(LocalMigrationReport {
        total_ms: started.elapsed().as_secs_f64() * 1000.0,
        downtime_ms: downtime.as_secs_f64() * 1000.0,
        restore_ms,
        running_ms: running.map(|d| d.as_secs_f64() * 1000.0),
        state_bytes,
    })
}

fn unexpected(want: &str, got: &Message) -> LocalMigrationError {
    let name = match got {
        Message::Offer { .. } => "Offer",
        Message::Ready => "Ready",
        Message::State { .. } => "State",
        Message::Restored { .. } => "Restored",
        Message::Commit => "Commit",
        Message::Running => "Running",
        Message::Failed { .. } => "Failed",
    };
    LocalMigrationError::Protocol(format!("expected {want}, got {name}"))
}

/// A KVM VM built around a named memory file before any source connects
/// (`kemari --incoming-local SOCK --memory-file PATH`), as QEMU's `-incoming
/// defer` destination maps its `memory-backend-file` at start-up: the Offer
/// then only has to show that it hands over that same file.
struct BuiltAhead {
    path: PathBuf,
    /// (st_dev, st_ino) of the file, to recognise the offered fd.
    identity: (u64, u64),
    vm: PreparedVm,
}

impl BuiltAhead {
    fn new(path: &Path) -> Result<Self, LocalMigrationError> {
        let started = Instant::now();
        // Never create or resize it: the destination only takes over memory
        // a running VM already has.
        let meta = std::fs::metadata(path).map_err(|e| {
            LocalMigrationError::Protocol(format!("memory file {}: {e}", path.display()))
        })?;
        let memory = GuestMemoryFile::create(
            meta.len(),
            &MemoryBacking::File {
                path: path.to_path_buf(),
            },
        )
        .map_err(|e| {
            LocalMigrationError::Protocol(format!("memory file {}: {e}", path.display()))
        })?;
        let vm = Machine::prepare(memory)?;
        tracing::info!(
            memory_file = %path.display(),
            size = meta.len(),
            prepared_us = started.elapsed().as_micros() as u64,
            "local migration: VM built ahead around the memory file"
        );
        Ok(BuiltAhead {
            path: path.to_path_buf(),
            identity: (meta.dev(), meta.ino()),
            vm,
        })
    }

    /// The prepared VM, if `offered` (size `size`) is this very file.
    fn take_for(self, offered: &File, size: u64) -> Result<PreparedVm, LocalMigrationError> {
        let meta = offered.metadata()?;
        if (meta.dev(), meta.ino()) != self.identity {
            return Err(LocalMigrationError::Protocol(format!(
                "the source's guest memory is not {} (this destination's --memory-file): \
                 give the destination the source's memory file, or no --memory-file",
                self.path.display()
            )));
        }
        if size != self.vm.memory_file().size() {
            return Err(LocalMigrationError::Protocol(format!(
                "the source offers {size} bytes of memory, {} has {}",
                self.path.display(),
                self.vm.memory_file().size()
            )));
        }
        Ok(self.vm)
    }
}

/// Destination side: waits on `socket` for one source, takes its VM over and
/// returns it running. With `memory_file` (the source VM's named memory
/// file), the KVM VM and its memory slots are built before the source
/// connects, so that nothing of KVM's O(memory) set-up is left for the
/// migration itself. `adjust` may change the received configuration (serial
/// output of this process). On failure nothing of the VM runs here.
pub fn migrate_in(
    socket: &Path,
    memory_file: Option<&Path>,
    events: VmEventSink,
    adjust: impl FnOnce(&mut MachineConfig),
) -> Result<Machine, LocalMigrationError> {
    let ahead = memory_file.map(BuiltAhead::new).transpose()?;
    let listener = vmm::unix_socket::bind_listening(socket)?;
    tracing::info!(socket = %socket.display(), "waiting for a local migration");
    let (stream, _) = listener.accept()?;
    drop(listener);
    let _ = std::fs::remove_file(socket);
    stream.set_read_timeout(Some(STEP_TIMEOUT))?;
    match accept_vm(&stream, ahead, events, adjust) {
        Ok(machine) => Ok(machine),
        Err(e) => {
            let _ = send(
                &stream,
                &Message::Failed {
                    reason: e.to_string(),
                },
                &[],
            );
            Err(e)
        }
    }
}

fn accept_vm(
    stream: &UnixStream,
    ahead: Option<BuiltAhead>,
    events: VmEventSink,
    adjust: impl FnOnce(&mut MachineConfig),
) -> Result<Machine, LocalMigrationError> {
    let (offer, mut files) = recv(stream)?;
    let Message::Offer {
        version,
        memory_size,
        taps,
        config: offered,
    } = offer
    else {
        return Err(unexpected("Offer", &offer));
    };
    if version != VERSION {
        return Err(LocalMigrationError::Protocol(format!(
            "source speaks version {version}, this kemari {VERSION}"
        )));
    }
    if files.len() != 1 + taps {
        return Err(LocalMigrationError::Protocol(format!(
            "offer carries {} fds, expected {}",
            files.len(),
            1 + taps
        )));
    }
    let memory_fd = files.remove(0);
    let tap_files = files;
    let mut prepared = match ahead {
        Some(ahead) => ahead.take_for(&memory_fd, memory_size)?,
        None => {
            // Build the VM around the same memory while the guest still runs
            // on the source: KVM's memory-slot set-up grows with memory size
            // and must not count in the pause. The backing kind is corrected
            // from the state below.
            let memory = GuestMemoryFile::from_file(memory_fd, memory_size, MemoryBacking::Memfd)
                .map_err(|e| LocalMigrationError::Protocol(e.to_string()))?;
            Machine::prepare(memory)?
        }
    };
    // KVM_CREATE_VCPU is slow here too: before the pause, not in it.
    prepared.create_vcpus(offered.vcpus)?;
    send(stream, &Message::Ready, &[])?;

    let (msg, _) = recv(stream)?;
    let Message::State { bytes } = msg else {
        return Err(unexpected("State", &msg));
    };
    if bytes > MAX_MESSAGE as u64 {
        return Err(LocalMigrationError::Protocol(format!(
            "a state of {bytes} bytes exceeds the {MAX_MESSAGE}-byte limit"
        )));
    }
    let mut state = vec![0u8; bytes as usize];
    (&*stream).read_exact(&mut state)?;
    // Fault injection for tests: hold here (the source is paused, waiting) so a
    // test can kill this process mid-migration.
    if let Some(ms) = std::env::var("KEMARI_FAULT_HOLD_MIGRATE_IN_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let started = Instant::now();
    let mut state =
        format::decode(&state).map_err(|e| LocalMigrationError::Protocol(e.to_string()))?;
    adjust(&mut state.config);
    let mut machine = Machine::restore_prepared(
        &state,
        prepared,
        events,
        true,
        std::sync::Arc::new(PassThroughGate),
        tap_files,
    )?;
    send(
        stream,
        &Message::Restored {
            restore_ms: started.elapsed().as_millis() as u64,
        },
        &[],
    )?;
    let t_restored = started.elapsed();
    match recv(stream)?.0 {
        Message::Commit => {}
        other => return Err(unexpected("Commit", &other)),
    }
    let t_committed = started.elapsed();
    machine.resume()?;
    // The source exits on this; the VM is ours whether it hears it or not.
    if let Err(e) = send(stream, &Message::Running, &[]) {
        tracing::warn!(error = %e, "local migration: cannot tell the source the VM runs");
    }
    super::log_destination_timeline("local", started, t_restored, t_committed);
    tracing::info!("local migration: VM taken over and running");
    Ok(machine)
}
