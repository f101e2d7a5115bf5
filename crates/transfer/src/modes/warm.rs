//! Warm restart: the VM's state is saved into a directory while its memory
//! stays in its named file, this kemari ends, and the next one (possibly a
//! newer binary) resumes the VM without copying memory. With a *prepared
//! successor* — started with `--restore DIR --await-state` while the old
//! kemari still runs, after `warm-restart DIR --prepare` wrote
//! `DIR/config.json` — the successor has the KVM VM and its memory slots
//! built in advance and takes the VM at once:
//!
//! ```text
//! old kemari                                      successor (kemari --restore DIR --await-state)
//!   warm-restart DIR --prepare: DIR/config.json     read it, map the memory file, build the VM,
//!                                                   listen on DIR/successor.sock
//!   warm-restart DIR: connect ──────────────────▶ accept
//!   Offer{warm, config, memory size} ───────────▶ same VM as prepared?
//!   ◀──────────────────────────────────────────── Ready (or Failed{reason}: the VM runs on)
//!   pause, DIR/state.bin, close the disks
//!   StateSaved + TAP fds ───────────────────────▶ read DIR/state.bin, restore, run
//!   ◀──────────────────────────────────────────── Running{restore_ms} (or Failed{reason})
//! ```
//!
//! The successor runs the guest only after `StateSaved`, sent once the old
//! process paused for good and wrote the state, so the guest never runs in
//! both. The state file stays in DIR whatever happens: if the successor
//! dies or refuses it, `kemari --restore DIR` resumes the VM. If the old
//! process hangs up before `StateSaved` (its save failed and the guest runs
//! on), the successor waits for the next attempt.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmm::config::MachineConfig;
use vmm::machine::{Machine, RunState};
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::persist::snapshot;
use vmm::vstate::VmEventSink;

use crate::cancel::Cancel;
use crate::channel::{Auth, Channel};
use crate::destination::{self, RunAs, Target};
use crate::error::{Peer, TransferError};
use crate::message::Mode;
use crate::progress::ProgressCell;
use crate::source::{self, Delivery};

/// Version of `DIR/config.json`.
pub const CONFIG_VERSION: u32 = 1;
/// The configuration a successor prepares from, in the state directory.
pub const CONFIG_FILE: &str = "config.json";
/// The successor's socket, in the state directory.
pub const SOCKET_FILE: &str = "successor.sock";
/// How long the old process waits for the successor at each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// `DIR/config.json`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PreparedConfig {
    version: u32,
    /// The old process, for the operator.
    pid: u32,
    config: MachineConfig,
}

fn memory_path(config: &MachineConfig) -> Result<&Path, TransferError> {
    match &config.memory_backing {
        MemoryBacking::File { path } => Ok(path),
        other => Err(TransferError::Mismatch(format!(
            "warm restart needs guest memory in a named file (start kemari with --memory-file /dev/shm/NAME); this VM uses {other:?}"
        ))),
    }
}

// ---------------------------------------------------------------------------
// The old process.

