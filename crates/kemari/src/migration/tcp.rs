//! Pre-copy live migration over TCP (docs/migration-protocol.md).
//!
//! Source: send every non-zero page while the guest runs (round 1), then, round
//! after round, the pages dirtied meanwhile (the O(dirty) tracker: KVM's dirty
//! ring plus the VMM's own writes), each round acknowledged by the
//! destination, until the estimated downtime — remaining pages over the
//! bandwidth measured end to end over the whole transfer — is a millisecond,
//! or fits the limit and stops shrinking, or the round limit is hit; then
//! pause, send the last pages and the state, and commit once the destination
//! has restored. Until `Commit` the source owns the VM and resumes
//! it on any failure; the destination discards a partial VM.

use std::io::IoSlice;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use vm_memory::{Bytes, GuestAddress};
use vmm::config::MachineConfig;
use vmm::layout;
use vmm::machine::{Machine, MachineError, PreparedVm, RunState};
use vmm::memory::{GuestMemoryFile, GuestMemoryMmap, MemoryBacking};
use vmm::output::CommitGate;
use vmm::persist::format;
use vmm::vstate::VmEventSink;

use super::wire::{decode_pages, Channel, Control, Kind, PageFrame, WireError, PAGE};

/// Errors of a live migration.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The stream failed or was refused.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The peer gave up.
    #[error("the destination failed: {0}")]
    Refused(String),
    /// The peer sent something out of order.
    #[error("migration protocol: {0}")]
    Protocol(String),
    /// Cancelled through the API.
    #[error("migration cancelled")]
    Cancelled,
    /// The key file cannot be read or is too short.
    #[error("migration key {path}: {reason}")]
    Key {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The machine failed.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// Guest memory I/O.
    #[error("guest memory: {0}")]
    Memory(String),
}

/// Reads a pre-shared key (at least 16 bytes; surrounding whitespace ignored).
pub fn read_key(path: &Path) -> Result<Vec<u8>, MigrationError> {
    let err = |reason: String| MigrationError::Key {
        path: path.display().to_string(),
        reason,
    };
    let raw = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let key: Vec<u8> = raw.trim_ascii().to_vec();
    if key.len() < 16 {
        return Err(err("shorter than 16 bytes".into()));
    }
    Ok(key)
}

/// Tunables of the source.
#[derive(Debug, Clone, Copy)]
pub struct MigrationLimits {
    /// Pause the guest once the remaining pages are estimated to move within
    /// this time.
    pub max_downtime: Duration,
    /// Pause the guest after this many pre-copy rounds whatever remains.
    pub max_rounds: u32,
    /// Pause at once when the remaining pages are estimated to move within
    /// this time (capped at `max_downtime`): another round could not make
    /// the pause noticeably shorter.
    pub settle: Duration,
}

impl Default for MigrationLimits {
    fn default() -> Self {
        MigrationLimits {
            max_downtime: Duration::from_millis(300),
            max_rounds: 30,
            settle: Duration::from_millis(1),
        }
    }
}

/// Live progress, readable through the API while the migration runs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MigrationProgress {
    /// "idle", "running", "completed", "failed", "cancelled".
    pub status: String,
    /// Destination.
    pub to: String,
    /// Current round (1 = full copy).
    pub round: u32,
    /// Bytes sent so far (payload).
    pub bytes_sent: u64,
    /// Pages sent so far.
    pub pages_sent: u64,
    /// Bandwidth measured over the whole transfer so far, MB/s.
    pub rate_mb_s: f64,
    /// Pages dirtied per second since the harvest before the last one.
    pub dirty_pages_per_s: f64,
    /// Pages still to send (last harvest).
    pub remaining_pages: u64,
    /// Remaining pages over bandwidth, ms.
    pub estimated_downtime_ms: f64,
    /// Time since start, ms.
    pub elapsed_ms: u64,
    /// Final report: guest paused time as the source saw it (pause to
    /// `Commit`), ms.
    pub downtime_ms: Option<f64>,
    /// Final report: pause to the destination's `Running`, ms (None if it did
    /// not confirm).
    pub running_ms: Option<f64>,
    /// Final report: whole migration, ms.
    pub total_ms: Option<f64>,
    /// Why the last round was the last ("converged", "round limit").
    pub stop_reason: Option<String>,
    /// Failure reason.
    pub error: Option<String>,
}

/// Shared between the migrating main thread and the API thread.
#[derive(Debug, Default)]
pub struct MigrationShared {
    /// Progress.
    pub progress: Mutex<MigrationProgress>,
    /// Set to cancel.
    pub cancel: AtomicBool,
}

