//! The standby: receives the primary's synchronizations and runs the VM from
//! the last complete epoch when the primary is lost.
//!
//! Pages of the live pre-copy (epoch 0) go straight into guest memory: there
//! is no complete image yet to protect. From epoch 1 on, an epoch's pages are
//! staged in memory; only when its state blob has arrived is the epoch
//! acknowledged and then applied (pages written, state replaced) — so guest
//! memory plus the kept state always form the last complete epoch, and an
//! epoch the link cut off is discarded.
//!
//! The primary is lost when no frame (heartbeats included) arrives within its
//! timeout, or the link fails. The standby then takes the fence (if one is
//! configured; see [`super::fence`]), restores the VM into the memory and KVM
//! VM it prepared at the start, announces the guest's MACs and runs it.

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm::config::MachineConfig;
use vmm::machine::Machine;
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::output::PassThroughGate;
use vmm::persist::format;
use vmm::vstate::VmEventSink;

use super::fence::Fence;
use super::protocol::{unpack_state, FtMessage};
use super::status::{FtShared, FtState};
use super::FtError;
use crate::migration::tcp::{pfn_offset, write_frame};
use crate::migration::wire::{decode_pages, Channel, Kind, WireError};

/// How the standby is set up (`kemari --ft-standby`).
#[derive(Debug, Clone)]
pub struct StandbyOptions {
    /// Address to listen on.
    pub listen: String,
    /// Pre-shared key.
    pub key: Vec<u8>,
    /// The fence to take before running the VM.
    pub fence: Option<PathBuf>,
    /// The STONITH-style command to run before running the VM.
    pub fence_cmd: Option<String>,
}

/// How standing by ended.
pub enum StandbyOutcome {
    /// The primary was lost: the VM runs here now (holding the fence, if any).
    FailedOver(Machine, Option<Fence>),
    /// The primary ended protection normally.
    PrimaryStopped(String),
}

type Writer = Arc<Mutex<Channel<BufWriter<TcpStream>>>>;

fn send(writer: &Writer, msg: &FtMessage) -> Result<(), WireError> {
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    w.send_json(msg)?;
    w.flush()
}

/// Writes a page batch into guest memory; returns how many pages it held.
fn apply_pages(memory: &GuestMemoryFile, payload: &[u8]) -> Result<u64, WireError> {
    let count = payload
        .get(4..8)
        .map_or(0, |c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    write_frame(memory.file(), memory.size(), payload)?;
    Ok(u64::from(count))
}

/// What the standby has of the VM.
struct Replica {
    config: MachineConfig,
    memory: GuestMemoryFile,
    prepared: vmm::machine::PreparedVm,
    /// State of the last complete epoch.
    state: Option<Vec<u8>>,
    epoch: u64,
}

/// Waits for a primary on `opts.listen`, follows it, and fails over when it is
/// lost. `adjust` may change the received configuration (this host's TAPs,
/// serial output).
pub fn run(
    opts: &StandbyOptions,
    events: VmEventSink,
    adjust: impl FnOnce(&mut MachineConfig),
    shared: &Arc<FtShared>,
) -> Result<StandbyOutcome, FtError> {
    let io = |e: std::io::Error| FtError::Wire(e.into());
    let listener = TcpListener::bind(&opts.listen)
        .map_err(|e| FtError::Protocol(format!("cannot listen on {}: {e}", opts.listen)))?;
    shared.begin("standby", FtState::Standby, &opts.listen, "", None);
    tracing::info!(listen = %opts.listen, "fault-tolerance standby: waiting for the primary");
    let (stream, peer) = listener.accept().map_err(io)?;
    drop(listener);
    tracing::info!(%peer, "fault-tolerance standby: primary connected");
    stream.set_nodelay(true).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io)?;
    let socket = stream.try_clone().map_err(io)?;
    let channel = Channel::accept(stream, &opts.key)?;
    let (mut reader, writer) = channel
        .split(|s| {
            Ok((
                BufReader::with_capacity(1 << 20, s.try_clone()?),
                BufWriter::with_capacity(64 << 10, s),
            ))
        })
        .map_err(io)?;
    let writer: Writer = Arc::new(Mutex::new(writer));
    let mut buf = Vec::new();

    let (mut config, memory_size, mode, heartbeat, timeout) = match reader.recv_json(&mut buf)? {
        FtMessage::Hello {
            config,
            memory_size,
            mode,
            heartbeat_ms,
            timeout_ms,
        } => (
            *config,
            memory_size,
            mode,
            Duration::from_millis(heartbeat_ms.clamp(1, 60_000)),
            Duration::from_millis(timeout_ms.clamp(10, 600_000)),
        ),
        other => return Err(FtError::Protocol(format!("expected Hello, got {other:?}"))),
    };
    let setup = (|| -> Result<Replica, FtError> {
        config
            .validate()
            .map_err(|e| FtError::Protocol(e.to_string()))?;
        if memory_size != config.memory_bytes {
            return Err(FtError::Protocol(
                "memory size does not match the configuration".into(),
            ));
        }
        adjust(&mut config);
        let memory = GuestMemoryFile::create(memory_size, &MemoryBacking::Memfd)
            .map_err(|e| FtError::Memory(e.to_string()))?;
        let prepared = Machine::prepare(memory.clone())?;
        Ok(Replica {
            config,
            memory,
            prepared,
            state: None,
            epoch: 0,
        })
    })();
    let mut replica = match setup {
        Ok(r) => r,
        Err(e) => {
            let _ = send(
                &writer,
                &FtMessage::Failed {
                    reason: e.to_string(),
                },
            );
            return Err(e);
        }
    };
    shared.begin("standby", FtState::Standby, &peer.to_string(), &mode, None);
    socket.set_read_timeout(Some(timeout)).map_err(io)?;
    socket.set_write_timeout(Some(timeout)).map_err(io)?;
    send(&writer, &FtMessage::Ready)?;

    let done = Arc::new(AtomicBool::new(false));
    {
        let (writer, done) = (writer.clone(), done.clone());
        std::thread::Builder::new()
            .name("ft-heartbeat".into())
            .spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    std::thread::sleep(heartbeat);
                    if send(&writer, &FtMessage::Heartbeat).is_err() {
                        return;
                    }
                }
            })
            .map_err(io)?;
    }
    let lost = follow(&mut reader, &writer, &mut replica, shared, &mut buf);
    done.store(true, Ordering::SeqCst);
    let detected = Instant::now();
    let why = match lost {
        Follow::Stopped(reason) => {
            tracing::info!(
                reason,
                "fault-tolerance standby: the primary ended protection"
            );
            shared.set_state(FtState::Unprotected);
            return Ok(StandbyOutcome::PrimaryStopped(reason));
        }
        Follow::Lost(why) => why,
        Follow::Broken(why) => {
            shared.set_state(FtState::Unprotected);
            shared.set_error(why.clone());
            let _ = socket.shutdown(std::net::Shutdown::Both);
            return Err(FtError::State(format!(
                "standby replica broken, it cannot take over: {why}"
            )));
        }
    };
    let _ = socket.shutdown(std::net::Shutdown::Both);
    shared.set_error(why.clone());
    failover(
        opts,
        replica,
        events,
        shared,
        &why,
        &peer.to_string(),
        detected,
        timeout,
    )
}

