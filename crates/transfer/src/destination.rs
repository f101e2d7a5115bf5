//! The one destination sequence: receive the offer → prepare memory and the
//! KVM VM → `Ready` → pre-copy rounds → the state → restore → commit →
//! `Running`. Live migration, zero-copy migration and a warm-restart
//! successor run all of it ([`receive`]) with their [`Target`] and
//! [`RunAs`]; a fault-tolerance standby runs its first half
//! ([`read_offer`], [`Preparing`], [`receive_rounds`]) and then follows
//! epochs.
//!
//! On any failure nothing of the VM runs here (a live destination that
//! already ran the guest discards that run, none of whose outputs left the
//! VM) and the other end is told why with `Failed{reason}`.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use vmm::config::MachineConfig;
use vmm::machine::{Machine, MachineError, PreparedVm};
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::output::{CommitGate, OutputGate, PassThroughGate};
use vmm::persist::{format, snapshot, VmState};
use vmm::vstate::VmEventSink;

use crate::error::TransferError;
use crate::faults::{hold, HoldPoint};
use crate::link::Duplex;
use crate::message::{Kind, Message, Mode};
use crate::pages::{write_batch, PageError};
use crate::streams::receive::{Joiner, ReceivingStreams};
use crate::streams::MAX_CONNECTIONS;
use crate::sys;

/// How long the destination waits for a round to end on every page stream
/// once it ended on the main connection.
const STREAM_ROUND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A random number the page streams of one migration must show.
fn session_number() -> Result<u64, TransferError> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 8];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| TransferError::Memory("no random numbers from the system".into()))?;
    Ok(u64::from_le_bytes(b))
}

/// What the source offered.
#[derive(Debug)]
pub struct Offered {
    /// For what.
    pub mode: Mode,
    /// The VM's configuration.
    pub config: MachineConfig,
    /// Its memory size.
    pub memory_size: u64,
    /// The fds that came with the offer (local: memory, then TAPs).
    pub fds: Vec<File>,
    /// TCP connections offered (live migration; 1 = the main one).
    pub streams: u32,
}

/// Reads the offer; the fds it announces must have come with it.
pub fn read_offer<D: Duplex + ?Sized>(
    link: &mut D,
    buf: &mut Vec<u8>,
) -> Result<Offered, TransferError> {
    link.set_phase("waiting for the offer");
    match link.recv_msg(buf)? {
        Message::Offer {
            mode,
            config,
            memory_size,
            fds,
            streams,
        } => {
            let files = link.take_fds();
            if files.len() != fds as usize {
                return Err(TransferError::Malformed {
                    peer: link.peer(),
                    phase: link.phase(),
                    detail: format!("the offer announces {fds} fds and carries {}", files.len()),
                });
            }
            Ok(Offered {
                mode,
                config: *config,
                memory_size,
                fds: files,
                streams,
            })
        }
        other => Err(link.unexpected("Offer", other)),
    }
}

impl Offered {
    /// Checks that the offered VM is one this kemari can run, for `mode`.
    pub fn check(&self, mode_name: &str) -> Result<(), TransferError> {
        if self.mode.name() != mode_name {
            return Err(TransferError::Mismatch(format!(
                "this kemari waits for a {mode_name}, the other end offers a {}",
                self.mode.name()
            )));
        }
        self.config
            .validate()
            .map_err(|e| TransferError::Mismatch(format!("the offered VM: {e}")))?;
        if self.memory_size != self.config.memory_bytes {
            return Err(TransferError::Mismatch(format!(
                "the offer's memory size ({} bytes) does not match its configuration ({})",
                self.memory_size, self.config.memory_bytes
            )));
        }
        Ok(())
    }
}

/// The destination's KVM VM, built while pages arrive or ahead of the
/// offer.
pub struct Preparing {
    built: Option<Box<PreparedVm>>,
    building: Option<JoinHandle<Result<PreparedVm, MachineError>>>,
}

impl Preparing {
    /// A VM already built.
    pub fn ready(vm: PreparedVm) -> Self {
        Preparing {
            built: Some(Box::new(vm)),
            building: None,
        }
    }