impl MigrationShared {
    fn update(&self, f: impl FnOnce(&mut MigrationProgress)) {
        f(&mut self.progress.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// A copy of the progress.
    pub fn snapshot(&self) -> MigrationProgress {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Offset in the memory file of guest-physical page `pfn`, if it is RAM.
pub(crate) fn pfn_offset(mem_size: u64, pfn: u64) -> Option<u64> {
    let gpa = pfn.checked_mul(PAGE as u64)?;
    layout::ram_ranges(mem_size)
        .into_iter()
        .find(|&(base, len, _)| gpa >= base && gpa - base < len)
        .map(|(base, _, off)| gpa - base + off)
}

/// Guest page number of memory-file offset `off`.
pub(crate) fn offset_pfn(mem_size: u64, off: u64) -> Option<u64> {
    layout::ram_ranges(mem_size)
        .into_iter()
        .find(|&(_, len, foff)| off >= foff && off - foff < len)
        .map(|(base, _, foff)| (base + off - foff) / PAGE as u64)
}

/// Writes a received frame's pages into the memory file: runs of pages at
/// consecutive file offsets go in one `pwritev` each. Writing the file (not
/// a mapping) allocates each new page without a page fault and without
/// zeroing it first, since it is fully overwritten.
struct PageWriter<'a> {
    file: &'a std::fs::File,
    ram: Vec<(u64, u64, u64)>,
    iov: Vec<IoSlice<'a>>,
    run_start: u64,
}

const ZERO_PAGE: [u8; PAGE] = [0; PAGE];

/// Most pages in one `pwritev` (the kernel takes at most 1024 buffers).
const MAX_RUN: usize = 1024;

impl<'a> PageWriter<'a> {
    fn new(file: &'a std::fs::File, mem_size: u64) -> Self {
        PageWriter {
            file,
            ram: layout::ram_ranges(mem_size),
            iov: Vec::with_capacity(MAX_RUN),
            run_start: 0,
        }
    }

    /// Offset in the memory file of page `pfn`, if it is guest RAM.
    fn offset(&self, pfn: u64) -> Option<u64> {
        let gpa = pfn.checked_mul(PAGE as u64)?;
        self.ram
            .iter()
            .find(|&&(base, len, _)| gpa >= base && gpa - base < len)
            .map(|&(base, _, off)| gpa - base + off)
    }

    /// Queues page `pfn` (`None`: zeros); a page outside guest RAM is
    /// refused.
    fn page(&mut self, pfn: u64, data: Option<&'a [u8]>) -> Result<(), WireError> {
        let off = self.offset(pfn).ok_or_else(|| {
            WireError::Malformed(format!("page {pfn:#x} is outside guest memory"))
        })?;
        let next = self.run_start + (self.iov.len() * PAGE) as u64;
        if !self.iov.is_empty() && (off != next || self.iov.len() == MAX_RUN) {
            self.flush()?;
        }
        if self.iov.is_empty() {
            self.run_start = off;
        }
        self.iov.push(IoSlice::new(data.unwrap_or(&ZERO_PAGE)));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), WireError> {
        let mut off = self.run_start;
        let mut bufs = &mut self.iov[..];
        while !bufs.is_empty() {
            // SAFETY: IoSlice is ABI-compatible with iovec; the buffers are
            // valid for their lengths for the call; the fd is ours.
            let n = unsafe {
                libc::pwritev(
                    self.file.as_raw_fd(),
                    bufs.as_ptr().cast(),
                    bufs.len() as libc::c_int,
                    off as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(WireError::Io(e));
            }
            if n == 0 {
                return Err(WireError::Io(std::io::ErrorKind::WriteZero.into()));
            }
            off += n as u64;
            IoSlice::advance_slices(&mut bufs, n as usize);
        }
        self.iov.clear();
        Ok(())
    }
}

/// Writes one `Pages` frame into the memory file.
pub(crate) fn write_frame(
    file: &std::fs::File,
    mem_size: u64,
    frame: &[u8],
) -> Result<(), WireError> {
    let mut w = PageWriter::new(file, mem_size);
    decode_pages(frame, |pfn, data| w.page(pfn, data))?;
    w.flush()
}

/// Socket buffer asked for on each end: several 1 MiB frames in flight, so
/// that neither end waits for the other to be scheduled after every few
/// hundred KiB (the kernel caps it at net.core.[rw]mem_max).
const SOCKET_BUFFER: libc::c_int = 4 << 20;

/// Sets `SO_SNDBUF` or `SO_RCVBUF`; a refusal only costs speed.
fn socket_buffer(stream: &TcpStream, option: libc::c_int) {
    let size = SOCKET_BUFFER;
    // SAFETY: setsockopt reads an int from a valid pointer for its size.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot size the socket buffer");
    }
}

/// Pages round 1 sends between two harvests of the dirty tracker (8 MiB).
const ROUND1_HARVEST_PAGES: usize = 2048;

/// The guest page ranges `[first, end)` behind the memory file's data
/// extents, ascending.
fn round1_ranges(extents: &[(u64, u64)], mem_size: u64) -> Vec<(u64, u64)> {
    let page = PAGE as u64;
    let mut out = Vec::new();
    for &(start, end) in extents {
        for (base, len, foff) in layout::ram_ranges(mem_size) {
            let (lo, hi) = (start.max(foff), end.min(foff + len));
            if lo < hi {
                let first = (base + lo - foff) / page;
                let last = (base + hi - foff).div_ceil(page);
                out.push((first, last));
            }
        }
    }
    out.sort_unstable();
    out
}

/// Whether round 1, now at page `cursor` (sent) of the ranges `ahead`, will
/// still send page `pfn`.
fn will_visit(ahead: &[(u64, u64)], cursor: u64, pfn: u64) -> bool {
    if pfn <= cursor {
        return false;
    }
    let i = ahead.partition_point(|&(_, end)| end <= pfn);
    ahead.get(i).is_some_and(|&(first, _)| first <= pfn)
}

/// Data extents of the memory file (never-touched memory is a hole).
pub(crate) fn data_extents(file: &std::fs::File, size: u64) -> Vec<(u64, u64)> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek only moves the fd's offset; errors are returned.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return vec![(0, size)];
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size as i64 } else { hole };
        out.push((data as u64, (end as u64).min(size)));
        pos = end;
    }
    out
}

