//! The primary: initial synchronization, then one sync per batch of outputs
//! (or per period), through the [`FtGate`] installed in the device event loop.
//!
//! A sync: pause the vCPUs, harvest the pages dirtied since the last sync
//! (guest writes from the KVM dirty ring, VMM writes from its own queue), copy
//! them and save the whole VM state, **resume the vCPUs**, then send the epoch
//! and wait for the standby's acknowledgement before the outputs go. The guest
//! is paused only for the capture; the transfer overlaps with its execution,
//! while the outputs — the only thing the outside world can see — wait.

use std::io::{BufReader, BufWriter};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::machine::{Machine, MachineCore, PauseLength, RunState};
use vmm::memory::GuestMemoryMmap;
use vmm::output::{OutputEvent, OutputGate, Release};
use vmm::persist::format;

use super::protocol::{pack_state, FtMessage};
use super::status::{FtShared, FtState};
use super::{FtError, SyncMode};
use crate::migration::tcp::{data_extents, offset_pfn};
use crate::migration::wire::{Channel, Kind, PageFrame, WireError, MAX_PAGES_PER_FRAME, PAGE};

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
    /// Pages the guest rewrites from sync to sync left writable, at most.
    pub keep_writable: usize,
}

/// Pre-copy rounds before the first epoch (the guest runs during them).
const MAX_PRECOPY_ROUNDS: u32 = 5;
/// Few enough dirty pages to stop pre-copying and pause for the first epoch.
const PRECOPY_ENOUGH: usize = 512;

/// The primary's end of the sync link. No thread sits in a read: whoever
/// waits for an answer (the sync on the device event loop, the initial
/// synchronization) reads the socket itself — an acknowledgement costs no
/// extra thread wake-up — and the heartbeat thread drains what arrived while
/// nobody waited, which is how a silent standby is noticed between syncs.
struct Link {
    writer: Mutex<Channel<BufWriter<TcpStream>>>,
    reader: Mutex<(Channel<BufReader<TcpStream>>, Vec<u8>)>,
    socket: TcpStream,
    closed: AtomicBool,
    last_sent: Mutex<Instant>,
    last_heard: Mutex<Instant>,
    /// Answers read so far, by whichever thread read them.
    ready: AtomicBool,
    acked: AtomicU64,
    timeout: Duration,
}

impl Link {
    /// Connects and starts the heartbeat thread; `on_lost` is told when the
    /// standby stops answering while no sync waits for it.
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
        let (reader, writer) = channel
            .split(|s| {
                Ok((
                    BufReader::with_capacity(64 << 10, s.try_clone()?),
                    BufWriter::with_capacity(1 << 20, s),
                ))
            })
            .map_err(io)?;
        let link = Arc::new(Link {
            writer: Mutex::new(writer),
            reader: Mutex::new((reader, Vec::new())),
            socket,
            closed: AtomicBool::new(false),
            last_sent: Mutex::new(Instant::now()),
            last_heard: Mutex::new(Instant::now()),
            ready: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            timeout: opts.timeout,
        });
        let beat = Arc::downgrade(&link);
        let every = opts.heartbeat;
        std::thread::Builder::new()
            .name("ft-heartbeat".into())
            .spawn(move || heartbeat_loop(&beat, every, &on_lost))
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

    /// Reads one frame (the lock is held); heartbeats only refresh
    /// `last_heard`.
    fn read_one(
        &self,
        reader: &mut (Channel<BufReader<TcpStream>>, Vec<u8>),
    ) -> Result<(), FtError> {
        let (ch, buf) = reader;
        let msg: FtMessage = match ch.recv_json(buf) {
            Ok(m) => m,
            Err(WireError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(FtError::Protocol(format!(
                    "no frame from the standby for {} ms",
                    self.timeout.as_millis()
                )))
            }
            Err(e) => return Err(e.into()),
        };
        *self.last_heard.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        match msg {
            FtMessage::Ready => {
                self.ready.store(true, Ordering::SeqCst);
                Ok(())
            }
            FtMessage::Ack { epoch } => {
                self.acked.fetch_max(epoch, Ordering::SeqCst);
                Ok(())
            }
            FtMessage::Heartbeat => Ok(()),
            FtMessage::Failed { reason } => Err(FtError::Refused(reason)),
            other => Err(FtError::Protocol(format!(
                "unexpected message from the standby: {other:?}"
            ))),
        }
    }

