//! The standby: receives the primary's synchronizations and runs the VM from
//! the last complete epoch when the primary is lost.
//!
//! It starts as any destination of a hand-over (the transfer layer's
//! `read_offer`, `Preparing`, `receive_rounds`): the offer, memory and the
//! KVM VM prepared, `Ready`, then the pre-copy rounds written into guest
//! memory at once — there is no complete image yet to protect. From the
//! first epoch on, an epoch's pages are staged in memory; only when its
//! state has arrived is the epoch acknowledged and then applied (pages
//! written, state replaced) — so guest memory plus the kept state always
//! form the last complete epoch, and an epoch the link cut off is
//! discarded.
//!
//! The primary is lost when no frame (heartbeats included) arrives within
//! its timeout, or the link fails. The standby then takes the fence (if
//! one is configured; see [`super::fence`]), restores the VM into the
//! memory and KVM VM it prepared at the start, announces the guest's MACs
//! and runs it.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm::config::MachineConfig;
use vmm::machine::Machine;
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::output::{FenceSlot, FencedGate, OutputGate, PassThroughGate};
use vmm::persist::format;
use vmm::vstate::VmEventSink;

use transfer::channel::{Auth, Channel};
use transfer::destination::{self, Arrival, Preparing};
use transfer::link::Duplex;
use transfer::message::{Kind, Message, Mode};
use transfer::pages::{check_batch, write_batch};
use transfer::{net, Peer, TransferError};

use super::epoch::unpack_state;
use super::fence::{Arbiter, HeldFence};
use super::status::{FtShared, FtState};
use super::FtError;

/// How the standby is set up (`kemari --ft-standby`).
#[derive(Debug)]
pub struct StandbyOptions {
    /// Address to listen on.
    pub listen: String,
    /// Pre-shared key.
    pub key: Vec<u8>,
    /// The fence to take before running the VM.
    pub fence: Option<Arbiter>,
    /// The STONITH-style command to run before running the VM.
    pub fence_cmd: Option<super::fence::FenceCommand>,
    /// An authenticated but unencrypted link (a trusted, dedicated one).
    pub plaintext: bool,
}

/// How standing by ended.
pub enum StandbyOutcome {
    /// The primary was lost: the VM runs here now (holding the fence, if
    /// any; its outputs already wait for it).
    FailedOver(Machine, Option<HeldFence>),
    /// The primary ended protection normally.
    PrimaryStopped(String),
}

type Writer = Arc<Mutex<Channel<BufWriter<TcpStream>>>>;

/// The standby's end of the link: a reader it alone uses, a writer shared
/// with its heartbeat thread.
struct StandbyLink {
    reader: Channel<BufReader<TcpStream>>,
    writer: Writer,
}

impl Duplex for StandbyLink {
    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<Kind, TransferError> {
        self.reader.recv(buf)
    }

    fn send_msg(&mut self, msg: &Message) -> Result<(), TransferError> {
        send(&self.writer, msg)
    }

    fn take_fds(&mut self) -> Vec<File> {
        Vec::new()
    }

    fn peer(&self) -> Peer {
        Peer::Primary
    }

    fn set_phase(&mut self, phase: &'static str) {
        self.reader.set_phase(phase);
    }

    fn phase(&self) -> String {
        self.reader.phase().to_owned()
    }
}

fn send(writer: &Writer, msg: &Message) -> Result<(), TransferError> {
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    w.send_msg(msg)?;
    w.flush()
}