/// Sends pages read straight from the guest's memory mapping into a frame
/// that is built in place (one copy per page, no allocation per page).
struct PageSender<'a> {
    memory: &'a GuestMemoryMmap,
    frame: PageFrame,
    pages: u64,
}

impl<'a> PageSender<'a> {
    fn new(memory: &'a GuestMemoryMmap) -> Self {
        PageSender {
            memory,
            frame: PageFrame::new(),
            pages: 0,
        }
    }

    /// Queues page `pfn`; `skip_zero` drops zero pages (the destination's
    /// fresh memory is zero) instead of sending a marker.
    fn page(
        &mut self,
        ch: &mut Channel<TcpStream>,
        round: u32,
        pfn: u64,
        skip_zero: bool,
    ) -> Result<(), MigrationError> {
        let memory = self.memory;
        let gpa = pfn
            .checked_mul(PAGE as u64)
            .ok_or_else(|| MigrationError::Memory(format!("page {pfn:#x} is not RAM")))?;
        // The guest may be writing this page right now: what is read here
        // is at least as new as the write that made it dirty, and any later
        // write is harvested and sent again.
        self.frame.push_with(pfn, skip_zero, |data| {
            memory
                .read_slice(data, GuestAddress(gpa))
                .map_err(|e| MigrationError::Memory(format!("page {pfn:#x}: {e}")))
        })?;
        if self.frame.is_full() {
            self.flush(ch, round)?;
        }
        Ok(())
    }

    fn flush(&mut self, ch: &mut Channel<TcpStream>, round: u32) -> Result<(), MigrationError> {
        if self.frame.count() == 0 {
            return Ok(());
        }
        let n = self.frame.count() as u64;
        ch.send(Kind::Pages, self.frame.payload(round))?;
        self.frame.clear();
        self.pages += n;
        Ok(())
    }

    /// [`flush`](Self::flush)es the pages queued and sends the frame
    /// `(kind, payload)` after them, with one write.
    fn flush_with(
        &mut self,
        ch: &mut Channel<TcpStream>,
        round: u32,
        kind: Kind,
        payload: &[u8],
    ) -> Result<(), MigrationError> {
        let n = self.frame.count() as u64;
        if n == 0 {
            ch.send(kind, payload)?;
            return Ok(());
        }
        ch.send_frames(&[(Kind::Pages, self.frame.payload(round)), (kind, payload)])?;
        self.frame.clear();
        self.pages += n;
        Ok(())
    }
}

/// When to pause the guest, decided after each harvest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    /// Send the dirty pages while the guest runs, then harvest again.
    Iterate,
    /// Pause now ("converged").
    Converged,
    /// Pause now ("round limit").
    RoundLimit,
}

/// The convergence rule (docs/migration-protocol.md): pause when the pages
/// still dirty would move within `settle` (so little that another round
/// cannot gain anything), or when they fit `max_downtime` and the last round
/// did not shrink the dirty set by a quarter (more rounds would not make the
/// pause shorter); otherwise iterate, up to the round limit.
fn decide(
    limits: &MigrationLimits,
    round: u32,
    estimate: Duration,
    remaining: u64,
    sent_last_round: u64,
) -> Decision {
    let settle = limits.settle.min(limits.max_downtime);
    let not_shrinking = remaining.saturating_mul(4) >= sent_last_round.saturating_mul(3);
    if estimate <= settle || (estimate <= limits.max_downtime && not_shrinking) {
        Decision::Converged
    } else if round >= limits.max_rounds {
        Decision::RoundLimit
    } else {
        Decision::Iterate
    }
}

