//! Warm restart into a *prepared successor*: the VM's next kemari process
//! (possibly a newer binary) starts while the old one still runs the guest,
//! maps the named memory file and builds the KVM VM and its memory slots in
//! advance, then waits for the state. The guest's pause is then only the
//! state save and the restore into the ready VM; the old process's exit (KVM
//! teardown, unmapping) overlaps the guest already running in the successor.
//!
//! ```text
//! old kemari                                      successor (kemari --restore DIR --await-state)
//!   warm-restart DIR --prepare:
//!     write DIR/config.json (no pause)
//!                                                   read DIR/config.json, open + map the memory
//!                                                   file, create the KVM VM + memory slots,
//!                                                   listen on DIR/successor.sock
//!   warm-restart DIR:
//!     connect DIR/successor.sock ─────────────────▶ accept
//!     Hello{config, memory size} ─────────────────▶ same VM as prepared?
//!     ◀─────────────────────────────────────────── Ready (or Failed{reason}: 409, the VM runs on)
//!     pause, write DIR/state.bin, close the disks
//!     StateSaved + TAP fds ───────────────────────▶ read DIR/state.bin, restore, resume
//!     ◀─────────────────────────────────────────── Running{restore_ms} (or Failed{reason})
//!     answer the API, exit
//! ```
//!
//! Rules: the successor runs the guest only after `StateSaved`, which the old
//! process sends once it has paused for good and written the state, so the
//! guest never runs in both. The state file stays in DIR whatever happens:
//! if the successor dies or refuses the state, `kemari --restore DIR` resumes
//! the VM as after a plain warm restart. Without a successor listening, a warm
//! restart works as before (the next kemari is started after it). If the old
//! process drops the connection before `StateSaved` (its save failed and the
//! guest runs on), the successor waits for the next attempt.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmm::config::MachineConfig;
use vmm::machine::{Machine, MachineError, PreparedVm};
use vmm::memory::{GuestMemoryFile, MemoryBacking, MemoryError};
use vmm::output::PassThroughGate;
use vmm::persist::snapshot::{self, SnapshotError};
use vmm::vstate::VmEventSink;

use super::local::{recv, send, LocalMigrationError};

