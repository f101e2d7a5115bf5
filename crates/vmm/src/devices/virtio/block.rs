//! virtio-blk (device ID 2): one request queue in front of a [`BlockBackend`].
//!
//! Requests are served synchronously in [`VirtioDevice::queue_notified`], on the
//! VMM's device event-loop thread. Each chain is checked by
//! [`request::parse_request`]; a malformed one is answered VIRTIO_BLK_S_IOERR
//! (or, if it has no usable status byte, returned with length 0) and counted,
//! and the VMM carries on. The request queue is the device's output queue
//! (see [`crate::output`]): the event loop serves it through
//! [`VirtioDevice::serve_outputs_until`] once the output gate released the
//! requests the guest had published.

pub mod request;

use nbd_client::page_buf::PageBuf;
use tracing::{debug, info, warn};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use self::request::{
    gather, sub_segments, ParseFailure, RawDesc, Request, RequestKind, Segment, ID_BYTES,
    MAX_RANGES, MAX_RANGE_SECTORS, RANGE_FLAG_UNMAP,
};
use super::{
    read_config_space, Activation, ActiveQueue, DeviceCounters, PendingOutputs, QueueProgress,
    QueueView, VirtioDevice, VirtioError, FEATURE_VERSION_1, TYPE_BLOCK,
};
use crate::devices::block_backend::{BlockBackend, ReleasedBackend, SECTOR_SIZE};
use crate::memory::GuestMemoryMmap;

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most data segments per request (advertised as seg_max): the chain also
/// carries a header and a status descriptor.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Host bounce buffer for moving data between guest memory and the backend.
const CHUNK: usize = 256 << 10;

/// Feature bits (virtio 1.2, 5.2.3).
pub mod features {
    /// seg_max in config space is valid.
    pub const SEG_MAX: u64 = 1 << 2;
    /// The disk is read-only.
    pub const RO: u64 = 1 << 5;
    /// blk_size in config space is valid.
    pub const BLK_SIZE: u64 = 1 << 6;
    /// FLUSH requests are supported.
    pub const FLUSH: u64 = 1 << 9;
    /// DISCARD requests are supported.
    pub const DISCARD: u64 = 1 << 13;
    /// WRITE_ZEROES requests are supported.
    pub const WRITE_ZEROES: u64 = 1 << 14;
    /// VIRTIO_RING_F_EVENT_IDX.
    pub const EVENT_IDX: u64 = 1 << 29;
}

/// Status values (VIRTIO_BLK_S_*).
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// Request failed.
    pub const IOERR: u8 = 1;
    /// Request type not supported.
    pub const UNSUPP: u8 = 2;
}

/// Length of the configuration space we expose (through write_zeroes_may_unmap).
const CONFIG_LEN: usize = 60;

/// A virtio-blk device.
pub struct Block {
    name: String,
    backend: Box<dyn BlockBackend>,
    features: u64,
    config: [u8; CONFIG_LEN],
    serial: [u8; ID_BYTES],
    active: Option<ActiveQueue>,
    counters: DeviceCounters,
    /// Bounce buffer between guest memory and the backend, page-aligned: the
    /// kernel's copies into and out of a buffer 16 bytes off a page (where a
    /// large `Vec` lands) take up to twice as long (see `PageBuf`).
    buf: PageBuf,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("name", &self.name)
            .field("backend", &self.backend.id())
            .field("activated", &self.active.is_some())
            .finish()
    }
}

/// Outcome of one request: status byte and bytes written into guest buffers
/// (data, not counting the status byte).
struct Completion {
    status: u8,
    written: u64,
}