/// Source side: live-migrates `machine` to `to`. On success the caller ends
/// without resuming; on failure the machine runs again (if it ran) and the
/// error says why.
pub fn migrate_out(
    machine: &mut Machine,
    to: &str,
    key: &[u8],
    limits: MigrationLimits,
    shared: &MigrationShared,
) -> Result<MigrationProgress, MigrationError> {
    let was_running = machine.state() == RunState::Running;
    shared.cancel.store(false, Ordering::SeqCst);
    shared.update(|p| {
        *p = MigrationProgress {
            status: "running".into(),
            to: to.into(),
            ..Default::default()
        }
    });
    let started = Instant::now();
    let result = migrate_out_inner(machine, to, key, limits, shared, started);
    // After a commit the VM never runs here again: its tracking ends with it
    // (stopping it is a memory-slot update, SRCU grace period included).
    if result.is_err() {
        let _ = machine.stop_dirty_log();
    }
    match &result {
        Ok(_) => shared.update(|p| p.status = "completed".into()),
        Err(e) => {
            if was_running && machine.state() == RunState::Paused {
                if let Err(re) = machine.resume() {
                    tracing::error!(error = %re, "cannot resume the VM after a failed migration");
                }
            }
            let status = if matches!(e, MigrationError::Cancelled) {
                "cancelled"
            } else {
                "failed"
            };
            tracing::warn!(error = %e, "live migration {status}: the VM keeps running here");
            shared.update(|p| {
                p.status = status.into();
                p.error = Some(e.to_string());
            });
        }
    }
    result.map(|()| shared.snapshot())
}