/// Writes `DIR/config.json` for a successor, without pausing the VM. A state
/// file left in DIR by an earlier restart is removed: it is older than the
/// running VM and must not be restored over its memory.
pub fn write_config(dir: &Path, config: &MachineConfig) -> Result<PathBuf, TransferError> {
    memory_path(config)?;
    std::fs::create_dir_all(dir).map_err(TransferError::file(dir.display()))?;
    let stale = dir.join(snapshot::STATE_FILE);
    match std::fs::remove_file(&stale) {
        Ok(()) => tracing::info!(path = %stale.display(), "removed an older state file"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(TransferError::file(stale.display())(e)),
    }
    let path = dir.join(CONFIG_FILE);
    let bytes = serde_json::to_vec_pretty(&PreparedConfig {
        version: CONFIG_VERSION,
        pid: std::process::id(),
        config: config.clone(),
    })
    .map_err(|e| TransferError::Memory(format!("encoding {}: {e}", path.display())))?;
    vmm::persist::write_private(&path, &bytes, false)
        .map_err(TransferError::file(path.display()))?;
    Ok(path)
}

/// Figures of a warm restart.
#[derive(Debug, Clone, Serialize)]
pub struct WarmReport {
    /// The state directory.
    pub dir: PathBuf,
    /// Bytes of the state file.
    pub state_bytes: u64,
    /// Pause to the state saved (no successor) or handed over, ms.
    pub paused_ms: f64,
    /// The successor, if one took the VM.
    pub successor: Option<SuccessorReport>,
}

/// What a successor did.
#[derive(Debug, Clone, Serialize)]
pub struct SuccessorReport {
    /// It runs the VM.
    pub running: bool,
    /// Its restore time, ms.
    pub restore_ms: f64,
    /// Pause to its `Running`, ms: the guest's downtime.
    pub downtime_ms: f64,
}

/// Saves the VM into `dir` and lets go of it: to the successor waiting on
/// `dir` if one does (it runs the VM at once), or for a later `kemari
/// --restore DIR`. Before the commit point (see [`Cancel::is_committed`])
/// an error leaves the VM running here; after it, the VM is never resumed
/// here (the state in `dir` resumes it).
pub fn restart_out(
    machine: &mut Machine,
    dir: &Path,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<WarmReport, TransferError> {
    memory_path(machine.config())?;
    let was_running = machine.state() == RunState::Running;
    progress.start(&dir.display().to_string());
    let result = match connect_successor(dir)? {
        // The offer reads the vCPUs' constants while the successor gets
        // ready.
        Some(ch) => with_successor(ch, machine, dir, cancel, progress),
        None => {
            // Not in the pause.
            machine.prepare_to_save();
            without_successor(machine, dir, cancel, progress)
        }
    };
    let result = cancel.explain(result, progress.snapshot().phase.as_str());
    match &result {
        Ok(_) => progress.finish("completed", None),
        Err(e) => {
            if cancel.is_committed() {
                tracing::error!(error = %e, dir = %dir.display(), "warm restart: the state is saved but the successor failed: `kemari --restore DIR` resumes the VM");
            } else if was_running && machine.state() == RunState::Paused {
                if let Err(re) = machine.resume() {
                    tracing::error!(error = %re, "cannot resume the VM after a failed warm restart");
                }
            }
            let status = if e.is_cancelled() {
                "cancelled"
            } else {
                "failed"
            };
            progress.finish(status, Some(e.to_string()));
        }
    }
    result
}

fn without_successor(
    machine: &mut Machine,
    dir: &Path,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<WarmReport, TransferError> {
    vmm::persist::format::warm_up();
    cancel.check("pausing the VM")?;
    progress.phase("paused: saving the state");
    let started = Instant::now();
    let state = machine.pause_and_save()?;
    let stats = snapshot::save_warm(dir, &state, machine.memory_file()).map_err(|e| {
        TransferError::File {
            path: dir.display().to_string(),
            source: std::io::Error::other(e.to_string()),
        }
    })?;
    // From here on the VM never runs in this process again.
    cancel.commit("saving the state")?;
    let paused_ms = started.elapsed().as_secs_f64() * 1000.0;
    drop(machine.release_backends()?);
    tracing::info!(dir = %dir.display(), paused_ms, "warm restart: state saved");
    Ok(WarmReport {
        dir: dir.to_path_buf(),
        state_bytes: stats.state_bytes,
        paused_ms,
        successor: None,
    })
}

fn with_successor(
    mut ch: Channel<UnixStream>,
    machine: &mut Machine,
    dir: &Path,
    cancel: &Cancel,
    progress: &ProgressCell,
) -> Result<WarmReport, TransferError> {
    source::offer(&mut ch, Mode::Warm, machine, &[], progress)?;
    let handed = source::pause_and_hand_over(
        &mut ch,
        machine,
        None,
        Delivery::StateDir(dir),
        cancel,
        progress,
    )?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let downtime = handed.running.unwrap_or(handed.downtime);
    tracing::info!(
        dir = %dir.display(),
        restore_ms = handed.restore_ms,
        downtime_ms = ms(downtime),
        "warm restart: the successor runs the VM"
    );
    Ok(WarmReport {
        dir: dir.to_path_buf(),
        state_bytes: handed.state_bytes as u64,
        paused_ms: ms(handed.downtime),
        successor: Some(SuccessorReport {
            running: handed.running.is_some(),
            restore_ms: handed.restore_ms,
            downtime_ms: ms(downtime),
        }),
    })
}

/// The successor waiting on `dir`, if one does (`None`: none started, or
/// one that has gone: the warm restart goes on without one).
fn connect_successor(dir: &Path) -> Result<Option<Channel<UnixStream>>, TransferError> {
    let path = dir.join(SOCKET_FILE);
    let stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            tracing::warn!(socket = %path.display(), error = %e, "no successor answers: warm restart without one");
            return Ok(None);
        }
    };
    super::local::check_same_user(&stream)?;
    stream
        .set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(TransferError::file(path.display()))?;
    let mut ch = Channel::connect(stream, Auth::Local, Peer::Successor)?;
    ch.note_timeout(Some(STEP_TIMEOUT));
    Ok(Some(ch))
}

// ---------------------------------------------------------------------------
// The successor.

/// A successor with its VM built and memory registered, listening for the
/// old process.
pub struct Successor {
    config: MachineConfig,
    target: Target,
    listener: UnixListener,
    socket: SocketFile,
}

/// The successor's socket path, removed when the successor no longer
/// listens.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Reads `DIR/config.json`, opens and maps the VM's memory file, creates
/// the KVM VM with its memory slots and vCPUs, and listens on
/// `DIR/successor.sock`.
pub fn prepare(dir: &Path) -> Result<Successor, TransferError> {
    let started = Instant::now();
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|e| TransferError::File {
        path: path.display().to_string(),
        source: vmm::persist::explain_missing(
            e,
            "run `kemarictl warm-restart DIR --prepare` on the running kemari first",
        ),
    })?;
    let file: PreparedConfig = serde_json::from_slice(&text)
        .map_err(|e| TransferError::Mismatch(format!("{}: {e}", path.display())))?;
    if file.version != CONFIG_VERSION {
        return Err(TransferError::Mismatch(format!(
            "{}: version {}, this kemari reads {CONFIG_VERSION}",
            path.display(),
            file.version
        )));
    }
    let config = file.config;
    let memory = memory_path(&config)?;
    // Never create it: a successor only takes over memory a VM already has.
    let actual = std::fs::metadata(memory)
        .map_err(|source| {
            TransferError::Mismatch(format!("memory file {}: {source}", memory.display()))
        })?
        .len();
    if actual != config.memory_bytes {
        return Err(TransferError::Mismatch(format!(
            "memory file {} is {actual} bytes, the VM has {}",
            memory.display(),
            config.memory_bytes
        )));
    }
    let memory = GuestMemoryFile::create(config.memory_bytes, &config.memory_backing)
        .map_err(|e| TransferError::Memory(e.to_string()))?;
    let mut vm = Machine::prepare(memory)?;
    vm.create_vcpus(config.vcpus)?;
    // Their threads (and their seccomp filters) too: none is made inside
    // the pause.
    vm.start_threads_ahead()?;
    let socket = dir.join(SOCKET_FILE);
    if UnixStream::connect(&socket).is_ok() {
        return Err(TransferError::Mismatch(format!(
            "another successor already waits on {}",
            dir.display()
        )));
    }
    let listener =
        vmm::unix_socket::bind_listening(&socket).map_err(|source| TransferError::Listen {
            addr: socket.display().to_string(),
            source,
        })?;
    tracing::info!(
        dir = %dir.display(),
        old_pid = file.pid,
        prepared_us = started.elapsed().as_micros() as u64,
        "successor prepared: waiting for the state"
    );
    crate::listening::listening(&socket.display().to_string());
    Ok(Successor {
        target: Target::Prepared {
            vm: Some(Box::new(vm)),
            config: config.clone(),
            dir: dir.to_path_buf(),
        },
        config,
        listener,
        socket: SocketFile(socket),
    })
}

