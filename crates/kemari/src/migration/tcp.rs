//! Pre-copy live migration over TCP (docs/migration-protocol.md).
//!
//! Source: send every non-zero page while the guest runs (round 1), then, round
//! after round, the pages dirtied meanwhile (the O(dirty) tracker: KVM's dirty
//! ring plus the VMM's own writes), until the estimated downtime — remaining
//! pages over measured bandwidth — fits the limit or the round limit is hit;
//! then pause, send the last pages and the state, and commit once the
//! destination has restored. Until `Commit` the source owns the VM and resumes
//! it on any failure; the destination discards a partial VM.

use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use vmm::config::MachineConfig;
use vmm::layout;
use vmm::machine::{Machine, MachineError, RunState};
use vmm::memory::{GuestMemoryFile, MemoryBacking};
use vmm::output::PassThroughGate;
use vmm::persist::format;
use vmm::vstate::VmEventSink;

use super::wire::{
    decode_pages, encode_pages, Channel, Control, Kind, PageData, WireError, MAX_PAGES_PER_FRAME,
    PAGE,
};

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
}

impl Default for MigrationLimits {
    fn default() -> Self {
        MigrationLimits {
            max_downtime: Duration::from_millis(300),
            max_rounds: 30,
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
    /// Bandwidth of the last round, MB/s.
    pub rate_mb_s: f64,
    /// Pages dirtied per second during the last round.
    pub dirty_pages_per_s: f64,
    /// Pages still to send (last harvest).
    pub remaining_pages: u64,
    /// Remaining pages over bandwidth, ms.
    pub estimated_downtime_ms: f64,
    /// Time since start, ms.
    pub elapsed_ms: u64,
    /// Final report: guest paused time as the source saw it, ms.
    pub downtime_ms: Option<f64>,
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
        .find(|&(base, len, _)| gpa >= base && gpa < base + len)
        .map(|(base, _, off)| gpa - base + off)
}

/// Guest page number of memory-file offset `off`.
pub(crate) fn offset_pfn(mem_size: u64, off: u64) -> Option<u64> {
    layout::ram_ranges(mem_size)
        .into_iter()
        .find(|&(_, len, foff)| off >= foff && off < foff + len)
        .map(|(base, _, foff)| (base + off - foff) / PAGE as u64)
}

/// Data extents of the memory file (never-touched memory is a hole).
pub(crate) fn data_extents(file: &std::fs::File, size: u64) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
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

struct PageSender<'a> {
    memory: &'a GuestMemoryFile,
    batch: Vec<(u64, Vec<u8>)>,
    frame: Vec<u8>,
    pages: u64,
}

impl<'a> PageSender<'a> {
    fn new(memory: &'a GuestMemoryFile) -> Self {
        PageSender {
            memory,
            batch: Vec::with_capacity(MAX_PAGES_PER_FRAME),
            frame: Vec::new(),
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
        let off = pfn_offset(self.memory.size(), pfn)
            .ok_or_else(|| MigrationError::Memory(format!("page {pfn:#x} is not RAM")))?;
        let mut data = vec![0u8; PAGE];
        self.memory
            .file()
            .read_exact_at(&mut data, off)
            .map_err(|e| MigrationError::Memory(e.to_string()))?;
        let zero = data.iter().all(|&b| b == 0);
        if zero && skip_zero {
            return Ok(());
        }
        if zero {
            data.clear();
        }
        self.batch.push((pfn, data));
        if self.batch.len() == MAX_PAGES_PER_FRAME {
            self.flush(ch, round)?;
        }
        Ok(())
    }

    fn flush(&mut self, ch: &mut Channel<TcpStream>, round: u32) -> Result<(), MigrationError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let pages: Vec<_> = self
            .batch
            .iter()
            .map(|(pfn, d)| {
                (
                    *pfn,
                    if d.is_empty() {
                        PageData::Zero
                    } else {
                        PageData::Data(d)
                    },
                )
            })
            .collect();
        encode_pages(round, &pages, &mut self.frame);
        ch.send(Kind::Pages, &self.frame)?;
        self.pages += self.batch.len() as u64;
        self.batch.clear();
        Ok(())
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
    let _ = machine.stop_dirty_log();
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

    // Track from before round 1, so nothing written during it is missed.
    machine.start_dirty_log()?;
    let memory = machine.memory_file().clone();
    let mut sender = PageSender::new(&memory);

    // Round 1: every non-zero page.
    let mut round = 1u32;
    let mut t_round = Instant::now();
    for (start, end) in data_extents(memory.file(), mem_size) {
        let mut off = start & !(PAGE as u64 - 1);
        while off < end {
            if let Some(pfn) = offset_pfn(mem_size, off) {
                sender.page(&mut ch, round, pfn, true)?;
            }
            off += PAGE as u64;
        }
        check_cancel(shared)?;
    }
    sender.flush(&mut ch, round)?;
    ch.send_control(&Control::RoundEnd {
        round,
        pages: sender.pages,
    })?;
    let mut last_bytes = ch.bytes_sent;
    let mut elapsed = t_round.elapsed();
    let stop_reason;
    let mut carry: Vec<u64>;
    // Pre-copy rounds.
    loop {
        let dirty = machine.harvest_dirty()?;
        let bw = (last_bytes.max(1) as f64) / elapsed.as_secs_f64().max(1e-6);
        let dirty_rate = dirty.len() as f64 / elapsed.as_secs_f64().max(1e-6);
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
        if estimate <= limits.max_downtime {
            stop_reason = "converged";
            // These pages go in the final round, with the guest paused.
            carry = dirty;
            break;
        }
        if round >= limits.max_rounds {
            stop_reason = "round limit";
            carry = dirty;
            break;
        }
        round += 1;
        t_round = Instant::now();
        let before = ch.bytes_sent;
        for pfn in dirty {
            sender.page(&mut ch, round, pfn, false)?;
        }
        sender.flush(&mut ch, round)?;
        ch.send_control(&Control::RoundEnd {
            round,
            pages: sender.pages,
        })?;
        last_bytes = ch.bytes_sent - before;
        elapsed = t_round.elapsed();
    }

    // Final round with the guest paused.
    let paused_at = Instant::now();
    if machine.state() == RunState::Running {
        machine.pause()?;
    }
    round += 1;
    let mut dirty = machine.harvest_dirty()?;
    dirty.append(&mut carry);
    dirty.sort_unstable();
    dirty.dedup();
    let final_pages = dirty.len() as u64;
    for pfn in dirty {
        sender.page(&mut ch, round, pfn, false)?;
    }
    sender.flush(&mut ch, round)?;
    let state = machine.save_state()?;
    let state = format::encode(&state).map_err(|e| MigrationError::Protocol(e.to_string()))?;
    ch.send_control(&Control::State { state })?;
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
    shared.update(|p| {
        p.round = round;
        p.bytes_sent = ch.bytes_sent;
        p.pages_sent = sender.pages;
        p.remaining_pages = 0;
        p.downtime_ms = Some(downtime.as_secs_f64() * 1000.0);
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
    let prepared = Machine::prepare(memory.clone())?;
    ch.send_control(&Control::Ready)?;
    let zero = vec![0u8; PAGE];
    let state = loop {
        match ch.recv(&mut buf)? {
            Kind::Pages => {
                decode_pages(&buf, |pfn, data| {
                    let off = pfn_offset(memory_size, pfn).ok_or_else(|| {
                        WireError::Malformed(format!("page {pfn:#x} is outside guest memory"))
                    })?;
                    memory
                        .file()
                        .write_all_at(data.unwrap_or(&zero), off)
                        .map_err(WireError::Io)
                })?;
            }
            Kind::Blob => {
                return Err(MigrationError::Protocol(
                    "unexpected binary frame during memory transfer".into(),
                ))
            }
            Kind::Control => {
                match serde_json::from_slice(&buf)
                    .map_err(|e| WireError::Malformed(e.to_string()))?
                {
                    Control::RoundEnd { round, pages } => {
                        tracing::debug!(round, pages, "migration round received");
                    }
                    Control::State { state } => break state,
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
    let mut state = format::decode(&state).map_err(|e| MigrationError::Protocol(e.to_string()))?;
    state.config.serial = config.serial.clone();
    state.config.nets = config.nets.clone();
    state.config.disks = config.disks.clone();
    state.config.memory_backing = MemoryBacking::Memfd;
    state.memory.backing = MemoryBacking::Memfd;
    let mut machine = Machine::restore_prepared(
        &state,
        prepared,
        events,
        true,
        Arc::new(PassThroughGate),
        Vec::new(),
    )?;
    ch.send_control(&Control::Restored {
        restore_ms: started.elapsed().as_millis() as u64,
    })?;
    match ch.recv_control(&mut buf)? {
        Control::Commit => {}
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected Commit, got {other:?}"
            )))
        }
    }
    machine.resume()?;
    machine.announce_network();
    tracing::info!("live migration: VM taken over and running");
    Ok(machine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_offsets_skip_the_mmio_gap() {
        let size = 4u64 << 30;
        assert_eq!(pfn_offset(size, 5), Some(5 * 4096));
        assert_eq!(pfn_offset(size, layout::MMIO_GAP_START / 4096), None);
        let high = layout::MMIO_GAP_END / 4096;
        assert_eq!(pfn_offset(size, high), Some(layout::MMIO_GAP_START));
        assert_eq!(offset_pfn(size, layout::MMIO_GAP_START), Some(high));
        assert_eq!(pfn_offset(size, u64::MAX), None);
        assert_eq!(pfn_offset(256 << 20, (256 << 20) / 4096), None);
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