/// What the standby has of the VM.
struct Replica {
    memory: GuestMemoryFile,
    preparing: Preparing,
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
    adjust: &mut dyn FnMut(&mut MachineConfig),
    shared: &Arc<FtShared>,
) -> Result<StandbyOutcome, FtError> {
    shared.begin("standby", FtState::Standby, &opts.listen, "", None);
    let listener = net::listen(&opts.listen)?;
    let tuning = net::Tuning {
        receive_buffer: None,
        read_timeout: Some(Duration::from_secs(30)),
    };
    let (channel, peer) = net::accept_authenticated(
        &listener,
        &opts.listen,
        Peer::Primary,
        Auth::psk(&opts.key, opts.plaintext),
        tuning,
        net::HANDSHAKE_TIMEOUT,
    )?;
    drop(listener);
    let io = |e| TransferError::io(Peer::Primary, "setting up the sync link", None, e);
    let socket = channel.stream().try_clone().map_err(io)?;
    let (reader, writer) = channel.split(|s| {
        Ok((
            BufReader::with_capacity(1 << 20, s.try_clone()?),
            BufWriter::with_capacity(64 << 10, s),
        ))
    })?;
    let mut link = StandbyLink {
        reader,
        writer: Arc::new(Mutex::new(writer)),
    };
    let mut buf = Vec::new();
    let setup = (|| -> Result<_, FtError> {
        let offered = destination::read_offer(&mut link, &mut buf)?;
        let (sync, heartbeat, timeout) = match &offered.mode {
            Mode::FaultTolerance {
                sync,
                heartbeat_ms,
                timeout_ms,
            } => (
                sync.clone(),
                Duration::from_millis((*heartbeat_ms).clamp(1, 60_000)),
                Duration::from_millis((*timeout_ms).clamp(10, 600_000)),
            ),
            other => {
                return Err(TransferError::Mismatch(format!(
                    "this kemari is a fault-tolerance standby, the other end offers a {}",
                    other.name()
                ))
                .into())
            }
        };
        offered.check(
            Mode::FaultTolerance {
                sync: String::new(),
                heartbeat_ms: 0,
                timeout_ms: 0,
            }
            .name(),
        )?;
        let memory = GuestMemoryFile::create(offered.memory_size, &MemoryBacking::Memfd)
            .map_err(|e| TransferError::Memory(e.to_string()))?;
        // Built while the pre-copy arrives; ready for a failover.
        let preparing = Preparing::in_thread(memory.clone(), offered.config.vcpus, false)?;
        Ok((
            Replica {
                memory,
                preparing,
                state: None,
                epoch: 0,
            },
            sync,
            heartbeat,
            timeout,
        ))
    })();
    let (mut replica, sync, heartbeat, timeout) = match setup {
        Ok(r) => r,
        Err(e) => {
            let _ = link.send_msg(&Message::Failed {
                reason: e.to_string(),
            });
            return Err(e);
        }
    };
    shared.begin("standby", FtState::Standby, &peer.to_string(), &sync, None);
    socket.set_read_timeout(Some(timeout)).map_err(io)?;
    socket.set_write_timeout(Some(timeout)).map_err(io)?;
    link.reader.note_timeout(Some(timeout));
    link.send_msg(&Message::Ready)?;

    let done = Arc::new(AtomicBool::new(false));
    {
        let (writer, done) = (link.writer.clone(), done.clone());
        std::thread::Builder::new()
            .name("ft-heartbeat".into())
            .spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    std::thread::sleep(heartbeat);
                    if send(&writer, &Message::Heartbeat).is_err() {
                        return;
                    }
                }
            })
            .map_err(io)?;
    }
    let lost = match destination::receive_rounds(
        &mut link,
        &replica.memory,
        &mut replica.preparing,
        &mut buf,
    ) {
        Ok(first) => {
            // The initial copy counts in the link's bytes.
            shared.add_link_bytes(link.reader.bytes_received);
            follow(first, &mut link, &mut replica, shared, &mut buf)
        }
        Err(TransferError::Refused { reason, .. }) => Follow::Stopped(reason),
        Err(e) => Follow::Lost(e.to_string()),
    };
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
        adjust,
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