    /// Builds the KVM VM around `memory` in a thread: its memory slots, the
    /// `vcpus` vCPUs and, with `threads_ahead`, their threads and the device
    /// loop's (milliseconds, more on a busy host), off the transfer's path —
    /// as QEMU's `-incoming` has its VM ready.
    pub fn in_thread(
        memory: GuestMemoryFile,
        vcpus: u8,
        threads_ahead: bool,
    ) -> Result<Self, TransferError> {
        let t = std::thread::Builder::new()
            .name("vm-prepare".into())
            .spawn(move || {
                let started = Instant::now();
                let prepared = Machine::prepare(memory).and_then(|mut p| {
                    p.create_vcpus(vcpus)?;
                    if threads_ahead {
                        p.start_threads_ahead()?;
                    }
                    Ok(p)
                });
                tracing::debug!(
                    ms = started.elapsed().as_secs_f64() * 1000.0,
                    "hand-over: VM, memory slots and vCPUs prepared"
                );
                prepared
            })
            .map_err(|e| TransferError::Memory(format!("cannot start a thread: {e}")))?;
        Ok(Preparing {
            built: None,
            building: Some(t),
        })
    }

    /// Waits until the VM is built.
    pub fn finish(&mut self) -> Result<&mut PreparedVm, TransferError> {
        if let Some(t) = self.building.take() {
            let vm = t
                .join()
                .map_err(|_| TransferError::Memory("preparing the VM panicked".into()))??;
            self.built = Some(Box::new(vm));
        }
        self.built
            .as_deref_mut()
            .ok_or_else(|| TransferError::Memory("no VM was prepared".into()))
    }

    /// A VM handed in later (a warm successor's, once the state came).
    fn later() -> Self {
        Preparing {
            built: None,
            building: None,
        }
    }

    /// The VM, if it is built (without waiting).
    pub fn built(&self) -> Option<&PreparedVm> {
        self.built.as_deref()
    }

    /// The built VM.
    pub fn take(mut self) -> Result<PreparedVm, TransferError> {
        self.finish()?;
        self.built
            .take()
            .map(|vm| *vm)
            .ok_or_else(|| TransferError::Memory("no VM was prepared".into()))
    }
}

/// What ended the pre-copy on the destination.
#[derive(Debug)]
pub enum Arrival {
    /// The state, in a frame (live, local).
    State(Vec<u8>),
    /// The state is in the state directory; the TAP fds came (warm).
    StateSaved(Vec<File>),
    /// A batch of epoch pages (fault tolerance: its first epoch begins).
    EpochPages(Vec<u8>),
    /// Another message (fault tolerance: `EpochEnd`, `Stop`).
    Message(Message),
}

fn page_error<D: Duplex + ?Sized>(link: &D, e: PageError) -> TransferError {
    match e {
        PageError::Malformed(detail) => TransferError::Malformed {
            peer: link.peer(),
            phase: link.phase(),
            detail,
        },
        PageError::Io(e) => TransferError::Memory(e.to_string()),
    }
}

/// Receives pre-copy rounds into `memory` — each round acknowledged once
/// its pages are in memory and the VM is built — until something else
/// arrives.
pub fn receive_rounds<D: Duplex + ?Sized>(
    link: &mut D,
    memory: &GuestMemoryFile,
    preparing: &mut Preparing,
    buf: &mut Vec<u8>,
) -> Result<Arrival, TransferError> {
    receive_rounds_over(link, memory, preparing, None, buf)
}

/// [`receive_rounds`] with page streams: a round is acknowledged once it
/// ended on every stream too.
fn receive_rounds_over<D: Duplex + ?Sized>(
    link: &mut D,
    memory: &GuestMemoryFile,
    preparing: &mut Preparing,
    mut streams: Option<&mut ReceivingStreams>,
    buf: &mut Vec<u8>,
) -> Result<Arrival, TransferError> {
    link.set_phase("receiving memory");
    loop {
        match link.recv(buf)? {
            Kind::Pages => {
                write_batch(memory.file(), memory.size(), buf).map_err(|e| page_error(link, e))?;
            }
            Kind::State => return Ok(Arrival::State(std::mem::take(buf))),
            Kind::EpochPages => return Ok(Arrival::EpochPages(std::mem::take(buf))),
            Kind::Control => match link.decode(buf)? {
                Message::RoundEnd { round, pages } => {
                    tracing::debug!(
                        round,
                        pages,
                        cpu_ms = sys::thread_cpu_ms(),
                        "pre-copy round received"
                    );
                    // Every page of the round is in memory only once it
                    // ended on every stream as well.
                    if let Some(streams) = streams.as_deref_mut() {
                        streams.wait_round(round, STREAM_ROUND_TIMEOUT)?;
                    }
                    // The first acknowledgement also says the VM is
                    // built: the source never pauses before it is.
                    preparing.finish()?;
                    link.send_msg(&Message::RoundAck { round })?;
                    // The pause may come next: the state's decode, its
                    // first step, is cold after a round of pages went
                    // through the caches.
                    format::warm_up();
                }
                Message::Heartbeat => {}
                Message::StateSaved { fds } => return state_saved(link, fds),
                Message::Failed { reason } => {
                    return Err(TransferError::Refused {
                        peer: link.peer(),
                        reason,
                    })
                }
                other => return Ok(Arrival::Message(other)),
            },
        }
    }
}