    /// Waits until the standby's answers satisfy `done`, up to the timeout
    /// (answers the heartbeat thread read meanwhile count too).
    fn wait(&self, what: &str, done: impl Fn(&Link) -> bool) -> Result<(), FtError> {
        let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + self.timeout;
        loop {
            if done(self) {
                return Ok(());
            }
            if self.closed.load(Ordering::SeqCst) {
                return Err(FtError::Protocol("the sync link is closed".into()));
            }
            self.read_one(&mut reader)?;
            if Instant::now() >= deadline {
                return Err(FtError::Protocol(format!(
                    "no {what} from the standby within {} ms",
                    self.timeout.as_millis()
                )));
            }
        }
    }

    /// Reads whatever complete frames wait, without blocking for more
    /// (unless a sync is reading: then it hears the standby itself).
    fn drain(&self) -> Result<(), FtError> {
        let Ok(mut reader) = self.reader.try_lock() else {
            return Ok(());
        };
        while !reader.0.stream().buffer().is_empty() || bytes_waiting(&self.socket) > 0 {
            self.read_one(&mut reader)?;
        }
        Ok(())
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

/// Bytes readable on `socket` right now.
fn bytes_waiting(socket: &TcpStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int to the pointer we pass, which points to
    // a live local.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 {
        0
    } else {
        n.max(0) as usize
    }
}

/// Sends heartbeats when the link is idle and notices a standby that went
/// silent between syncs.
fn heartbeat_loop(link: &Weak<Link>, every: Duration, on_lost: &OnceLock<Weak<FtGate>>) {
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
        let mut lost = None;
        if idle >= every {
            if let Err(e) = link.send_json(&FtMessage::Heartbeat) {
                lost = Some(e.to_string());
            }
        }
        if lost.is_none() {
            if let Err(e) = link.drain() {
                lost = Some(e.to_string());
            }
        }
        let silent = link
            .last_heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed();
        if lost.is_none() && silent > link.timeout && link.reader.try_lock().is_ok() {
            lost = Some(format!(
                "no frame from the standby for {} ms",
                silent.as_millis()
            ));
        }
        if let Some(why) = lost {
            match on_lost.get().and_then(Weak::upgrade) {
                Some(gate) => gate.degrade(&why),
                // Still in the initial synchronization: it fails by itself.
                None => link.close(),
            }
            return;
        }
    }
}

/// Reads pages `pfns` from guest memory into the frames of `pool` (grown as
/// needed, reused from sync to sync: no allocation and no page faults on the
/// guest's pause path), zero pages as markers, each page copied once,
/// straight into its frame. Returns how many frames of `pool` hold pages.
fn fill_frames(
    mem: &GuestMemoryMmap,
    pfns: &[u64],
    pool: &mut Vec<PageFrame>,
) -> Result<usize, FtError> {
    let mut used = 0;
    for chunk in pfns.chunks(MAX_PAGES_PER_FRAME) {
        if pool.len() == used {
            pool.push(PageFrame::new());
        }
        let frame = &mut pool[used];
        frame.clear();
        for &pfn in chunk {
            frame.push_with(pfn, false, |data| read_page(mem, pfn, data))?;
        }
        used += 1;
    }
    Ok(used)
}

/// Reads guest page `pfn` into `buf` (one page long).
fn read_page(mem: &GuestMemoryMmap, pfn: u64, buf: &mut [u8]) -> Result<(), FtError> {
    let addr = pfn
        .checked_mul(PAGE as u64)
        .ok_or_else(|| FtError::Memory(format!("page {pfn:#x}")))?;
    mem.read_slice(buf, GuestAddress(addr))
        .map_err(|e| FtError::Memory(format!("page {pfn:#x}: {e}")))
}

/// A kept page unchanged for this many syncs in a row is cold.
const COLD_SYNCS: u32 = 8;
/// The writable set is reset once this many kept pages are cold.
const COLD_RESET: usize = 8;