impl Successor {
    /// The configuration it was prepared for.
    pub fn config(&self) -> &MachineConfig {
        &self.config
    }

    /// Waits for the old process to hand the VM over, then restores it into
    /// the prepared VM and runs it (unless `start_paused`). `adjust` may
    /// change the saved configuration (this process's serial console). A
    /// refused or abandoned attempt (another VM offered, the old process
    /// hung up before saving) is logged and the successor waits on; other
    /// errors end it, and nothing of the VM runs here (its state stays in
    /// DIR).
    pub fn await_state(
        mut self,
        events: VmEventSink,
        start_paused: bool,
        adjust: &mut dyn FnMut(&mut MachineConfig),
    ) -> Result<Machine, TransferError> {
        loop {
            let (stream, _) = self
                .listener
                .accept()
                .map_err(|e| TransferError::io(Peer::OldVmm, "accepting", None, e))?;
            if let Err(e) = super::local::check_same_user(&stream) {
                tracing::warn!(error = %e, "a warm restart was refused: waiting on");
                continue;
            }
            let mut ch = match Channel::accept(stream, Auth::Local, Peer::OldVmm) {
                Ok(ch) => ch,
                Err(e) => {
                    tracing::warn!(error = %e, "a warm restart was refused: waiting on");
                    continue;
                }
            };
            match destination::receive(
                &mut ch,
                Mode::Warm.name(),
                &mut self.target,
                RunAs::Run { start_paused },
                events.clone(),
                adjust,
            ) {
                Ok(machine) => {
                    tracing::info!("warm restart: VM taken over from the old kemari");
                    drop(self.socket);
                    return Ok(machine);
                }
                Err(e) if self.still_prepared() => {
                    tracing::warn!(error = %e, "a warm restart did not complete: waiting on")
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn still_prepared(&self) -> bool {
        matches!(&self.target, Target::Prepared { vm: Some(_), .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::destination::test_config as config;

    #[test]
    fn config_needs_named_memory_and_prepare_needs_the_file() {
        let dir = std::env::temp_dir().join(format!("transfer-warm-{}", std::process::id()));
        let mut memfd = config("/x");
        memfd.memory_backing = MemoryBacking::Memfd;
        let e = write_config(&dir, &memfd).unwrap_err();
        assert!(e.to_string().contains("--memory-file"), "{e}");
        // A stale state goes; the memory file does not exist: refused.
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(snapshot::STATE_FILE), b"old").unwrap();
        let missing = dir.join("no-such-memory");
        write_config(&dir, &config(missing.to_str().unwrap())).unwrap();
        assert!(!dir.join(snapshot::STATE_FILE).exists());
        // It names the VM's memory file and disks: its owner's only.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(CONFIG_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let err = prepare(&dir).err().unwrap().to_string();
        assert!(err.contains("no-such-memory"), "{err}");
        // The wrong size: refused, the file left as it is.
        std::fs::write(&missing, vec![0u8; 4096]).unwrap();
        let err = prepare(&dir).err().unwrap().to_string();
        assert!(err.contains("4096 bytes"), "{err}");
        assert_eq!(std::fs::metadata(&missing).unwrap().len(), 4096);
        std::fs::remove_dir_all(&dir).unwrap();
        let err = prepare(&dir).err().unwrap().to_string();
        assert!(err.contains("--prepare"), "{err}");
    }
}