/// Where the destination's VM comes from.
pub enum Target {
    /// A fresh memfd of the offered size; the VM built in a thread while
    /// pages arrive (live migration).
    FreshMemory,
    /// The memory fd that came with the offer, mapped again (zero-copy);
    /// or a VM built ahead of the offer around that very file (`--memory-file`).
    OfferedMemory {
        /// Built ahead: the file's (device, inode) and the VM (taken by
        /// the first offer).
        built_ahead: Option<BuiltAhead>,
    },
    /// A VM prepared ahead for the configuration in a state directory
    /// (warm-restart successor), which the offer must match.
    Prepared {
        /// The VM (taken once the state arrived: until then a failed
        /// attempt leaves it for the next one).
        vm: Option<Box<PreparedVm>>,
        /// What it was prepared for.
        config: MachineConfig,
        /// Where the state will be.
        dir: std::path::PathBuf,
    },
}

/// A KVM VM built around a named memory file before any source connects
/// (`kemari --incoming-local SOCK --memory-file PATH`), as QEMU's
/// `-incoming defer` destination maps its `memory-backend-file` at
/// start-up: the offer then only has to show that it hands over that same
/// file.
pub struct BuiltAhead {
    /// The memory file.
    pub path: std::path::PathBuf,
    /// (st_dev, st_ino) of the file, to recognise the offered fd.
    pub identity: (u64, u64),
    /// The VM.
    pub vm: PreparedVm,
}

/// How the restored VM starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunAs {
    /// At once, its outputs held until the source's `Commit` (live: the
    /// commit's round trip is not in the guest's pause; the memory is this
    /// process's own, so a run without commit can be discarded).
    RunHeld,
    /// Paused until the source's `Commit` (zero-copy: the memory is shared
    /// with the source, which must not be able to resume on it once this
    /// end ran).
    PausedUntilCommit,
    /// At once (or paused, if asked), no commit exchange: the state file is
    /// the commit (warm restart).
    Run {
        /// Build it paused (`--start-paused`).
        start_paused: bool,
    },
}

/// Runs the whole destination sequence over `link` and returns the VM
/// running here; `adjust` may change the saved configuration (this host's
/// TAP names, this process's serial console). On failure the other end is
/// told why and nothing of the VM runs here; a [`Target::Prepared`] keeps
/// its VM if the failure came before the state.
pub fn receive<D: Duplex + ?Sized>(
    link: &mut D,
    mode_name: &str,
    target: &mut Target,
    run_as: RunAs,
    events: VmEventSink,
    adjust: &mut dyn FnMut(&mut MachineConfig),
) -> Result<Machine, TransferError> {
    receive_joined(link, mode_name, target, run_as, events, adjust, None)
}

/// [`receive`], with the listener page streams join on if the offer asks
/// for several connections (live migration; closed after the offer or the
/// joins).
pub fn receive_joined<D: Duplex + ?Sized>(
    link: &mut D,
    mode_name: &str,
    target: &mut Target,
    run_as: RunAs,
    events: VmEventSink,
    adjust: &mut dyn FnMut(&mut MachineConfig),
    joiner: Option<Joiner<'_>>,
) -> Result<Machine, TransferError> {
    let result = receive_inner(link, mode_name, target, run_as, events, adjust, joiner);
    if let Err(e) = &result {
        let _ = link.send_msg(&Message::Failed {
            reason: e.to_string(),
        });
    }
    result
}

