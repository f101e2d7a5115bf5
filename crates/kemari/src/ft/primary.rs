//! The primary: initial synchronization, then one sync per batch of outputs
//! (or per period), through the [`FtGate`] installed in the device event loop.
//!
//! A sync: pause the vCPUs, harvest the pages dirtied since the last sync
//! (guest writes from the KVM dirty ring, VMM writes from its own queue), copy
//! them and save the whole VM state, **resume the vCPUs**, then send the epoch
//! and wait for the standby's acknowledgement before the outputs go. The guest
//! is paused only for the capture; the transfer overlaps with its execution,
//! while the outputs — the only thing the outside world can see — wait.

use std::io::BufWriter;
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::machine::{Machine, MachineCore, RunState};
use vmm::memory::GuestMemoryMmap;
use vmm::output::{OutputEvent, OutputGate, Release};
use vmm::persist::format;

use super::protocol::{pack_state, FtMessage};
use super::status::{FtShared, FtState};
use super::{FtError, SyncMode};
use crate::migration::tcp::{data_extents, offset_pfn};
use crate::migration::wire::{encode_pages, Channel, Kind, PageData, MAX_PAGES_PER_FRAME, PAGE};

/// What `kemarictl ft start` asks for.
#[derive(Debug, Clone)]
pub struct FtStartOptions {
    /// The standby's `host:port`.
    pub peer: String,
    /// Pre-shared key.
    pub key: Vec<u8>,
    /// Event-driven or periodic.
    pub mode: SyncMode,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// Peer lost after this long without a frame.
    pub timeout: Duration,
}

/// Pre-copy rounds before the first epoch (the guest runs during them).
const MAX_PRECOPY_ROUNDS: u32 = 5;
/// Few enough dirty pages to stop pre-copying and pause for the first epoch.
const PRECOPY_ENOUGH: usize = 512;

enum Incoming {
    Ready,
    Ack(u64),
    Failed(String),
    Lost(String),
}

/// The primary's end of the sync link.
struct Link {
    writer: Mutex<Channel<BufWriter<TcpStream>>>,
    incoming: Mutex<Receiver<Incoming>>,
    socket: TcpStream,
    closed: AtomicBool,
    last_sent: Mutex<Instant>,
    timeout: Duration,
}

impl Link {
    /// Connects and starts the reader and heartbeat threads; `on_lost` runs
    /// (on the reader thread) when the standby stops answering.
    fn connect(
        opts: &FtStartOptions,
        on_lost: Arc<OnceLock<Weak<FtGate>>>,
    ) -> Result<Arc<Link>, FtError> {
        let addr = opts
            .peer
            .to_socket_addrs()
            .map_err(|e| FtError::Protocol(format!("address {}: {e}", opts.peer)))?
            .next()
            .ok_or_else(|| {
                FtError::Protocol(format!("address {} resolves to nothing", opts.peer))
            })?;
        let io = |e: std::io::Error| FtError::Wire(e.into());
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(opts.timeout)).map_err(io)?;
        stream.set_write_timeout(Some(opts.timeout)).map_err(io)?;
        let socket = stream.try_clone().map_err(io)?;
        let channel = Channel::connect(stream, &opts.key)?;
        let (mut reader, writer) = channel
            .split(|s| Ok((s.try_clone()?, BufWriter::with_capacity(1 << 20, s))))
            .map_err(io)?;
        let (tx, rx) = channel_pair();
        let link = Arc::new(Link {
            writer: Mutex::new(writer),
            incoming: Mutex::new(rx),
            socket,
            closed: AtomicBool::new(false),
            last_sent: Mutex::new(Instant::now()),
            timeout: opts.timeout,
        });
        let timeout = opts.timeout;
        std::thread::Builder::new()
            .name("ft-reader".into())
            .spawn(move || {
                let why = read_loop(&mut reader, &tx, timeout);
                let _ = tx.send(Incoming::Lost(why.clone()));
                if let Some(gate) = on_lost.get().and_then(Weak::upgrade) {
                    gate.degrade(&why);
                }
            })
            .map_err(io)?;
        let beat = Arc::downgrade(&link);
        let every = opts.heartbeat;
        std::thread::Builder::new()
            .name("ft-heartbeat".into())
            .spawn(move || heartbeat_loop(&beat, every))
            .map_err(io)?;
        Ok(link)
    }

    fn send(
        &self,
        f: impl FnOnce(&mut Channel<BufWriter<TcpStream>>) -> Result<(), FtError>,
    ) -> Result<u64, FtError> {
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let before = w.bytes_sent;
        f(&mut w)?;
        w.flush()?;
        *self.last_sent.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        Ok(w.bytes_sent - before)
    }

    fn send_json(&self, msg: &FtMessage) -> Result<u64, FtError> {
        self.send(|w| Ok(w.send_json(msg)?))
    }

    /// Waits for the standby's answer `want` picks, up to the timeout.
    fn wait<T>(&self, what: &str, want: impl Fn(&Incoming) -> Option<T>) -> Result<T, FtError> {
        let rx = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = match rx.recv_timeout(left) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(FtError::Protocol(format!(
                        "no {what} from the standby within {} ms",
                        self.timeout.as_millis()
                    )))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(FtError::Protocol("the sync link is closed".into()))
                }
            };
            if let Some(v) = want(&msg) {
                return Ok(v);
            }
            match msg {
                Incoming::Failed(reason) => return Err(FtError::Refused(reason)),
                Incoming::Lost(reason) => return Err(FtError::Protocol(reason)),
                _ => {}
            }
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.socket.shutdown(Shutdown::Both);
    }

    fn bytes(&self) -> u64 {
        let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        w.bytes_sent
    }
}