/// Receives epochs, the first of which began with `first`, until the
/// primary stops or is lost.
fn follow(
    first: Arrival,
    link: &mut StandbyLink,
    replica: &mut Replica,
    shared: &FtShared,
    buf: &mut Vec<u8>,
) -> Follow {
    let mut staged: Vec<Vec<u8>> = Vec::new();
    let mut staged_bytes = 0u64;
    let mut next = Some(first);
    loop {
        let arrival = match next.take() {
            Some(a) => a,
            None => match link.recv(buf) {
                Ok(Kind::EpochPages) => Arrival::EpochPages(std::mem::take(buf)),
                Ok(Kind::Control) => match link.decode(buf) {
                    Ok(m) => Arrival::Message(m),
                    Err(e) => return Follow::Lost(e.to_string()),
                },
                Ok(k) => return Follow::Lost(format!("a {k:?} frame outside an epoch")),
                Err(TransferError::Timeout { .. }) => {
                    return Follow::Lost("no frame from the primary within its timeout".into())
                }
                Err(e) => return Follow::Lost(format!("sync link: {e}")),
            },
        };
        let msg = match arrival {
            Arrival::EpochPages(frame) => {
                staged_bytes += frame.len() as u64;
                staged.push(frame);
                continue;
            }
            Arrival::Message(m) => m,
            Arrival::State(_) | Arrival::StateSaved(_) => {
                return Follow::Lost("a state outside an epoch".into())
            }
        };
        match msg {
            Message::Heartbeat => {}
            Message::Stop { reason } | Message::Failed { reason } => {
                return Follow::Stopped(reason)
            }
            Message::EpochEnd {
                epoch,
                pages,
                outputs,
            } => {
                let t = Instant::now();
                if epoch != replica.epoch + 1 {
                    return Follow::Lost(format!("epoch {epoch} after epoch {}", replica.epoch));
                }
                let packed_len = match link.recv(buf) {
                    Ok(Kind::State) => buf.len(),
                    Ok(k) => return Follow::Lost(format!("{k:?} frame where the state was due")),
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
                // Every page must land inside guest memory before the epoch
                // is acknowledged: applying may then only fail on I/O.
                let size = replica.memory.size();
                for frame in &staged {
                    if let Err(e) = check_batch(size, frame) {
                        return Follow::Lost(format!("epoch {epoch} pages: {e}"));
                    }
                }
                // Complete: acknowledge, then apply.
                let checked = t.elapsed();
                let sent = link.send_msg(&Message::Ack { epoch });
                tracing::debug!(
                    epoch,
                    checked_us = checked.as_micros() as u64,
                    acked_us = t.elapsed().as_micros() as u64,
                    "epoch acknowledged"
                );
                if let Err(e) = sent {
                    // The primary will not release the outputs; the epoch
                    // is still the latest complete image.
                    tracing::warn!(error = %e, "cannot acknowledge epoch {epoch}");
                }
                let mut applied = 0u64;
                for frame in staged.drain(..) {
                    match write_batch(replica.memory.file(), size, &frame) {
                        Ok(n) => applied += n,
                        Err(e) => return Follow::Broken(format!("epoch {epoch} pages: {e}")),
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
                shared.record_sync(epoch, pages, bytes, outputs, Duration::ZERO, t.elapsed());
            }
            other => return Follow::Lost(format!("unexpected {}", other.name())),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn failover(
    opts: &StandbyOptions,
    replica: Replica,
    events: VmEventSink,
    adjust: &mut dyn FnMut(&mut MachineConfig),
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
        Some(arbiter) => match arbiter.acquire_to_fail_over(timeout) {
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
        if let Err(e) = cmd.run(peer, timeout.max(Duration::from_secs(10))) {
            shared.set_state(FtState::Standby);
            shared.set_error(e.to_string());
            tracing::error!(error = %e, "not failing over: the primary could not be fenced");
            return Err(e.into());
        }
    }
    let mut state = format::decode(&state_bytes).map_err(|e| {
        FtError::State(format!(
            "the last complete epoch's state does not decode: {e}"
        ))
    })?;
    adjust(&mut state.config);
    state.config.memory_backing = MemoryBacking::Memfd;
    state.memory.backing = MemoryBacking::Memfd;
    let prepared = replica.preparing.take()?;
    // A lease's outputs wait for it from the VM's first instruction here.
    let output_fence = fence.as_ref().and_then(HeldFence::output_fence);
    let gate: Arc<dyn OutputGate> = match &output_fence {
        Some(f) => FencedGate::wrap(
            Arc::new(FenceSlot::with(f.clone())),
            Arc::new(PassThroughGate),
        ),
        None => Arc::new(PassThroughGate),
    };
    let machine = Machine::restore_prepared(&state, prepared, events, false, gate, Vec::new())?;
    if let Some(f) = output_fence {
        machine.fence_outputs(f);
    }
    machine.announce_network();
    shared.failed_over(detected.elapsed());
    tracing::warn!(
        epoch = replica.epoch,
        failover_ms = detected.elapsed().as_millis() as u64,
        "fault tolerance: failed over, the VM runs here"
    );
    Ok(StandbyOutcome::FailedOver(machine, fence))
}