fn receive_inner<D: Duplex + ?Sized>(
    link: &mut D,
    mode_name: &str,
    target: &mut Target,
    run_as: RunAs,
    events: VmEventSink,
    adjust: &mut dyn FnMut(&mut MachineConfig),
    joiner: Option<Joiner<'_>>,
) -> Result<Machine, TransferError> {
    let mut buf = Vec::new();
    let offered = read_offer(link, &mut buf)?;
    offered.check(mode_name)?;
    let Offered {
        config,
        memory_size,
        fds,
        streams: offered_streams,
        ..
    } = offered;
    if offered_streams > 1
        && (joiner.is_none()
            || !matches!(target, Target::FreshMemory)
            || offered_streams > u32::from(MAX_CONNECTIONS))
    {
        return Err(TransferError::Mismatch(format!(
            "{offered_streams} connections offered: only a live migration takes several, at most {MAX_CONNECTIONS}"
        )));
    }
    let mut fds = fds.into_iter();
    // Memory and the KVM VM.
    let (memory, mut preparing, state_dir) = match target {
        Target::FreshMemory => {
            let memory = GuestMemoryFile::create(memory_size, &MemoryBacking::Memfd)
                .map_err(|e| TransferError::Memory(e.to_string()))?;
            let preparing = Preparing::in_thread(memory.clone(), config.vcpus, true)?;
            (Some(memory), preparing, None)
        }
        Target::OfferedMemory { built_ahead } => {
            let memory_fd = fds.next().ok_or_else(|| {
                TransferError::Mismatch("the offer carries no guest memory".into())
            })?;
            let mut vm = match built_ahead.take() {
                Some(ahead) => ahead.take_for(&memory_fd, memory_size)?,
                // Build the VM around the same memory while the guest still
                // runs on the source: KVM's memory-slot set-up grows with
                // memory size and must not count in the pause. The backing
                // kind is corrected from the state.
                None => Machine::prepare(
                    GuestMemoryFile::from_file(memory_fd, memory_size, MemoryBacking::Memfd)
                        .map_err(|e| TransferError::Memory(e.to_string()))?,
                )?,
            };
            // KVM_CREATE_VCPU is slow here too, and so are a thread's start
            // and its seccomp filter's installation: all before the pause.
            vm.create_vcpus(config.vcpus)?;
            vm.start_threads_ahead()?;
            (None, Preparing::ready(vm), None)
        }
        Target::Prepared {
            config: prepared_for,
            dir,
            ..
        } => {
            if memory_size != prepared_for.memory_bytes {
                return Err(TransferError::Mismatch(format!(
                    "prepared for {} bytes of memory, the VM has {memory_size}",
                    prepared_for.memory_bytes
                )));
            }
            if let Some(why) = mismatch(prepared_for, &config) {
                return Err(TransferError::Mismatch(why));
            }
            (None, Preparing::later(), Some(dir.clone()))
        }
    };
    let taps_offered: Vec<File> = fds.collect();
    let mut streams = None;
    match (joiner, &memory) {
        (Some(joiner), Some(memory)) if offered_streams > 1 => {
            let session = session_number()?;
            link.send_msg(&Message::StreamsReady {
                streams: offered_streams,
                session,
            })?;
            link.set_phase("waiting for the page streams to join");
            streams = Some(joiner.join(offered_streams - 1, session, memory)?);
        }
        // One connection: the listener closes now.
        _ => link.send_msg(&Message::Ready)?,
    }

    let arrival = match &memory {
        Some(memory) => {
            let got = receive_rounds_over(link, memory, &mut preparing, streams.as_mut(), &mut buf);
            // A stream that failed is the cause of whatever broke next.
            match (got, streams.as_mut().and_then(ReceivingStreams::failure)) {
                (Err(TransferError::Stream { detail }), _) => {
                    return Err(TransferError::Stream { detail })
                }
                (Err(_), Some(cause)) => return Err(cause),
                (got, _) => got?,
            }
        }
        // Nothing to copy (the memory is shared or kept): the state next.
        None => receive_state_only(link, &mut buf)?,
    };
    // The pre-copy is over: its streams are closed.
    drop(streams);
    if let (Some(memory), Arrival::State(_)) = (&memory, &arrival) {
        crate::memory_digest::log_if_enabled("destination", memory.file(), memory.size());
    }
    // The source is paused: the vCPU threads made ahead poll for their
    // start from now on (their wake-up overlaps the restore).
    if let Some(vm) = preparing.built() {
        vm.get_vcpu_threads_ready();
    }
    hold(HoldPoint::StateReceived);
    let started = Instant::now();
    if let Target::Prepared { vm, .. } = target {
        let vm = vm
            .take()
            .ok_or_else(|| TransferError::Memory("the prepared VM was used up".into()))?;
        preparing = Preparing::ready(*vm);
    }
    let prepared = preparing.take()?;
    let (mut state, taps) = match arrival {
        Arrival::State(bytes) => (
            format::decode(&bytes).map_err(|e| TransferError::Malformed {
                peer: link.peer(),
                phase: "decoding the state".into(),
                detail: e.to_string(),
            })?,
            taps_offered,
        ),
        Arrival::StateSaved(taps) => {
            let dir = state_dir.as_deref().ok_or_else(|| {
                TransferError::Mismatch("a state directory's state where none was expected".into())
            })?;
            (read_state_for(dir, &config)?, taps)
        }
        Arrival::EpochPages(_) => return Err(link.out_of_order(Kind::EpochPages, "the state")),
        Arrival::Message(m) => return Err(link.unexpected("the state", m)),
    };
    adjust(&mut state.config);
    if memory.is_some() {
        // Fresh memory here, whatever the source had.
        state.config.memory_backing = MemoryBacking::Memfd;
        state.memory.backing = MemoryBacking::Memfd;
    }
    restore_and_run(link, state, prepared, run_as, events, taps, started)
}