fn channel_pair() -> (Sender<Incoming>, Receiver<Incoming>) {
    channel()
}

/// Reads the standby's frames until the link fails; returns why.
fn read_loop(reader: &mut Channel<TcpStream>, tx: &Sender<Incoming>, timeout: Duration) -> String {
    let mut buf = Vec::new();
    loop {
        let msg: FtMessage = match reader.recv_json(&mut buf) {
            Ok(m) => m,
            Err(crate::migration::wire::WireError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return format!("no frame from the standby for {} ms", timeout.as_millis())
            }
            Err(e) => return format!("sync link: {e}"),
        };
        let sent = match msg {
            FtMessage::Ready => tx.send(Incoming::Ready),
            FtMessage::Ack { epoch } => tx.send(Incoming::Ack(epoch)),
            FtMessage::Failed { reason } => tx.send(Incoming::Failed(reason)),
            FtMessage::Heartbeat => Ok(()),
            other => return format!("unexpected message from the standby: {other:?}"),
        };
        if sent.is_err() {
            return "the primary stopped listening".into();
        }
    }
}

fn heartbeat_loop(link: &Weak<Link>, every: Duration) {
    loop {
        std::thread::sleep(every);
        let Some(link) = link.upgrade() else { return };
        if link.closed.load(Ordering::SeqCst) {
            return;
        }
        let idle = link
            .last_sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed();
        if idle >= every && link.send_json(&FtMessage::Heartbeat).is_err() {
            return;
        }
    }
}

/// Reads pages `pfns` from guest memory into page frames of epoch `epoch`
/// (zero pages as markers). Returns the frames.
fn page_frames(mem: &GuestMemoryMmap, pfns: &[u64], epoch: u64) -> Result<Vec<Vec<u8>>, FtError> {
    static ZERO: [u8; PAGE] = [0; PAGE];
    let mut frames = Vec::with_capacity(pfns.len().div_ceil(MAX_PAGES_PER_FRAME));
    let mut scratch = vec![0u8; MAX_PAGES_PER_FRAME * PAGE];
    for chunk in pfns.chunks(MAX_PAGES_PER_FRAME) {
        for (k, pfn) in chunk.iter().enumerate() {
            let addr = pfn
                .checked_mul(PAGE as u64)
                .ok_or_else(|| FtError::Memory(format!("page {pfn:#x}")))?;
            mem.read_slice(&mut scratch[k * PAGE..(k + 1) * PAGE], GuestAddress(addr))
                .map_err(|e| FtError::Memory(format!("page {pfn:#x}: {e}")))?;
        }
        let pages: Vec<(u64, PageData<'_>)> = chunk
            .iter()
            .enumerate()
            .map(|(k, &pfn)| {
                let data = &scratch[k * PAGE..(k + 1) * PAGE];
                (
                    pfn,
                    if data == ZERO {
                        PageData::Zero
                    } else {
                        PageData::Data(data)
                    },
                )
            })
            .collect();
        let mut frame = Vec::new();
        encode_pages(epoch as u32, &pages, &mut frame);
        frames.push(frame);
    }
    Ok(frames)
}

/// The output gate of a protected VM.
pub struct FtGate {
    core: Arc<MachineCore>,
    mode: SyncMode,
    link: Mutex<Option<Arc<Link>>>,
    epoch: AtomicU64,
    /// The last acknowledged epoch's state (the next one is sent as a delta).
    prev_state: Mutex<Vec<u8>>,
    shared: Arc<FtShared>,
}

impl std::fmt::Debug for FtGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FtGate")
            .field("mode", &self.mode)
            .field("epoch", &self.epoch.load(Ordering::SeqCst))
            .field("link", &self.current_link())
            .finish()
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("closed", &self.closed.load(Ordering::SeqCst))
            .finish()
    }
}

