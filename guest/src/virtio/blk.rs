//! virtio-blk driver: up to `DEPTH` 4 KiB requests in flight, polled.

use guest::blockfmt::{BLOCK_SIZE, SECTORS_PER_BLOCK};

use super::mmio::MmioTransport;
use super::queue::{Buf, Virtqueue};
use super::{VirtioError, F_EVENT_IDX};

/// Requests in flight at most; each has its own header, status and 4 KiB
/// data buffer ("slot").
pub const DEPTH: usize = 32;

const F_FLUSH: u64 = 1 << 9;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
/// Status the driver preloads; the device overwrites it with 0 (OK),
/// 1 (IOERR) or 2 (UNSUPP).
const STATUS_PENDING: u8 = 0xff;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
}

pub struct Blk {
    transport: MmioTransport,
    queue: Virtqueue,
    capacity_sectors: u64,
    has_flush: bool,
    /// Page holding the slots' headers (32 bytes apart) and status bytes.
    meta: u64,
    /// DEPTH consecutive 4 KiB data buffers.
    data: u64,
    /// Which slot a chain head belongs to.
    head_slot: [u8; 256],
}

impl Blk {
    pub fn new(transport: MmioTransport) -> Result<Self, VirtioError> {
        let features = transport.negotiate(F_FLUSH | F_EVENT_IDX)?;
        let queue = Virtqueue::new(&transport, 0, 128, features & F_EVENT_IDX != 0)?;
        if (queue.size() as usize) < 3 {
            return Err(VirtioError::BadQueue(0));
        }
        let capacity_sectors = transport.config32(0) as u64 | (transport.config32(4) as u64) << 32;
        let meta = crate::mem::alloc_phys(4096, 4096).ok_or(VirtioError::OutOfMemory)?;
        let data = crate::mem::alloc_phys((DEPTH * BLOCK_SIZE) as u64, 4096)
            .ok_or(VirtioError::OutOfMemory)?;
        transport.driver_ok();
        Ok(Self {
            transport,
            queue,
            capacity_sectors,
            has_flush: features & F_FLUSH != 0,
            meta,
            data,
            head_slot: [0; 256],
        })
    }

    pub fn base(&self) -> u64 {
        self.transport.base()
    }

    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_sectors / SECTORS_PER_BLOCK
    }

    pub fn has_flush(&self) -> bool {
        self.has_flush
    }

    /// Slots that can be in flight at once (bounded by the queue size).
    pub fn depth(&self) -> usize {
        DEPTH.min(self.queue.size() as usize / 3)
    }

    /// The data buffer of `slot` (< DEPTH).
    pub fn buffer(&mut self, slot: usize) -> &mut [u8; BLOCK_SIZE] {
        assert!(slot < DEPTH);
        // SAFETY: slot < DEPTH, so the buffer lies in `data`, which this
        // driver owns; `&mut self` keeps the borrow unique. The device only
        // touches it while a request of this slot is in flight, and callers
        // use a slot's buffer only when it is idle.
        unsafe { &mut *((self.data + (slot * BLOCK_SIZE) as u64) as *mut [u8; BLOCK_SIZE]) }
    }

    /// Queues a request on `slot` for the block at 4 KiB index `block`
    /// (ignored for flushes). Call `kick` after a batch.
    pub fn submit(&mut self, slot: usize, op: Op, block: u64) -> bool {
        assert!(slot < DEPTH);
        let header = self.meta + 32 * slot as u64;
        let status = header + 16;
        let kind = match op {
            Op::Read => T_IN,
            Op::Write => T_OUT,
            Op::Flush => T_FLUSH,
        };
        let sector = if op == Op::Flush {
            0
        } else {
            block * SECTORS_PER_BLOCK
        };
        // SAFETY: the header (16 bytes) and status byte of this slot lie in
        // the `meta` page this driver owns; the slot is idle.
        unsafe {
            core::ptr::write_volatile(header as *mut u32, kind);
            core::ptr::write_volatile((header + 4) as *mut u32, 0);
            core::ptr::write_volatile((header + 8) as *mut u64, sector);
            core::ptr::write_volatile(status as *mut u8, STATUS_PENDING);
        }
        let hdr = Buf {
            addr: header,
            len: 16,
            device_writes: false,
        };
        let st = Buf {
            addr: status,
            len: 1,
            device_writes: true,
        };
        let data = Buf {
            addr: self.data + (slot * BLOCK_SIZE) as u64,
            len: BLOCK_SIZE as u32,
            device_writes: op == Op::Read,
        };
        let head = match op {
            Op::Flush => self.queue.add(&[hdr, st]),
            _ => self.queue.add(&[hdr, data, st]),
        };
        match head {
            Some(h) => {
                self.head_slot[h as usize % 256] = slot as u8;
                true
            }
            None => false,
        }
    }

    pub fn kick(&mut self) {
        self.queue.kick(&self.transport);
    }

    /// One completed request: its slot and status (0 = OK).
    pub fn poll(&mut self) -> Option<(usize, u8)> {
        let (head, _len) = self.queue.pop_used()?;
        let slot = self.head_slot[head as usize % 256] as usize;
        let status = self.meta + 32 * slot as u64 + 16;
        // SAFETY: the status byte of a slot inside the `meta` page.
        let s = unsafe { core::ptr::read_volatile(status as *const u8) };
        Some((slot, s))
    }
}