impl Block {
    /// A block device named `name` in front of `backend`.
    pub fn new(name: impl Into<String>, backend: Box<dyn BlockBackend>) -> Self {
        let name = name.into();
        let mut features = FEATURE_VERSION_1
            | features::FLUSH
            | features::BLK_SIZE
            | features::SEG_MAX
            | features::EVENT_IDX;
        if backend.read_only() {
            features |= features::RO;
        } else {
            if backend.supports_discard() {
                features |= features::DISCARD;
            }
            if backend.supports_write_zeroes() {
                features |= features::WRITE_ZEROES;
            }
        }
        let config = build_config(backend.size() / SECTOR_SIZE);
        let mut serial = [0u8; ID_BYTES];
        let n = name.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&name.as_bytes()[..n]);
        Block {
            name,
            backend,
            features,
            config,
            serial,
            active: None,
            counters: DeviceCounters::default(),
            buf: PageBuf::new(),
        }
    }

    /// The backend's identity (for saved state).
    pub fn backend_id(&self) -> String {
        self.backend.id()
    }

    /// Serves available requests — all of them, or those before avail index
    /// `limit` — then interrupts the guest if it wants. Returns how many.
    fn process_queue(&mut self, limit: Option<u16>) -> u16 {
        let Some(mut active) = self.active.take() else {
            return 0;
        };
        let mut used_any = false;
        let mut served = 0u16;
        loop {
            if active.queue.event_idx_enabled() {
                // Errors here mean a broken ring; popping will fail and stop too.
                let _ = active.queue.disable_notification(&active.mem);
            }
            let mut popped = 0usize;
            while limit != Some(active.queue.next_avail()) {
                let Some(chain) = active.queue.pop_descriptor_chain(&active.mem) else {
                    break;
                };
                popped += 1;
                served = served.wrapping_add(1);
                let head = chain.head_index();
                let used_len = self.handle_chain(&active.mem, chain.map(RawDesc::from));
                if let Err(e) = active.queue.add_used(&active.mem, head, used_len) {
                    debug!(device = %self.name, error = %e, "virtio-blk: cannot add used entry");
                    self.counters.bad_descriptors += 1;
                }
                used_any = true;
            }
            // Without EVENT_IDX, or when nothing could be popped although the
            // ring claims more (a corrupt avail index), stop here.
            if !active.queue.event_idx_enabled() || popped == 0 {
                break;
            }
            match active.queue.enable_notification(&active.mem) {
                // More arrived: serve it, unless the batch ends here (the
                // event loop sees the rest as pending outputs).
                Ok(true) if limit != Some(active.queue.next_avail()) => continue,
                Ok(_) => break,
                Err(e) => {
                    debug!(device = %self.name, error = %e, "virtio-blk: broken ring");
                    break;
                }
            }
        }
        if used_any && active.queue.needs_notification(&active.mem).unwrap_or(true) {
            active.interrupt.signal_used_queue();
        }
        self.active = Some(active);
        served
    }

    /// Parses and serves one chain; returns the used length.
    fn handle_chain(&mut self, mem: &GuestMemoryMmap, descs: impl Iterator<Item = RawDesc>) -> u32 {
        let req = match request::parse_request(mem, descs, self.backend.size()) {
            Ok(r) => r,
            Err(ParseFailure { error, status }) => {
                debug!(device = %self.name, %error, "virtio-blk: rejected descriptor chain");
                self.counters.bad_descriptors += 1;
                self.counters.errors += 1;
                return match status {
                    Some(addr) if mem.write_obj(status::IOERR, addr).is_ok() => 1,
                    _ => 0,
                };
            }
        };
        let done = self.execute(mem, &req);
        if done.status == status::OK {
            self.counters.requests += 1;
        } else {
            self.counters.errors += 1;
        }
        if mem.write_obj(done.status, req.status).is_err() {
            // Checked by the parser: cannot happen unless memory changed.
            self.counters.bad_descriptors += 1;
            return 0;
        }
        u32::try_from(done.written + 1).unwrap_or(u32::MAX)
    }

    fn execute(&mut self, mem: &GuestMemoryMmap, req: &Request) -> Completion {
        let ok = |written| Completion {
            status: status::OK,
            written,
        };
        let err = |s| Completion {
            status: s,
            written: 0,
        };
        let read_only = self.backend.read_only();
        match &req.kind {
            RequestKind::In => match self.read_into_guest(mem, req) {
                Ok(()) => {
                    self.counters.bytes_in += req.data_len;
                    ok(req.data_len)
                }
                Err(e) => {
                    warn!(device = %self.name, sector = req.sector, error = %e, "virtio-blk: read failed");
                    err(status::IOERR)
                }
            },
            RequestKind::Out if read_only => err(status::IOERR),
            RequestKind::Out => match self.write_from_guest(mem, req) {
                Ok(()) => {
                    self.counters.bytes_out += req.data_len;
                    ok(0)
                }
                Err(e) => {
                    warn!(device = %self.name, sector = req.sector, error = %e, "virtio-blk: write failed");
                    err(status::IOERR)
                }
            },
            RequestKind::Flush => match self.backend.flush() {
                Ok(()) => ok(0),
                Err(e) => {
                    warn!(device = %self.name, error = %e, "virtio-blk: flush failed");
                    err(status::IOERR)
                }
            },
            RequestKind::GetId => {
                let n = (req.data_len as usize).min(ID_BYTES);
                let mut written = 0;
                for s in sub_segments(&req.data, 0, n as u64) {
                    let len = s.len as usize;
                    if mem
                        .write_slice(&self.serial[written..written + len], s.addr)
                        .is_err()
                    {
                        return err(status::IOERR);
                    }
                    written += len;
                }
                ok(written as u64)
            }
            RequestKind::Discard(ranges) | RequestKind::WriteZeroes(ranges) => {
                let discard = matches!(req.kind, RequestKind::Discard(_));
                let offered = if discard {
                    features::DISCARD
                } else {
                    features::WRITE_ZEROES
                };
                if self.features & offered == 0 {
                    return err(status::UNSUPP);
                }
                let allowed_flags = if discard { 0 } else { RANGE_FLAG_UNMAP };
                if ranges.len() > MAX_RANGES as usize
                    || ranges
                        .iter()
                        .any(|r| r.flags & !allowed_flags != 0 || r.num_sectors > MAX_RANGE_SECTORS)
                {
                    return err(status::UNSUPP);
                }
                for r in ranges {
                    let (off, len) = (
                        r.sector * SECTOR_SIZE,
                        u64::from(r.num_sectors) * SECTOR_SIZE,
                    );
                    let res = if discard {
                        self.backend.discard(off, len)
                    } else {
                        self.backend
                            .write_zeroes(off, len, r.flags & RANGE_FLAG_UNMAP != 0)
                    };
                    if let Err(e) = res {
                        warn!(device = %self.name, sector = r.sector, error = %e, "virtio-blk: discard/write-zeroes failed");
                        return err(status::IOERR);
                    }
                }
                ok(0)
            }
            RequestKind::Unsupported => err(status::UNSUPP),
        }
    }

    fn chunks(data: &[Segment]) -> impl Iterator<Item = (GuestAddress, usize)> + '_ {
        data.iter().flat_map(|s| {
            let len = s.len as usize;
            (0..len)
                .step_by(CHUNK)
                .map(move |o| (GuestAddress(s.addr.0 + o as u64), (len - o).min(CHUNK)))
        })
    }

    fn read_into_guest(&mut self, mem: &GuestMemoryMmap, req: &Request) -> Result<(), String> {
        let mut buf = std::mem::take(&mut self.buf);
        let mut off = req.sector * SECTOR_SIZE;
        let mut result = Ok(());
        for (addr, len) in Self::chunks(&req.data) {
            // Straight into guest memory where the range is in one region
            // (the backend may then skip the bounce copy); a range across
            // regions, or one outside memory, through the buffer.
            if let Ok(dst) = mem.get_slice(addr, len) {
                if let Err(e) = self.backend.read_to_guest(off, &dst, &mut buf) {
                    result = Err(e.to_string());
                    break;
                }
                off += len as u64;
                continue;
            }
            if buf.len() < len {
                buf.set_len(len);
            }
            if let Err(e) = self.backend.read_at(off, &mut buf[..len]) {
                result = Err(e.to_string());
                break;
            }
            if let Err(e) = mem.write_slice(&buf[..len], addr) {
                result = Err(e.to_string());
                break;
            }
            off += len as u64;
        }
        self.buf = buf;
        result
    }

    fn write_from_guest(&mut self, mem: &GuestMemoryMmap, req: &Request) -> Result<(), String> {
        let mut buf = std::mem::take(&mut self.buf);
        let mut off = req.sector * SECTOR_SIZE;
        let mut result = Ok(());
        for (addr, len) in Self::chunks(&req.data) {
            if buf.len() < len {
                buf.set_len(len);
            }
            let seg = [Segment {
                addr,
                len: len as u32,
            }];
            if let Err(e) = gather(mem, &seg, &mut buf[..len]) {
                result = Err(e.to_string());
                break;
            }
            if let Err(e) = self.backend.write_at(off, &buf[..len]) {
                result = Err(e.to_string());
                break;
            }
            off += len as u64;
        }
        self.buf = buf;
        result
    }
}