impl FtGate {
    fn current_link(&self) -> Option<Arc<Link>> {
        self.link.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Captures and sends one epoch (plus pages `extra` found dirty earlier),
    /// and waits for its acknowledgement.
    fn sync_epoch(
        &self,
        link: &Link,
        batch: &[OutputEvent],
        extra: Vec<u64>,
    ) -> Result<(), FtError> {
        let started = Instant::now();
        let epoch = self.epoch.load(Ordering::SeqCst) + 1;
        self.core.pause_vcpus()?;
        let t_paused = started.elapsed();
        let captured = (|| -> Result<_, FtError> {
            let mut pfns = self.core.harvest_dirty_paused()?;
            let t_harvest = started.elapsed();
            if !extra.is_empty() {
                pfns.extend(extra);
                pfns.sort_unstable();
                pfns.dedup();
            }
            let frames = page_frames(self.core.guest_memory(), &pfns, epoch)?;
            let t_pages = started.elapsed();
            let state = self.core.save_state()?;
            tracing::debug!(
                epoch,
                pages = pfns.len(),
                paused_us = t_paused.as_micros() as u64,
                harvested_us = t_harvest.as_micros() as u64,
                copied_us = t_pages.as_micros() as u64,
                saved_us = started.elapsed().as_micros() as u64,
                "sync capture"
            );
            Ok((pfns.len() as u64, frames, state))
        })();
        let resumed = self.core.resume_vcpus();
        let pause = started.elapsed();
        let (pages, frames, state) = captured?;
        resumed?;
        // Encoding needs no paused guest.
        let state = format::encode(&state).map_err(|e| FtError::Protocol(e.to_string()))?;
        let packed = {
            let prev = self.prev_state.lock().unwrap_or_else(|p| p.into_inner());
            pack_state(&state, &prev)
        };
        let outputs: u64 = batch.iter().map(|e| u64::from(e.requests)).sum();
        let bytes = link.send(|w| {
            for f in &frames {
                w.send(Kind::Pages, f)?;
            }
            w.send_json(&FtMessage::EpochEnd {
                epoch,
                pages,
                outputs,
            })?;
            w.send(Kind::Blob, &packed)?;
            Ok(())
        })?;
        link.wait("acknowledgement", |m| match m {
            Incoming::Ack(e) if *e == epoch => Some(()),
            _ => None,
        })?;
        self.epoch.store(epoch, Ordering::SeqCst);
        *self.prev_state.lock().unwrap_or_else(|p| p.into_inner()) = state;
        self.shared
            .record_sync(epoch, pages, bytes, outputs, pause, started.elapsed());
        Ok(())
    }

    fn sync(&self, batch: &[OutputEvent]) {
        let Some(link) = self.current_link() else {
            return;
        };
        if let Err(e) = self.sync_epoch(&link, batch, Vec::new()) {
            self.degrade(&e.to_string());
        }
    }

    /// The standby is lost: run on unprotected (outputs pass at once).
    pub fn degrade(&self, why: &str) {
        let link = self.link.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(link) = link {
            link.close();
            tracing::warn!(
                reason = why,
                "fault tolerance: standby lost, running unprotected (degraded)"
            );
            self.shared.set_error(why);
            self.shared.set_state(FtState::Degraded);
            if let Err(e) = self.core.dirty_tracker().stop() {
                tracing::warn!(error = %e, "cannot stop dirty tracking");
            }
        }
    }

    /// Ends protection normally: the standby is told to exit.
    pub fn stop(&self, reason: &str) {
        let link = self.link.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(link) = link {
            let _ = link.send_json(&FtMessage::Stop {
                reason: reason.to_owned(),
            });
            link.close();
            let _ = self.core.dirty_tracker().stop();
        }
        self.shared.set_state(FtState::Unprotected);
        tracing::info!(reason, "fault tolerance stopped");
    }

    /// Whether outputs currently wait for the standby.
    pub fn is_protecting(&self) -> bool {
        self.current_link().is_some()
    }
}

impl OutputGate for FtGate {
    fn before_output(&self, batch: &[OutputEvent]) -> Release {
        match self.mode {
            SyncMode::Periodic(_) if self.is_protecting() => Release::AtCheckpoint,
            SyncMode::Periodic(_) => Release::Now,
            SyncMode::EventDriven => {
                self.sync(batch);
                Release::Now
            }
        }
    }

    fn checkpoint_interval(&self) -> Option<Duration> {
        match self.mode {
            SyncMode::Periodic(p) => Some(p),
            SyncMode::EventDriven => None,
        }
    }