/// The contents the standby holds of the pages left writable (the last
/// contents sent), so that a carried page is sent only if it changed.
#[derive(Default)]
struct KeptPages {
    /// Each page's last contents sent, and for how many syncs in a row it
    /// has not changed.
    copies: std::collections::HashMap<u64, (Box<[u8; PAGE]>, u32)>,
    /// Buffers of dropped copies, reused (no allocation in the pause).
    spare: Vec<Box<[u8; PAGE]>>,
    scratch: Vec<u8>,
    keep: std::collections::HashSet<u64>,
    sent: std::collections::HashSet<u64>,
    gone: Vec<u64>,
}

impl KeptPages {
    /// The pages of `carried` whose contents differ from the copy (or that
    /// have none).
    fn changed(&mut self, mem: &GuestMemoryMmap, carried: &[u64]) -> Result<Vec<u64>, FtError> {
        self.scratch.resize(PAGE, 0);
        let mut out = Vec::new();
        for &pfn in carried {
            read_page(mem, pfn, &mut self.scratch)?;
            match self.copies.get_mut(&pfn) {
                Some((copy, same)) if copy[..] == self.scratch[..] => *same += 1,
                _ => out.push(pfn),
            }
        }
        Ok(out)
    }

    /// How many kept pages have not changed for [`COLD_SYNCS`] syncs.
    fn cold(&self) -> usize {
        self.copies
            .values()
            .filter(|(_, same)| *same >= COLD_SYNCS)
            .count()
    }

    /// After a sync that sent `sent`: keeps a copy of each page of `kept`
    /// (taken again if it was sent), drops the others.
    fn refresh(
        &mut self,
        mem: &GuestMemoryMmap,
        kept: &[u64],
        sent: &[u64],
    ) -> Result<(), FtError> {
        if kept.is_empty() {
            self.spare.extend(self.copies.drain().map(|(_, (b, _))| b));
            return Ok(());
        }
        // Reused sets: no allocation in the guest's pause once warm.
        self.keep.clear();
        self.keep.extend(kept.iter().copied());
        self.gone.clear();
        self.gone.extend(
            self.copies
                .keys()
                .filter(|p| !self.keep.contains(p))
                .copied(),
        );
        for pfn in self.gone.drain(..) {
            if let Some((b, _)) = self.copies.remove(&pfn) {
                self.spare.push(b);
            }
        }
        self.sent.clear();
        self.sent.extend(sent.iter().copied());
        for &pfn in kept {
            if self.copies.contains_key(&pfn) && !self.sent.contains(&pfn) {
                continue;
            }
            let mut buf = self
                .copies
                .remove(&pfn)
                .map(|(b, _)| b)
                .or_else(|| self.spare.pop())
                .unwrap_or_else(|| Box::new([0; PAGE]));
            read_page(mem, pfn, &mut buf[..])?;
            self.copies.insert(pfn, (buf, 0));
        }
        Ok(())
    }
}