fn build_config(capacity_sectors: u64) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |off: usize, bytes: &[u8]| c[off..off + bytes.len()].copy_from_slice(bytes);
    put(0, &capacity_sectors.to_le_bytes());
    // size_max (8) unused; seg_max:
    put(12, &SEG_MAX.to_le_bytes());
    // geometry (16) unused; blk_size:
    put(20, &(SECTOR_SIZE as u32).to_le_bytes());
    // topology (24..32), writeback (32), num_queues (34):
    put(34, &1u16.to_le_bytes());
    put(36, &MAX_RANGE_SECTORS.to_le_bytes()); // max_discard_sectors
    put(40, &MAX_RANGES.to_le_bytes()); // max_discard_seg
    put(44, &8u32.to_le_bytes()); // discard_sector_alignment (4 KiB)
    put(48, &MAX_RANGE_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
    put(52, &MAX_RANGES.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    c
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config, offset, data);
    }

    fn activate(&mut self, mut activation: Activation) -> Result<(), VirtioError> {
        let [queue] = activation.take_queues()?;
        let Activation {
            mem,
            interrupt,
            acked_features,
            ..
        } = activation;
        info!(device = %self.name, backend = %self.backend.id(), features = acked_features, "virtio-blk activated");
        self.active = Some(ActiveQueue {
            mem,
            queue,
            interrupt,
        });
        Ok(())
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn queue_notified(&mut self, index: usize) {
        if index == 0 {
            self.process_queue(None);
        }
    }

    fn output_queue(&self) -> Option<usize> {
        Some(0)
    }

    fn pending_outputs(&self) -> Option<PendingOutputs> {
        let a = self.active.as_ref()?;
        PendingOutputs::of(&a.queue, &a.mem)
    }

    fn serve_outputs_until(&mut self, limit: u16) -> u16 {
        self.process_queue(Some(limit))
    }

    fn reset(&mut self) {
        self.active = None;
    }

    fn release_backend(&mut self) -> std::io::Result<Option<std::fs::File>> {
        // Dropping the old backend closes the image or the NBD connection.
        self.backend = Box::new(ReleasedBackend::of(self.backend.as_ref()));
        Ok(None)
    }

    fn counters(&self) -> DeviceCounters {
        DeviceCounters {
            cache: self.backend.cache_counters(),
            reconnects: self.backend.reconnects(),
            ..self.counters.clone()
        }
    }

    fn queue_views(&self) -> Vec<QueueView> {
        ActiveQueue::views(self.active.as_ref())
    }

    fn queue_progress(&self) -> Vec<QueueProgress> {
        ActiveQueue::progress(self.active.as_ref())
    }
}

#[cfg(test)]
pub(crate) mod tests;