/// Protocol and config-file version.
pub const VERSION: u32 = 1;
/// The configuration a successor prepares from, in the state directory.
pub const CONFIG_FILE: &str = "config.json";
/// The successor's socket, in the state directory.
pub const SOCKET_FILE: &str = "successor.sock";
/// How long the old process waits for the successor at each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors of a warm restart with a successor, on either side.
#[derive(Debug, thiserror::Error)]
pub enum WarmError {
    /// A file of the state directory.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is not one this kemari understands.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A successor needs guest memory in a named file.
    #[error("a warm-restart successor needs guest memory in a named file (start kemari with --memory-file /dev/shm/NAME); this VM uses {0}")]
    NotNamedMemory(String),
    /// The successor and the VM do not belong together.
    #[error("the successor does not match this VM: {0}")]
    Mismatch(String),
    /// The successor refused the VM.
    #[error("the successor waiting on this directory refused: {0}")]
    Refused(String),
    /// Another successor already waits on the directory.
    #[error("another successor already waits on {0}")]
    Busy(PathBuf),
    /// The link to the peer failed.
    #[error(transparent)]
    Link(#[from] LocalMigrationError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The saved state.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// Building or restoring the machine.
    #[error(transparent)]
    Machine(#[from] MachineError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WarmError + '_ {
    move |source| WarmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `DIR/config.json`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PreparedConfig {
    version: u32,
    /// The old process, for the operator.
    pid: u32,
    config: MachineConfig,
}

/// Handover messages (length-prefixed JSON, see `local.rs`).
#[derive(Debug, Serialize, Deserialize)]
enum Message {
    Hello {
        version: u32,
        config: MachineConfig,
        memory_size: u64,
    },
    Ready,
    StateSaved {
        taps: usize,
    },
    Running {
        restore_ms: f64,
    },
    Failed {
        reason: String,
    },
}

fn message_name(m: &Message) -> &'static str {
    match m {
        Message::Hello { .. } => "Hello",
        Message::Ready => "Ready",
        Message::StateSaved { .. } => "StateSaved",
        Message::Running { .. } => "Running",
        Message::Failed { .. } => "Failed",
    }
}

fn unexpected(want: &str, got: &Message) -> WarmError {
    WarmError::Link(LocalMigrationError::Protocol(format!(
        "expected {want}, got {}",
        message_name(got)
    )))
}

fn memory_path(config: &MachineConfig) -> Result<&Path, WarmError> {
    match &config.memory_backing {
        MemoryBacking::File { path } => Ok(path),
        other => Err(WarmError::NotNamedMemory(format!("{other:?}"))),
    }
}

/// What differs between the VM a successor prepared for and the VM offered
/// (the serial console may differ: the successor may have its own).
fn mismatch(prepared: &MachineConfig, offered: &MachineConfig) -> Option<String> {
    let memory = |c: &MachineConfig| match &c.memory_backing {
        MemoryBacking::File { path } => path.display().to_string(),
        other => format!("{other:?}"),
    };
    let mut differs = Vec::new();
    if prepared.memory_backing != offered.memory_backing {
        differs.push(format!(
            "memory file {} vs {}",
            memory(prepared),
            memory(offered)
        ));
    }
    if prepared.memory_bytes != offered.memory_bytes {
        differs.push(format!(
            "memory size {} vs {} bytes",
            prepared.memory_bytes, offered.memory_bytes
        ));
    }
    if prepared.vcpus != offered.vcpus {
        differs.push(format!("vcpus {} vs {}", prepared.vcpus, offered.vcpus));
    }
    if prepared.disks != offered.disks || prepared.nets != offered.nets {
        differs.push("disks or network devices".into());
    }
    (!differs.is_empty()).then(|| {
        format!(
            "prepared for a different VM ({}: prepared vs offered)",
            differs.join(", ")
        )
    })
}

// ---------------------------------------------------------------------------
// The old process.

/// Writes `DIR/config.json` for a successor, without pausing the VM. A state
/// file left in DIR by an earlier restart is removed: it is older than the
/// running VM and must not be restored over its memory.
pub fn write_config(dir: &Path, config: &MachineConfig) -> Result<PathBuf, WarmError> {
    memory_path(config)?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let stale = dir.join(snapshot::STATE_FILE);
    match std::fs::remove_file(&stale) {
        Ok(()) => tracing::info!(path = %stale.display(), "removed an older state file"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&stale)(e)),
    }
    let path = dir.join(CONFIG_FILE);
    let bytes = serde_json::to_vec_pretty(&PreparedConfig {
        version: VERSION,
        pid: std::process::id(),
        config: config.clone(),
    })
    .map_err(|e| WarmError::Config {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let tmp = dir.join(format!("{CONFIG_FILE}.tmp"));
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(&bytes).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(path)
}

/// A successor that has accepted this VM and waits for its state.
pub struct Successor {
    stream: UnixStream,
}

/// Connects to the successor waiting on `dir`, if one does, and checks that
/// it was prepared for this VM. `Ok(None)`: no successor (none started, or
/// one that has gone): the warm restart goes on without one.
pub fn connect(
    dir: &Path,
    config: &MachineConfig,
    memory_size: u64,
) -> Result<Option<Successor>, WarmError> {
    let path = dir.join(SOCKET_FILE);
    let stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            tracing::warn!(socket = %path.display(), error = %e, "no successor answers: warm restart without one");
            return Ok(None);
        }
    };
    stream
        .set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(LocalMigrationError::from)?;
    send(
        &stream,
        &Message::Hello {
            version: VERSION,
            config: config.clone(),
            memory_size,
        },
        &[],
    )?;
    match recv(&stream)?.0 {
        Message::Ready => Ok(Some(Successor { stream })),
        Message::Failed { reason } => Err(WarmError::Refused(reason)),
        other => Err(unexpected("Ready", &other)),
    }
}

impl Successor {
    /// Tells the successor that the state is in DIR and the VM paused for
    /// good, handing it the TAP fds; returns its restore time (ms) once it
    /// runs the VM. The caller must never resume the VM after this call.
    pub fn hand_over(self, taps: Vec<File>) -> Result<f64, WarmError> {
        let fds: Vec<_> = taps.iter().map(|f| f.as_raw_fd()).collect();
        send(
            &self.stream,
            &Message::StateSaved { taps: taps.len() },
            &fds,
        )?;
        // The successor holds its own references now.
        drop(taps);
        match recv(&self.stream)?.0 {
            Message::Running { restore_ms } => Ok(restore_ms),
            Message::Failed { reason } => Err(WarmError::Refused(reason)),
            other => Err(unexpected("Running", &other)),
        }
    }
}

// ---------------------------------------------------------------------------
// The successor.

/// A successor with its VM built and memory registered, listening for the old
/// process.
pub struct Prepared {
    dir: PathBuf,
    config: MachineConfig,
    vm: PreparedVm,
    listener: UnixListener,
    socket: SocketFile,
}

/// The successor's socket path, removed when the successor no longer listens.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Reads `DIR/config.json`, opens and maps the VM's memory file, creates the
/// KVM VM with its memory slots, and listens on `DIR/successor.sock`.
pub fn prepare(dir: &Path) -> Result<Prepared, WarmError> {
    let started = Instant::now();
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|source| WarmError::Io {
        path: path.clone(),
        source: if source.kind() == std::io::ErrorKind::NotFound {
            std::io::Error::new(
                source.kind(),
                "not found: run `kemarictl warm-restart DIR --prepare` on the running kemari first",
            )
        } else {
            source
        },
    })?;
    let file: PreparedConfig = serde_json::from_slice(&text).map_err(|e| WarmError::Config {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if file.version != VERSION {
        return Err(WarmError::Config {
            path,
            reason: format!("version {}, this kemari reads {VERSION}", file.version),
        });
    }
    let config = file.config;
    let memory = memory_path(&config)?;
    // Never create it: a successor only takes over memory a VM already has.
    let actual = std::fs::metadata(memory)
        .map_err(|source| {
            WarmError::Mismatch(format!("memory file {}: {source}", memory.display()))
        })?
        .len();
    if actual != config.memory_bytes {
        return Err(WarmError::Mismatch(format!(
            "memory file {} is {actual} bytes, the VM has {}",
            memory.display(),
            config.memory_bytes
        )));
    }
    let memory = GuestMemoryFile::create(config.memory_bytes, &config.memory_backing)?;
    let mut vm = Machine::prepare(memory)?;
    vm.create_vcpus(config.vcpus)?;
    let socket = dir.join(SOCKET_FILE);
    if UnixStream::connect(&socket).is_ok() {
        return Err(WarmError::Busy(dir.to_path_buf()));
    }
    let listener = vmm::unix_socket::bind_listening(&socket).map_err(io_err(&socket))?;
    tracing::info!(
        dir = %dir.display(),
        old_pid = file.pid,
        prepared_us = started.elapsed().as_micros() as u64,
        "successor prepared: waiting for the state"
    );
    Ok(Prepared {
        dir: dir.to_path_buf(),
        config,
        vm,
        listener,
        socket: SocketFile(socket),
    })
}

impl Prepared {
    /// Waits for the old process to hand the VM over, then restores it into
    /// the prepared VM and runs it (unless `start_paused`). `adjust` may change
    /// the saved configuration (this process's serial console). On error
    /// nothing of the VM runs here and the state stays in DIR.
    pub fn await_state(
        self,
        events: VmEventSink,
        start_paused: bool,
        adjust: impl FnOnce(&mut MachineConfig),
    ) -> Result<Machine, WarmError> {
        let (stream, taps) = loop {
            let (stream, _) = self.listener.accept().map_err(io_err(&self.socket.0))?;
            match self.take_handover(&stream) {
                Ok(Some(taps)) => break (stream, taps),
                Ok(None) => {
                    tracing::warn!("the old kemari went away before saving its state: waiting on")
                }
                Err(e) => tracing::warn!(error = %e, "a warm restart was refused: waiting on"),
            }
        };
        let started = Instant::now();
        let result = self.restore(events, start_paused, adjust, taps);
        let reply = match &result {
            Ok(_) => Message::Running {
                restore_ms: started.elapsed().as_secs_f64() * 1000.0,
            },
            Err(e) => Message::Failed {
                reason: e.to_string(),
            },
        };
        // The old process may be gone already: the VM runs here regardless.
        if let Err(e) = send(&stream, &reply, &[]) {
            tracing::debug!(error = %e, "cannot tell the old kemari");
        }
        if result.is_ok() {
            tracing::info!("warm restart: VM taken over from the old kemari");
        }
        result
    }

    /// One connection: Hello → Ready → StateSaved. The TAP fds once the state
    /// is saved; `None` if the old process hung up before (its save failed
    /// and the guest runs on there).
    fn take_handover(&self, stream: &UnixStream) -> Result<Option<Vec<File>>, WarmError> {
        let hello = recv(stream)?.0;
        let Message::Hello {
            version,
            config,
            memory_size,
        } = hello
        else {
            return Err(unexpected("Hello", &hello));
        };
        let refusal = if version != VERSION {
            Some(format!(
                "the old kemari speaks version {version}, this one {VERSION}"
            ))
        } else if memory_size != self.config.memory_bytes {
            Some(format!(
                "prepared for {} bytes of memory, the VM has {memory_size}",
                self.config.memory_bytes
            ))
        } else {
            mismatch(&self.config, &config)
        };
        if let Some(reason) = refusal {
            let _ = send(
                stream,
                &Message::Failed {
                    reason: reason.clone(),
                },
                &[],
            );
            return Err(WarmError::Mismatch(reason));
        }
        send(stream, &Message::Ready, &[])?;
        // No timeout: the old process pauses only when told to.
        match recv::<Message>(stream) {
            Ok((Message::StateSaved { taps }, files)) if files.len() == taps => Ok(Some(files)),
            Ok((Message::StateSaved { taps }, files)) => {
                Err(WarmError::Link(LocalMigrationError::Protocol(format!(
                    "StateSaved announces {taps} TAP fds, carries {}",
                    files.len()
                ))))
            }
            Ok((other, _)) => Err(unexpected("StateSaved", &other)),
            Err(LocalMigrationError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn restore(
        self,
        events: VmEventSink,
        start_paused: bool,
        adjust: impl FnOnce(&mut MachineConfig),
        taps: Vec<File>,
    ) -> Result<Machine, WarmError> {
        let mut state = snapshot::read_state(&self.dir)?;
        if let Some(why) = mismatch(&self.config, &state.config) {
            return Err(WarmError::Mismatch(format!(
                "{}: {why}",
                self.dir.join(snapshot::STATE_FILE).display()
            )));
        }
        adjust(&mut state.config);
        Ok(Machine::restore_prepared(
            &state,
            self.vm,
            events,
            start_paused,
            Arc::new(PassThroughGate),
            taps,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(path: &str) -> MachineConfig {
        MachineConfig {
            vcpus: 1,
            memory_bytes: 64 << 20,
            memory_backing: MemoryBacking::File { path: path.into() },
            kernel: "/k".into(),
            initramfs: None,
            cmdline: String::new(),
            serial: Default::default(),
            disks: Vec::new(),
            nets: Vec::new(),
        }
    }

    #[test]
    fn mismatches_are_named() {
        let a = config("/dev/shm/a");
        assert_eq!(mismatch(&a, &a), None);
        let mut serial = a.clone();
        serial.serial = vmm::config::SerialConfig::Null;
        assert_eq!(mismatch(&a, &serial), None, "the console may differ");
        let b = config("/dev/shm/b");
        assert!(mismatch(&a, &b).unwrap().contains("/dev/shm/b"));
        let mut two = a.clone();
        two.vcpus = 2;
        assert!(mismatch(&a, &two).unwrap().contains("vcpus"));
    }

    #[test]
    fn config_needs_named_memory_and_prepare_needs_the_file() {
        let dir = std::env::temp_dir().join(format!("kemari-warm-{}", std::process::id()));
        let mut memfd = config("/x");
        memfd.memory_backing = MemoryBacking::Memfd;
        assert!(matches!(
            write_config(&dir, &memfd),
            Err(WarmError::NotNamedMemory(_))
        ));
        // A stale state goes; the memory file does not exist: refused.
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(snapshot::STATE_FILE), b"old").unwrap();
        let missing = dir.join("no-such-memory");
        write_config(&dir, &config(missing.to_str().unwrap())).unwrap();
        assert!(!dir.join(snapshot::STATE_FILE).exists());
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