/// The output gate of a protected VM.
pub struct FtGate {
    core: Arc<MachineCore>,
    mode: SyncMode,
    link: Mutex<Option<Arc<Link>>>,
    epoch: AtomicU64,
    /// The last acknowledged epoch's state (the next one is sent as a delta).
    prev_state: Mutex<Vec<u8>>,
    /// Page frames reused by every sync.
    frames: Mutex<Vec<PageFrame>>,
    /// Keep the vCPUs paused until the standby acknowledged (the paper's
    /// way) instead of resuming them once the epoch is captured.
    hold_vcpus: bool,
    /// Pages the guest rewrites from sync to sync are left writable (so it
    /// takes no write-protection fault on them), up to this many (see
    /// `DirtyTracker::harvest_paused_keep_writable`). Each costs a 4 KiB
    /// comparison per sync, and is sent only when it changed.
    keep_writable: usize,
    /// The standby's copy of the pages left writable.
    kept: Mutex<KeptPages>,
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
        let mut pool = self.frames.lock().unwrap_or_else(|p| p.into_inner());
        // Each vCPU saves its own state as soon as it has stopped.
        let vcpus = self.core.pause_and_save_vcpus(PauseLength::Brief);
        let t_paused = started.elapsed();
        let captured = (|| -> Result<_, FtError> {
            let vcpus = vcpus?;
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            // Pages that stopped changing are re-protected (all pages are: a
            // reset cannot choose), so the writable set follows what the
            // guest rewrites now.
            let max_writable = if kept.cold() >= COLD_RESET {
                0
            } else {
                self.keep_writable
            };
            let harvest = self.core.harvest_dirty_paused_keep_writable(max_writable)?;
            let t_harvest = started.elapsed();
            let mem = self.core.guest_memory();
            let mut pfns = harvest.dirty;
            let carried = harvest.carried.len();
            let changed = kept.changed(mem, &harvest.carried)?;
            let kept_stats = (harvest.kept.len() as u64, (carried - changed.len()) as u64);
            pfns.extend(changed);
            if !extra.is_empty() {
                pfns.extend(extra);
                pfns.sort_unstable();
                pfns.dedup();
            }
            let frames = fill_frames(mem, &pfns, &mut pool)?;
            kept.refresh(mem, &harvest.kept, &pfns)?;
            let t_pages = started.elapsed();
            let state = self.core.state_with_vcpus(vcpus)?;
            tracing::debug!(
                epoch,
                pages = pfns.len(),
                carried,
                kept = harvest.kept.len(),
                paused_us = t_paused.as_micros() as u64,
                harvested_us = t_harvest.as_micros() as u64,
                copied_us = t_pages.as_micros() as u64,
                saved_us = started.elapsed().as_micros() as u64,
                "sync capture"
            );
            Ok((pfns.len() as u64, frames, state, kept_stats))
        })();
        let hold = self.hold_vcpus && captured.is_ok();
        let resumed = if hold {
            Ok(())
        } else {
            self.core.resume_vcpus()
        };
        let pause = started.elapsed();
        let (pages, frames, state, (kept, skipped)) = captured?;
        resumed?;
        self.shared.record_kept(kept, skipped);
        let result = self.send_epoch(
            link,
            epoch,
            batch,
            pages,
            &mut pool[..frames],
            state,
            started,
            pause,
        );
        if hold {
            self.core.resume_vcpus()?;
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn send_epoch(
        &self,
        link: &Link,
        epoch: u64,
        batch: &[OutputEvent],
        pages: u64,
        frames: &mut [PageFrame],
        state: vmm::persist::VmState,
        started: Instant,
        pause: Duration,
    ) -> Result<(), FtError> {
        let outputs: u64 = batch.iter().map(|e| u64::from(e.requests)).sum();
        // Encoding takes a few µs (binary state, LZ4 delta): the whole epoch
        // then goes out in one write, and the standby wakes once for it. One
        // writer lock for the whole epoch: no heartbeat may come between its
        // frames.
        let state = format::encode(&state).map_err(|e| FtError::Protocol(e.to_string()))?;
        let packed = {
            let prev = self.prev_state.lock().unwrap_or_else(|p| p.into_inner());
            pack_state(&state, &prev)
        };
        let packed_len = packed.len();
        let bytes = link.send(|w| {
            for f in frames.iter_mut() {
                w.send(Kind::Pages, f.payload(epoch as u32))?;
            }
            w.send_json(&FtMessage::EpochEnd {
                epoch,
                pages,
                outputs,
            })?;
            w.send(Kind::State, &packed)?;
            Ok(())
        })?;
        let t_sent = started.elapsed();
        link.wait("acknowledgement", |l| {
            l.acked.load(Ordering::SeqCst) >= epoch
        })?;
        tracing::debug!(
            epoch,
            pause_us = pause.as_micros() as u64,
            sent_us = t_sent.as_micros() as u64,
            acked_us = started.elapsed().as_micros() as u64,
            state_bytes = state.len(),
            packed_bytes = packed_len,
            "sync done"
        );
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
    link.wait("Ready", |l| l.ready.load(Ordering::SeqCst))?;
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
        let total = pfns.len() as u64;
        let mut done = 0u64;
        let mut pool = Vec::new();
        for chunk in pfns.chunks(16 * MAX_PAGES_PER_FRAME) {
            let frames = fill_frames(machine.guest_memory(), chunk, &mut pool)?;
            link.send(|w| {
                for f in pool[..frames].iter_mut() {
                    w.send(Kind::Pages, f.payload(0))?;
                }
                Ok(())
            })?;
            sent_pages += chunk.len() as u64;
            done += chunk.len() as u64;
            shared.initial_progress(round, done, total, link.bytes());
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
        frames: Mutex::new(Vec::new()),
        hold_vcpus: env_flag(std::env::var_os("KEMARI_FT_HOLD_VCPUS")),
        keep_writable: opts.keep_writable,
        kept: Mutex::new(KeptPages::default()),
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

/// A switch in the environment: on when set to anything but nothing, `0`,
/// `false`, `no` or `off` (`KEMARI_FT_HOLD_VCPUS=0` once switched it *on*).
fn env_flag(value: Option<std::ffi::OsString>) -> bool {
    value.is_some_and(|v| {
        !matches!(
            v.to_string_lossy().trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no" | "off"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::memory::{GuestMemoryFile, MemoryBacking};

    #[test]
    fn an_environment_switch_is_off_unless_set_to_something_true() {
        let f = |v: Option<&str>| env_flag(v.map(std::ffi::OsString::from));
        assert!(!f(None));
        for off in ["", "0", "false", "No", " off "] {
            assert!(!f(Some(off)), "{off:?}");
        }
        for on in ["1", "yes", "true"] {
            assert!(f(Some(on)), "{on:?}");
        }
    }

    fn page(mem: &GuestMemoryMmap, pfn: u64, byte: u8) {
        mem.write_slice(&[byte; PAGE], GuestAddress(pfn * PAGE as u64))
            .unwrap();
    }

    #[test]
    fn kept_pages_are_sent_only_when_they_changed() {
        let file = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd).unwrap();
        let mem = file.map().unwrap();
        let mut kept = KeptPages::default();
        // No copy yet: carried pages count as changed.
        assert_eq!(kept.changed(&mem, &[1, 2]).unwrap(), vec![1, 2]);
        page(&mem, 1, 0xaa);
        kept.refresh(&mem, &[1, 2], &[1, 2]).unwrap();
        // Unchanged: not sent; page 2 rewritten with other bytes: sent.
        assert!(kept.changed(&mem, &[1, 2]).unwrap().is_empty());
        page(&mem, 2, 0x55);
        assert_eq!(kept.changed(&mem, &[1, 2]).unwrap(), vec![2]);
        kept.refresh(&mem, &[1, 2], &[2]).unwrap();
        assert!(kept.changed(&mem, &[1, 2]).unwrap().is_empty());
        // The same bytes written again are no change (the standby has them).
        page(&mem, 1, 0xaa);
        assert!(kept.changed(&mem, &[1]).unwrap().is_empty());
        // A page no longer kept loses its copy; a reset (nothing kept)
        // drops every copy.
        kept.refresh(&mem, &[2], &[]).unwrap();
        assert_eq!(kept.changed(&mem, &[1]).unwrap(), vec![1]);
        kept.refresh(&mem, &[], &[]).unwrap();
        assert_eq!(kept.changed(&mem, &[2]).unwrap(), vec![2]);
        assert!(kept.copies.is_empty() && !kept.spare.is_empty());
    }

    #[test]
    fn pages_unchanged_for_several_syncs_are_cold() {
        let file = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd).unwrap();
        let mem = file.map().unwrap();
        let mut kept = KeptPages::default();
        let pages: Vec<u64> = (0..COLD_RESET as u64 + 1).collect();
        kept.refresh(&mem, &pages, &pages).unwrap();
        for sync in 0..COLD_SYNCS {
            assert_eq!(kept.cold(), 0, "sync {sync}");
            // Page 0 changes every time; the others never do.
            page(&mem, 0, sync as u8 + 1);
            let changed = kept.changed(&mem, &pages).unwrap();
            assert_eq!(changed, vec![0]);
            kept.refresh(&mem, &pages, &changed).unwrap();
        }
        assert_eq!(kept.cold(), COLD_RESET);
    }
}