enum Follow {
    Stopped(String),
    Lost(String),
    /// The replica can no longer be trusted (an epoch half applied).
    Broken(String),
}

/// Receives epochs until the primary stops or is lost.
fn follow(
    reader: &mut Channel<BufReader<TcpStream>>,
    writer: &Writer,
    replica: &mut Replica,
    shared: &FtShared,
    buf: &mut Vec<u8>,
) -> Follow {
    let mut staged: Vec<Vec<u8>> = Vec::new();
    let mut staged_bytes = 0u64;
    loop {
        let kind = match reader.recv(buf) {
            Ok(k) => k,
            Err(WireError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Follow::Lost("no frame from the primary within its timeout".into())
            }
            Err(e) => return Follow::Lost(format!("sync link: {e}")),
        };
        match kind {
            // Epoch 0 (the frame's first word): the live pre-copy, applied at
            // once — only before the first complete epoch exists.
            Kind::Pages if buf.get(..4) == Some(&[0, 0, 0, 0]) => {
                if replica.state.is_some() {
                    return Follow::Lost("pre-copy pages after the first epoch".into());
                }
                shared.add_link_bytes(buf.len() as u64);
                if let Err(e) = apply_pages(&replica.memory, buf) {
                    return Follow::Lost(format!("bad pre-copy pages: {e}"));
                }
            }
            Kind::Pages => {
                staged_bytes += buf.len() as u64;
                staged.push(std::mem::take(buf));
            }
            Kind::State => return Follow::Lost("a state blob outside an epoch".into()),
            Kind::Control => {
                let msg: FtMessage = match serde_json::from_slice(buf) {
                    Ok(m) => m,
                    Err(e) => return Follow::Lost(format!("malformed message: {e}")),
                };
                match msg {
                    FtMessage::Heartbeat => {}
                    FtMessage::RoundEnd { round, pages } => {
                        tracing::debug!(round, pages, "fault-tolerance pre-copy round received");
                    }
                    FtMessage::Stop { reason } | FtMessage::Failed { reason } => {
                        return Follow::Stopped(reason)
                    }
                    FtMessage::EpochEnd {
                        epoch,
                        pages,
                        outputs,
                    } => {
                        let t = Instant::now();
                        if epoch != replica.epoch + 1 {
                            return Follow::Lost(format!(
                                "epoch {epoch} after epoch {}",
                                replica.epoch
                            ));
                        }
                        let packed_len = match reader.recv(buf) {
                            Ok(Kind::State) => buf.len(),
                            Ok(k) => {
                                return Follow::Lost(format!("{k:?} frame where the state was due"))
                            }
                            Err(e) => return Follow::Lost(format!("epoch {epoch} cut off: {e}")),
                        };
                        let previous = replica.state.as_deref().unwrap_or(&[]);
                        let state = match unpack_state(buf, previous) {
                            Ok(s) => s,
                            Err(e) => return Follow::Lost(format!("epoch {epoch} state: {e}")),
                        };
                        if let Err(e) = format::verify(&state) {
                            return Follow::Lost(format!("epoch {epoch} state: {e}"));
                        }
                        // Every page must land inside guest memory before the
                        // epoch is acknowledged: applying may then only fail
                        // on I/O.
                        let size = replica.memory.size();
                        for frame in &staged {
                            let check = decode_pages(frame, |pfn, _| {
                                pfn_offset(size, pfn).map(|_| ()).ok_or_else(|| {
                                    WireError::Malformed(format!(
                                        "page {pfn:#x} is outside guest memory"
                                    ))
                                })
                            });
                            if let Err(e) = check {
                                return Follow::Lost(format!("epoch {epoch} pages: {e}"));
                            }
                        }
                        // Complete: acknowledge, then apply.
                        let checked = t.elapsed();
                        let sent = send(writer, &FtMessage::Ack { epoch });
                        tracing::debug!(
                            epoch,
                            checked_us = checked.as_micros() as u64,
                            acked_us = t.elapsed().as_micros() as u64,
                            "epoch acknowledged"
                        );
                        if let Err(e) = sent {
                            // The primary will not release the outputs; the
                            // epoch is still the latest complete image.
                            tracing::warn!(error = %e, "cannot acknowledge epoch {epoch}");
                        }
                        let mut applied = 0u64;
                        for frame in staged.drain(..) {
                            match apply_pages(&replica.memory, &frame) {
                                Ok(n) => applied += n,
                                Err(e) => {
                                    return Follow::Broken(format!("epoch {epoch} pages: {e}"))
                                }
                            }
                        }
                        if applied != pages {
                            tracing::warn!(epoch, applied, pages, "epoch page count differs");
                        }
                        let bytes = staged_bytes + packed_len as u64;
                        staged_bytes = 0;
                        replica.state = Some(state);
                        replica.epoch = epoch;
                        shared.set_state(FtState::Standby);
                        shared.record_sync(
                            epoch,
                            pages,
                            bytes,
                            outputs,
                            Duration::ZERO,
                            t.elapsed(),
                        );
                    }
                    other => return Follow::Lost(format!("unexpected {other:?}")),
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn failover(
    opts: &StandbyOptions,
    replica: Replica,
    events: VmEventSink,
    shared: &FtShared,
    why: &str,
    peer: &str,
    detected: Instant,
    timeout: Duration,
) -> Result<StandbyOutcome, FtError> {
    let Some(state_bytes) = replica.state else {
        shared.set_state(FtState::Unprotected);
        return Err(FtError::State(format!(
            "primary lost ({why}) before the first complete epoch: nothing to run"
        )));
    };
    shared.set_state(FtState::FailingOver);
    tracing::warn!(
        reason = why,
        epoch = replica.epoch,
        "fault tolerance: primary lost, failing over"
    );
    let fence = match &opts.fence {
        Some(path) => match Fence::acquire(path, timeout) {
            Ok(f) => Some(f),
            Err(e) => {
                shared.set_state(FtState::Standby);
                shared.set_error(e.to_string());
                tracing::error!(error = %e, "not failing over: the primary still holds the fence (split brain averted)");
                return Err(e.into());
            }
        },
        None => None,
    };
    if let Some(cmd) = &opts.fence_cmd {
        if let Err(e) =
            super::fence::run_fence_command(cmd, peer, timeout.max(Duration::from_secs(10)))
        {
            shared.set_state(FtState::Standby);
            shared.set_error(e.to_string());
            tracing::error!(error = %e, "not failing over: the primary could not be fenced");
            return Err(e.into());
        }
    }
    let mut state = format::decode(&state_bytes).map_err(|e| FtError::Protocol(e.to_string()))?;
    state.config.serial = replica.config.serial.clone();
    state.config.nets = replica.config.nets.clone();
    state.config.disks = replica.config.disks.clone();
    state.config.memory_backing = MemoryBacking::Memfd;
    state.memory.backing = MemoryBacking::Memfd;
    let machine = Machine::restore_prepared(
        &state,
        replica.prepared,
        events,
        false,
        Arc::new(PassThroughGate),
        Vec::new(),
    )?;
    machine.announce_network();
    shared.failed_over(detected.elapsed());
    tracing::warn!(
        epoch = replica.epoch,
        failover_ms = detected.elapsed().as_millis() as u64,
        "fault tolerance: failed over, the VM runs here"
    );
    Ok(StandbyOutcome::FailedOver(machine, fence))
}