fn migrate_out_inner(
    machine: &mut Machine,
    to: &str,
    key: &[u8],
    limits: MigrationLimits,
    shared: &MigrationShared,
    started: Instant,
) -> Result<(), MigrationError> {
    let addr = to
        .to_socket_addrs()
        .map_err(|e| MigrationError::Protocol(format!("address {to}: {e}")))?
        .next()
        .ok_or_else(|| MigrationError::Protocol(format!("address {to} resolves to nothing")))?;
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| MigrationError::Wire(WireError::Io(e)))?;
    socket_buffer(&stream, libc::SO_SNDBUF);
    stream
        .set_nodelay(true)
        .map_err(|e| MigrationError::Wire(WireError::Io(e)))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| MigrationError::Wire(WireError::Io(e)))?;
    let mut ch = Channel::connect(stream, key)?;
    let mut buf = Vec::new();
    let mem_size = machine.memory_file().size();
    ch.send_control(&Control::Config {
        config: machine.config().clone(),
        memory_size: mem_size,
    })?;
    expect(&mut ch, &mut buf, "Ready", |c| matches!(c, Control::Ready))?;
    tracing::debug!(
        ms = started.elapsed().as_secs_f64() * 1000.0,
        "migration: destination ready"
    );

    // Track from before round 1, so nothing written during it is missed.
    let t = Instant::now();
    // Not in the pause, which is a long way off yet.
    machine.prepare_to_save();
    machine.start_dirty_log()?;
    tracing::debug!(
        ms = t.elapsed().as_secs_f64() * 1000.0,
        "migration: dirty logging on"
    );
    let memory = machine.memory_file().clone();
    let guest_memory = machine.guest_memory().clone();
    let mut sender = PageSender::new(&guest_memory);
    // Bandwidth is measured over the whole transfer (every round's bytes
    // over every round's time), not over the last round alone: a small last
    // round is dominated by fixed costs and would understate it.
    let mut send_bytes = 0u64;
    let mut send_time = Duration::ZERO;

    // Round 1: every non-zero page of the memory file's data extents, in
    // ascending page order. Every few MiB the tracker is harvested (what it
    // has, without waiting for the vCPUs): a page dirtied ahead of the
    // cursor is read by this round after that write anyway, so only the
    // others wait for round 2.
    let mut round = 1u32;
    let t_round = Instant::now();
    let visit = round1_ranges(&data_extents(memory.file(), mem_size), mem_size);
    let mut early: Vec<u64> = Vec::new();
    let mut since_harvest = 0usize;
    let mut skipped = 0usize;
    let mut harvest_time = Duration::ZERO;
    for (i, &(first, end)) in visit.iter().enumerate() {
        for pfn in first..end {
            sender.page(&mut ch, round, pfn, true)?;
            since_harvest += 1;
            if since_harvest == ROUND1_HARVEST_PAGES {
                since_harvest = 0;
                let ahead = &visit[i..];
                // Without kicking the vCPUs: a page still in a CPU buffer
                // is merely reported later, and resent then.
                let th = Instant::now();
                let got = machine
                    .dirty_tracker()
                    .harvest()
                    .map_err(MachineError::from)?;
                harvest_time += th.elapsed();
                let n = got.len();
                let before = early.len();
                early.extend(got.into_iter().filter(|&p| !will_visit(ahead, pfn, p)));
                skipped += n - (early.len() - before);
                check_cancel(shared)?;
            }
        }
    }
    sender.flush(&mut ch, round)?;
    end_round(&mut ch, &mut buf, round, sender.pages)?;
    tracing::debug!(
        skipped,
        harvest_ms = harvest_time.as_secs_f64() * 1000.0,
        "round 1: pages dirtied ahead of the cursor, not resent; time in harvests"
    );
    let mut sent_last_round = sender.pages;
    note_round(round, sent_last_round, ch.bytes_sent, t_round.elapsed());
    send_bytes += ch.bytes_sent;
    send_time += t_round.elapsed();
    let stop_reason;
    let mut carry: Vec<u64>;
    let mut last_harvest = t_round;
    // Pre-copy rounds.
    loop {
        let mut dirty = machine.harvest_dirty()?;
        if !early.is_empty() {
            dirty.append(&mut early);
            dirty.sort_unstable();
            dirty.dedup();
        }
        let dirty_rate = dirty.len() as f64 / last_harvest.elapsed().as_secs_f64().max(1e-6);
        last_harvest = Instant::now();
        let bw = send_bytes.max(1) as f64 / send_time.as_secs_f64().max(1e-6);
        let estimate = Duration::from_secs_f64(dirty.len() as f64 * PAGE as f64 / bw);
        shared.update(|p| {
            p.round = round;
            p.bytes_sent = ch.bytes_sent;
            p.pages_sent = sender.pages;
            p.rate_mb_s = bw / 1e6;
            p.dirty_pages_per_s = dirty_rate;
            p.remaining_pages = dirty.len() as u64;
            p.estimated_downtime_ms = estimate.as_secs_f64() * 1000.0;
            p.elapsed_ms = started.elapsed().as_millis() as u64;
        });
        check_cancel(shared)?;
        match decide(
            &limits,
            round,
            estimate,
            dirty.len() as u64,
            sent_last_round,
        ) {
            Decision::Converged => {
                stop_reason = "converged";
                // These pages go in the final round, with the guest paused.
                carry = dirty;
                break;
            }
            Decision::RoundLimit => {
                stop_reason = "round limit";
                carry = dirty;
                break;
            }
            Decision::Iterate => {}
        }
        round += 1;
        let t_round = Instant::now();
        let (before, pages_before) = (ch.bytes_sent, sender.pages);
        for pfn in dirty {
            sender.page(&mut ch, round, pfn, false)?;
        }
        sender.flush(&mut ch, round)?;
        end_round(&mut ch, &mut buf, round, sender.pages)?;
        sent_last_round = sender.pages - pages_before;
        let took = t_round.elapsed();
        note_round(round, sent_last_round, ch.bytes_sent - before, took);
        send_bytes += ch.bytes_sent - before;
        send_time += took;
    }

    // The first encode of a process is cold (see format::warm_up): not in
    // the pause.
    format::warm_up();
    // Final round with the guest paused.
    let paused_at = Instant::now();
    // Paused and saved in one go (one wake-up per vCPU); nothing runs while
    // the last pages are collected and sent, so the state stays consistent.
    let state = machine.pause_and_save()?;
    let t_paused = paused_at.elapsed();
    round += 1;
    let mut dirty = machine.harvest_dirty()?;
    let t_harvested = paused_at.elapsed();
    dirty.append(&mut carry);
    dirty.sort_unstable();
    dirty.dedup();
    let final_pages = dirty.len() as u64;
    let state = format::encode(&state).map_err(|e| MigrationError::Protocol(e.to_string()))?;
    let t_saved = paused_at.elapsed();
    for pfn in dirty {
        sender.page(&mut ch, round, pfn, false)?;
    }
    let t_pages = paused_at.elapsed();
    // The last pages and the state with one write: the destination reads
    // them at one wake-up.
    sender.flush_with(&mut ch, round, Kind::State, &state)?;
    let t_state_sent = paused_at.elapsed();
    let restore_ms = match ch.recv_control(&mut buf)? {
        Control::Restored { restore_ms } => restore_ms,
        Control::Failed { reason } => return Err(MigrationError::Refused(reason)),
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected Restored, got {other:?}"
            )))
        }
    };
    // Point of no return.
    ch.send_control(&Control::Commit)?;
    let downtime = paused_at.elapsed();
    // Leave the CPU to the destination until its guest runs. Nothing from
    // here on can undo the migration: a missing confirmation is only logged.
    let _ = ch.stream().set_read_timeout(Some(super::RUNNING_TIMEOUT));
    let running = super::running_after_commit(
        ch.recv_control(&mut buf),
        |m| matches!(m, Control::Running),
        paused_at,
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    tracing::debug!(
        paused_and_saved = ms(t_paused),
        harvested = ms(t_harvested),
        state_encoded = ms(t_saved),
        pages_read = ms(t_pages),
        pages_and_state_sent = ms(t_state_sent),
        committed = ms(downtime),
        running = running.map(ms),
        "migration: final round timing (ms from the pause)"
    );
    shared.update(|p| {
        p.round = round;
        p.bytes_sent = ch.bytes_sent;
        p.pages_sent = sender.pages;
        p.remaining_pages = 0;
        p.downtime_ms = Some(downtime.as_secs_f64() * 1000.0);
        p.running_ms = running.map(ms);
        p.total_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
        p.elapsed_ms = started.elapsed().as_millis() as u64;
        p.stop_reason = Some(stop_reason.into());
    });
    tracing::info!(
        rounds = round,
        final_pages,
        restore_ms,
        downtime_ms = downtime.as_millis() as u64,
        "live migration committed"
    );
    Ok(())
}