/// `StateSaved` came, announcing `fds` TAP fds: they must have come with it.
fn state_saved<D: Duplex + ?Sized>(link: &mut D, fds: u32) -> Result<Arrival, TransferError> {
    let files = link.take_fds();
    if files.len() != fds as usize {
        return Err(TransferError::Malformed {
            peer: link.peer(),
            phase: link.phase(),
            detail: format!(
                "StateSaved announces {fds} TAP fds and carries {}",
                files.len()
            ),
        });
    }
    Ok(Arrival::StateSaved(files))
}

/// Waits for the state of a hand-over without pre-copy.
fn receive_state_only<D: Duplex + ?Sized>(
    link: &mut D,
    buf: &mut Vec<u8>,
) -> Result<Arrival, TransferError> {
    link.set_phase("waiting for the state");
    match link.recv(buf)? {
        Kind::State => Ok(Arrival::State(std::mem::take(buf))),
        Kind::Control => match link.decode(buf)? {
            Message::StateSaved { fds } => state_saved(link, fds),
            other => Err(link.unexpected("the state", other)),
        },
        other => Err(link.out_of_order(other, "the state")),
    }
}

fn read_state_for(dir: &Path, prepared_for: &MachineConfig) -> Result<VmState, TransferError> {
    let state = snapshot::read_state(dir).map_err(|e| TransferError::File {
        path: dir.join(snapshot::STATE_FILE).display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    if let Some(why) = mismatch(prepared_for, &state.config) {
        return Err(TransferError::Mismatch(format!(
            "{}: {why}",
            dir.join(snapshot::STATE_FILE).display()
        )));
    }
    Ok(state)
}

fn restore_and_run<D: Duplex + ?Sized>(
    link: &mut D,
    state: VmState,
    prepared: PreparedVm,
    run_as: RunAs,
    events: VmEventSink,
    taps: Vec<File>,
    started: Instant,
) -> Result<Machine, TransferError> {
    let commit_gate = Arc::new(CommitGate::default());
    let (start_paused, gate): (bool, Arc<dyn OutputGate>) = match run_as {
        RunAs::RunHeld => (false, commit_gate.clone()),
        RunAs::PausedUntilCommit => (true, Arc::new(PassThroughGate)),
        RunAs::Run { start_paused } => (start_paused, Arc::new(PassThroughGate)),
    };
    link.set_phase("restoring the VM");
    let mut machine =
        Machine::restore_prepared(&state, prepared, events, start_paused, gate, taps)?;
    let t_restored = started.elapsed();
    let mut t_committed = t_restored;
    if matches!(run_as, RunAs::RunHeld | RunAs::PausedUntilCommit) {
        if run_as == RunAs::RunHeld {
            // From this thread, while the guest runs on its own: not from
            // the vCPU thread at its first partial line.
            machine.start_console_flusher();
            hold(HoldPoint::BeforeCommit);
        }
        link.set_phase("waiting for the commit");
        let mut buf = Vec::new();
        let commit = link
            .send_msg(&Message::Restored {
                restore_ms: t_restored.as_millis() as u64,
            })
            .and_then(|()| link.recv_msg(&mut buf));
        match commit {
            Ok(Message::Commit) => commit_gate.commit(),
            other => {
                commit_gate.discard();
                // Stop the guest at once; the machine is torn down on return.
                let _ = machine.pause();
                if run_as == RunAs::RunHeld {
                    tracing::warn!(
                        held_requests = commit_gate.held_requests(),
                        held_console_bytes = machine.console_bytes_pending(),
                        "hand-over: no commit; the run of the guest here is discarded, nothing it output left the VM"
                    );
                }
                return Err(match other {
                    Ok(m) => link.unexpected("Commit", m),
                    Err(e) => e,
                });
            }
        }
        t_committed = started.elapsed();
        if run_as == RunAs::PausedUntilCommit {
            machine.resume()?;
        }
    }
    let restore_ms = started.elapsed().as_secs_f64() * 1000.0;
    // The source exits on this; the VM is ours whether it hears it or not.
    if let Err(e) = link.send_msg(&Message::Running { restore_ms }) {
        tracing::warn!(error = %e, "hand-over: cannot tell the other end the VM runs");
    }
    let us = |d: std::time::Duration| d.as_micros() as u64;
    tracing::debug!(
        restored_us = us(t_restored),
        commit_received_us = us(t_committed),
        running_us = us(started.elapsed()),
        "hand-over: destination timeline (from the state's arrival)"
    );
    Ok(machine)
}

impl BuiltAhead {
    /// Maps the named memory file `path` (never created or resized: a
    /// destination only takes over memory a running VM already has) and
    /// builds the KVM VM around it.
    pub fn new(path: &Path) -> Result<Self, TransferError> {
        use std::os::unix::fs::MetadataExt;
        let started = Instant::now();
        let meta = std::fs::metadata(path).map_err(TransferError::file(format!(
            "memory file {}",
            path.display()
        )))?;
        let memory = GuestMemoryFile::create(
            meta.len(),
            &MemoryBacking::File {
                path: path.to_path_buf(),
            },
        )
        .map_err(|e| TransferError::Memory(format!("memory file {}: {e}", path.display())))?;
        let vm = Machine::prepare(memory)?;
        tracing::info!(
            memory_file = %path.display(),
            size = meta.len(),
            prepared_us = started.elapsed().as_micros() as u64,
            "VM built ahead around the memory file"
        );
        Ok(BuiltAhead {
            path: path.to_path_buf(),
            identity: (meta.dev(), meta.ino()),
            vm,
        })
    }

    /// The prepared VM, if `offered` (size `size`) is this very file.
    fn take_for(self, offered: &File, size: u64) -> Result<PreparedVm, TransferError> {
        use std::os::unix::fs::MetadataExt;
        let meta = offered
            .metadata()
            .map_err(TransferError::file("the offered memory"))?;
        if (meta.dev(), meta.ino()) != self.identity {
            return Err(TransferError::Mismatch(format!(
                "the source's guest memory is not {} (this destination's --memory-file): \
                 give the destination the source's memory file, or no --memory-file",
                self.path.display()
            )));
        }
        if size != self.vm.memory_file().size() {
            return Err(TransferError::Mismatch(format!(
                "the source offers {size} bytes of memory, {} has {}",
                self.path.display(),
                self.vm.memory_file().size()
            )));
        }
        Ok(self.vm)
    }
}

/// What differs between the VM a successor prepared for and the VM offered
/// (the serial console may differ: the successor may have its own).
pub fn mismatch(prepared: &MachineConfig, offered: &MachineConfig) -> Option<String> {
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
    if prepared.disks != offered.disks
        || prepared.nets != offered.nets
        || prepared.pmem != offered.pmem
    {
        differs.push("disks, network or pmem devices".into());
    }
    (!differs.is_empty()).then(|| {
        format!(
            "prepared for a different VM ({}: prepared vs offered)",
            differs.join(", ")
        )
    })
}

/// A machine configuration for unit tests: 64 MiB in the named file `path`.
#[cfg(test)]
pub(crate) fn test_config(path: &str) -> MachineConfig {
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
        pmem: Vec::new(),
        id: None,
        name: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatches_are_named() {
        let a = test_config("/dev/shm/a");
        assert_eq!(mismatch(&a, &a), None);
        let mut serial = a.clone();
        serial.serial = vmm::config::SerialConfig::Null;
        assert_eq!(mismatch(&a, &serial), None, "the console may differ");
        let b = test_config("/dev/shm/b");
        assert!(mismatch(&a, &b).unwrap().contains("/dev/shm/b"));
        let mut two = a.clone();
        two.vcpus = 2;
        assert!(mismatch(&a, &two).unwrap().contains("vcpus"));
    }
}