    fn checkpoint(&self, batch: &[OutputEvent]) {
        self.sync(batch);
    }
}

/// Protects `machine` with the standby at `opts.peer`: live pre-copy while the
/// guest runs, then the first epoch with the machine paused, then the gate.
/// On failure nothing changes (the VM runs on unprotected) and the error says
/// why.
pub fn start(
    machine: &mut Machine,
    opts: &FtStartOptions,
    shared: &Arc<FtShared>,
) -> Result<Arc<FtGate>, FtError> {
    if matches!(shared.state(), FtState::Protected | FtState::Syncing) {
        return Err(FtError::State("the VM is already protected".into()));
    }
    let period = match opts.mode {
        SyncMode::Periodic(p) => Some(p),
        SyncMode::EventDriven => None,
    };
    shared.begin(
        "primary",
        FtState::Syncing,
        &opts.peer,
        opts.mode.name(),
        period,
    );
    let started = Instant::now();
    let was_running = machine.state() == RunState::Running;
    let on_lost = Arc::new(OnceLock::new());
    let result = Link::connect(opts, on_lost.clone()).and_then(|link| {
        let r = initial_sync(machine, opts, shared, &link, &on_lost);
        if r.is_err() {
            link.close();
        }
        r
    });
    match result {
        Ok(gate) => {
            shared.set_state(FtState::Protected);
            tracing::info!(
                peer = %opts.peer,
                mode = opts.mode.name(),
                initial_ms = started.elapsed().as_millis() as u64,
                "fault tolerance: protected"
            );
            Ok(gate)
        }
        Err(e) => {
            let _ = machine.stop_dirty_log();
            if was_running && machine.state() == RunState::Paused {
                // Paused by us for the first epoch.
                let _ = machine.resume();
            }
            shared.set_error(e.to_string());
            shared.set_state(FtState::Unprotected);
            tracing::warn!(error = %e, "fault tolerance could not start; the VM runs on unprotected");
            Err(e)
        }
    }
}

fn initial_sync(
    machine: &mut Machine,
    opts: &FtStartOptions,
    shared: &Arc<FtShared>,
    link: &Arc<Link>,
    on_lost: &OnceLock<Weak<FtGate>>,
) -> Result<Arc<FtGate>, FtError> {
    let started = Instant::now();
    // A VM started paused can be protected before it runs at all.
    let was_running = machine.state() == RunState::Running;
    let mem_size = machine.memory_file().size();
    link.send_json(&FtMessage::Hello {
        config: Box::new(machine.config().clone()),
        memory_size: mem_size,
        mode: opts.mode.name().into(),
        heartbeat_ms: opts.heartbeat.as_millis() as u64,
        timeout_ms: opts.timeout.as_millis() as u64,
    })?;
    // The standby creates memory and its VM first; allow for that.
    link.wait("Ready", |m| matches!(m, Incoming::Ready).then_some(()))?;
    machine.start_dirty_log()?;

    // Round 1: every page that ever held data, the guest running.
    let mut pfns = Vec::new();
    for (start, end) in data_extents(machine.memory_file().file(), mem_size) {
        let mut off = start & !(PAGE as u64 - 1);
        while off < end {
            pfns.extend(offset_pfn(mem_size, off));
            off += PAGE as u64;
        }
    }
    let mut sent_pages = 0u64;
    let mut send_round = |pfns: &[u64], round: u32| -> Result<(), FtError> {
        for chunk in pfns.chunks(16 * MAX_PAGES_PER_FRAME) {
            let frames = page_frames(machine.guest_memory(), chunk, 0)?;
            link.send(|w| {
                for f in &frames {
                    w.send(Kind::Pages, f)?;
                }
                Ok(())
            })?;
            sent_pages += chunk.len() as u64;
        }
        link.send_json(&FtMessage::RoundEnd {
            round,
            pages: sent_pages,
        })?;
        Ok(())
    };
    send_round(&pfns, 1)?;
    let mut carry = Vec::new();
    for round in 2..=MAX_PRECOPY_ROUNDS + 1 {
        let dirty = machine.harvest_dirty()?;
        if dirty.len() <= PRECOPY_ENOUGH || round > MAX_PRECOPY_ROUNDS {
            carry = dirty;
            break;
        }
        send_round(&dirty, round)?;
    }

    // The first epoch: the whole machine at rest.
    if was_running {
        machine.pause()?;
    }
    let gate = Arc::new(FtGate {
        core: machine.core(),
        mode: opts.mode,
        link: Mutex::new(Some(link.clone())),
        epoch: AtomicU64::new(0),
        prev_state: Mutex::new(Vec::new()),
        shared: shared.clone(),
    });
    let _ = on_lost.set(Arc::downgrade(&gate));
    gate.sync_epoch(link, &[], carry)?;
    machine.set_output_gate(gate.clone())?;
    if was_running {
        machine.resume()?;
    }
    shared.initial_sync_done(started.elapsed(), link.bytes());
    Ok(gate)
}