/// Ends a pre-copy round and waits until the destination has every page of
/// it in memory.
fn end_round(
    ch: &mut Channel<TcpStream>,
    buf: &mut Vec<u8>,
    round: u32,
    pages: u64,
) -> Result<(), MigrationError> {
    ch.send_control(&Control::RoundEnd { round, pages })?;
    expect(
        ch,
        buf,
        "RoundAck",
        |c| matches!(c, Control::RoundAck { round: r } if *r == round),
    )
}

/// CPU time this thread has used, ms (for the debug log).
fn thread_cpu_ms() -> f64 {
    // SAFETY: getrusage fills the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD reads the calling thread's counters.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn note_round(round: u32, pages: u64, bytes: u64, took: Duration) {
    tracing::debug!(
        round,
        pages,
        bytes,
        cpu_ms = thread_cpu_ms(),
        ms = took.as_secs_f64() * 1000.0,
        mb_s = bytes as f64 / took.as_secs_f64().max(1e-6) / 1e6,
        "migration round sent"
    );
}

fn check_cancel(shared: &MigrationShared) -> Result<(), MigrationError> {
    if shared.cancel.load(Ordering::SeqCst) {
        Err(MigrationError::Cancelled)
    } else {
        Ok(())
    }
}

fn expect(
    ch: &mut Channel<TcpStream>,
    buf: &mut Vec<u8>,
    what: &str,
    ok: impl Fn(&Control) -> bool,
) -> Result<(), MigrationError> {
    match ch.recv_control(buf)? {
        c if ok(&c) => Ok(()),
        Control::Failed { reason } => Err(MigrationError::Refused(reason)),
        other => Err(MigrationError::Protocol(format!(
            "expected {what}, got {other:?}"
        ))),
    }
}

fn join_prepare(
    t: std::thread::JoinHandle<Result<PreparedVm, MachineError>>,
) -> Result<PreparedVm, MigrationError> {
    Ok(t.join()
        .map_err(|_| MigrationError::Protocol("preparing the VM panicked".into()))??)
}

/// Destination side: listens on `listen`, takes one VM over and returns it
/// running. `adjust` may change the received configuration (this host's TAP
/// names, serial output). On any failure nothing of the VM runs here.
pub fn migrate_in(
    listen: &str,
    key: &[u8],
    events: VmEventSink,
    adjust: impl FnOnce(&mut MachineConfig),
) -> Result<Machine, MigrationError> {
    let listener = TcpListener::bind(listen)
        .map_err(|e| MigrationError::Protocol(format!("cannot listen on {listen}: {e}")))?;
    tracing::info!(listen, "waiting for an incoming live migration");
    let (stream, peer) = listener
        .accept()
        .map_err(|e| MigrationError::Wire(WireError::Io(e)))?;
    drop(listener);
    tracing::info!(%peer, "incoming live migration");
    socket_buffer(&stream, libc::SO_RCVBUF);
    stream
        .set_nodelay(true)
        .map_err(|e| MigrationError::Wire(WireError::Io(e)))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| MigrationError::Wire(WireError::Io(e)))?;
    let mut ch = Channel::accept(stream, key)?;
    match receive_vm(&mut ch, events, adjust) {
        Ok(m) => Ok(m),
        Err(e) => {
            let _ = ch.send_control(&Control::Failed {
                reason: e.to_string(),
            });
            Err(e)
        }
    }
}

fn receive_vm(
    ch: &mut Channel<TcpStream>,
    events: VmEventSink,
    adjust: impl FnOnce(&mut MachineConfig),
) -> Result<Machine, MigrationError> {
    let mut buf = Vec::new();
    let (mut config, memory_size) = match ch.recv_control(&mut buf)? {
        Control::Config {
            config,
            memory_size,
        } => (config, memory_size),
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected Config, got {other:?}"
            )))
        }
    };
    config
        .validate()
        .map_err(|e| MigrationError::Protocol(e.to_string()))?;
    if memory_size != config.memory_bytes {
        return Err(MigrationError::Protocol(
            "memory size does not match the configuration".into(),
        ));
    }
    adjust(&mut config);
    let memory = GuestMemoryFile::create(memory_size, &MemoryBacking::Memfd)
        .map_err(|e| MigrationError::Memory(e.to_string()))?;
    // Pages go into the memory file at once; the KVM VM and its memory
    // slots (milliseconds, more on a busy host) are built meanwhile, off the
    // transfer's path, as QEMU's -incoming has its VM ready.
    let for_vm = memory.clone();
    let vcpus = config.vcpus;
    let preparing = std::thread::Builder::new()
        .name("vm-prepare".into())
        .spawn(move || {
            let t = Instant::now();
            let prepared = Machine::prepare(for_vm).and_then(|mut p| {
                p.create_vcpus(vcpus)?;
                p.start_threads_ahead()?;
                Ok(p)
            });
            tracing::debug!(
                ms = t.elapsed().as_secs_f64() * 1000.0,
                "migration: VM, memory slots and vCPUs prepared"
            );
            prepared
        })
        .map_err(|e| MigrationError::Protocol(format!("cannot start a thread: {e}")))?;
    let mut preparing = Some(preparing);
    let mut prepared: Option<PreparedVm> = None;
    ch.send_control(&Control::Ready)?;
    let state = loop {
        match ch.recv(&mut buf)? {
            Kind::Pages => {
                write_frame(memory.file(), memory_size, &buf)?;
            }
            Kind::State => {
                // The source is paused: the vCPU threads made ahead poll for
                // their start from now on (their wake-up overlaps the restore).
                if let Some(p) = &prepared {
                    p.get_vcpu_threads_ready();
                }
                break std::mem::take(&mut buf);
            }
            Kind::Control => {
                match serde_json::from_slice(&buf)
                    .map_err(|e| WireError::Malformed(e.to_string()))?
                {
                    Control::RoundEnd { round, pages } => {
                        tracing::debug!(
                            round,
                            pages,
                            cpu_ms = thread_cpu_ms(),
                            "migration round received"
                        );
                        // The first acknowledgement also says the VM is
                        // built: the source never pauses before it is.
                        if let Some(t) = preparing.take() {
                            prepared = Some(join_prepare(t)?);
                        }
                        ch.send_control(&Control::RoundAck { round })?;
                        // The pause may come next: the state's decode,
                        // its first step, is cold after a round of pages
                        // went through the caches.
                        format::warm_up();
                    }
                    Control::Failed { reason } => return Err(MigrationError::Refused(reason)),
                    other => {
                        return Err(MigrationError::Protocol(format!(
                            "unexpected {other:?} during memory transfer"
                        )))
                    }
                }
            }
        }
    };
    // Fault injection for tests: hold with the whole VM received and the
    // source paused, so a test can kill either end or the link here.
    if let Some(ms) = std::env::var("KEMARI_FAULT_HOLD_MIGRATE_IN_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let started = Instant::now();
    let prepared = match (prepared, preparing) {
        (Some(p), _) => p,
        (None, Some(t)) => join_prepare(t)?,
        (None, None) => return Err(MigrationError::Protocol("no VM was prepared".into())),
    };
    let mut state = format::decode(&state).map_err(|e| MigrationError::Protocol(e.to_string()))?;
    state.config.serial = config.serial.clone();
    state.config.nets = config.nets.clone();
    state.config.disks = config.disks.clone();
    state.config.memory_backing = MemoryBacking::Memfd;
    state.memory.backing = MemoryBacking::Memfd;
    // The guest runs here as soon as it is restored, before the source's
    // `Commit` arrives: the commit's round trip is not in its pause. Its
    // outputs (disk requests, packets sent, console bytes) wait at this gate
    // until the commit; if the commit does not come the VM is discarded
    // with nothing of its run seen outside, and the source resumes its own
    // copy (this memory is this process's alone, unlike a zero-copy
    // hand-over's, which cannot run ahead like this).
    let gate = Arc::new(CommitGate::default());
    let mut machine =
        Machine::restore_prepared(&state, prepared, events, false, gate.clone(), Vec::new())?;
    let t_restored = started.elapsed();
    // From this thread, while the guest runs on its own: not from the vCPU
    // thread at its first partial line.
    machine.start_console_flusher();
    // Fault injection for tests: hold with the guest running here, its
    // outputs held, before the source hears `Restored`.
    if let Some(ms) = std::env::var("KEMARI_FAULT_HOLD_BEFORE_COMMIT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let commit = ch
        .send_control(&Control::Restored {
            restore_ms: t_restored.as_millis() as u64,
        })
        .and_then(|()| ch.recv_control(&mut buf));
    match commit {
        Ok(Control::Commit) => gate.commit(),
        other => {
            gate.discard();
            // Stop the guest at once; the machine is torn down on return.
            let _ = machine.pause();
            tracing::warn!(
                held_requests = gate.held_requests(),
                held_console_bytes = machine.console_bytes_pending(),
                "live migration: no commit; the run of the guest here is discarded, nothing it output left the VM"
            );
            return Err(match other {
                Ok(m) => MigrationError::Protocol(format!("expected Commit, got {m:?}")),
                Err(e) => MigrationError::Wire(e),
            });
        }
    }
    let t_committed = started.elapsed();
    // The source exits on this; the VM is ours whether it hears it or not.
    if let Err(e) = ch.send_control(&Control::Running) {
        tracing::warn!(error = %e, "live migration: cannot tell the source the VM runs");
    }
    super::log_destination_timeline("tcp", started, t_restored, t_committed);
    machine.announce_network();
    tracing::info!("live migration: VM taken over and running");
    Ok(machine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn received_pages_land_at_their_offsets_and_outside_ram_is_refused() {
        use super::super::wire::{encode_pages, PageData};
        use std::os::unix::fs::FileExt;
        let size = 4u64 << 30;
        let file = GuestMemoryFile::create(size, &MemoryBacking::Memfd).unwrap();
        let (a, b) = ([3u8; PAGE], [4u8; PAGE]);
        let high = layout::MMIO_GAP_END / 4096;
        let low_end = layout::MMIO_GAP_START / 4096 - 1;
        let mut frame = Vec::new();
        // A run across the MMIO gap (contiguous in the file), a zero page
        // over an earlier write, a lone page.
        encode_pages(
            1,
            &[
                (5, PageData::Data(&a)),
                (7, PageData::Data(&a)),
                (7, PageData::Zero),
                (low_end, PageData::Data(&a)),
                (high, PageData::Data(&b)),
                (high + 1, PageData::Data(&a)),
            ],
            &mut frame,
        );
        write_frame(file.file(), size, &frame).unwrap();
        let byte = |off: u64| {
            let mut x = [0u8; 1];
            file.file().read_exact_at(&mut x, off).unwrap();
            x[0]
        };
        assert_eq!(byte(5 * 4096 + 9), 3);
        assert_eq!(byte(6 * 4096), 0);
        assert_eq!(byte(7 * 4096 + 1), 0);
        assert_eq!(byte(low_end * 4096), 3);
        assert_eq!(byte(layout::MMIO_GAP_START), 4);
        assert_eq!(byte(layout::MMIO_GAP_START + 4096 + 4095), 3);
        for pfn in [layout::MMIO_GAP_START / 4096, high + (1 << 20), u64::MAX] {
            encode_pages(1, &[(pfn, PageData::Data(&a))], &mut frame);
            assert!(matches!(
                write_frame(file.file(), size, &frame),
                Err(WireError::Malformed(_))
            ));
        }
    }

    #[test]
    fn round1_visits_extents_in_page_order() {
        let size = 4u64 << 30;
        let gap = layout::MMIO_GAP_START;
        let high = layout::MMIO_GAP_END / 4096;
        // One extent across the end of low RAM (the file continues with
        // the RAM above the MMIO gap), one inside the first page.
        let ranges = round1_ranges(&[(100, 200), (gap - 8192, gap + 4096)], size);
        assert_eq!(
            ranges,
            vec![(0, 1), (gap / 4096 - 2, gap / 4096), (high, high + 1)]
        );
        assert!(will_visit(&ranges, 0, high));
        assert!(will_visit(&ranges, gap / 4096 - 2, gap / 4096 - 1));
        // Behind the cursor, or in a hole: round 2's.
        assert!(!will_visit(&ranges, gap / 4096 - 1, gap / 4096 - 2));
        assert!(!will_visit(&ranges, 0, 5));
        assert!(!will_visit(&ranges, 0, high + 1));
    }

    #[test]
    fn convergence_rule() {
        let limits = MigrationLimits {
            max_downtime: Duration::from_millis(300),
            max_rounds: 5,
            settle: Duration::from_millis(1),
        };
        let ms = Duration::from_millis;
        // Little left: pause at once, whatever the trend.
        assert_eq!(decide(&limits, 1, ms(1), 10, 1), Decision::Converged);
        // Within the limit but shrinking fast: another round pays.
        assert_eq!(decide(&limits, 1, ms(10), 1500, 16000), Decision::Iterate);
        // Within the limit and no longer shrinking: pause.
        assert_eq!(decide(&limits, 3, ms(10), 1400, 1500), Decision::Converged);
        // Over the limit: iterate up to the round limit.
        assert_eq!(decide(&limits, 3, ms(400), 9000, 9000), Decision::Iterate);
        assert_eq!(
            decide(&limits, 5, ms(400), 9000, 9000),
            Decision::RoundLimit
        );
        assert_eq!(
            decide(&limits, 5, ms(10), 1500, 16000),
            Decision::RoundLimit
        );
        // The settle time never exceeds the downtime limit.
        let tight = MigrationLimits {
            max_downtime: Duration::from_micros(100),
            ..limits
        };
        assert_eq!(decide(&tight, 1, ms(1), 10, 10000), Decision::Iterate);
    }

    #[test]
    fn short_keys_are_refused() {
        let p = std::env::temp_dir().join(format!("kemari-key-{}", std::process::id()));
        std::fs::write(&p, "short\n").unwrap();
        assert!(matches!(read_key(&p), Err(MigrationError::Key { .. })));
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        assert_eq!(read_key(&p).unwrap(), b"0123456789abcdef0123");
        std::fs::remove_file(p).unwrap();
    }
}
