//! virtio-pmem driver (virtio 1.2, 5.19): a window of guest-physical memory
//! backed by a host file, read and written with plain loads and stores, and
//! one request queue whose FLUSH asks the host to make the window durable.
//! One flush in flight at a time, polled.

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

use super::mmio::MmioTransport;
use super::queue::{Buf, Virtqueue};
use super::VirtioError;

/// virtio-pmem's device ID.
pub const DEVICE_ID: u32 = 27;

/// VIRTIO_PMEM_REQ_TYPE_FLUSH.
const REQ_FLUSH: u32 = 0;
/// What the driver preloads into `ret`; the device writes 0 on success.
const RET_PENDING: u32 = u32::MAX;

pub struct Pmem {
    transport: MmioTransport,
    queue: Virtqueue,
    /// Guest-physical address and length of the window (configuration
    /// space: `le64 start`, `le64 size`).
    start: u64,
    size: u64,
    /// Page holding the request (`le32 type` at 0) and its answer
    /// (`le32 ret` at 8).
    meta: u64,
    flushing: bool,
}

impl Pmem {
    pub fn new(transport: MmioTransport) -> Result<Self, VirtioError> {
        transport.negotiate(0)?;
        let start = transport.config32(0) as u64 | (transport.config32(4) as u64) << 32;
        let size = transport.config32(8) as u64 | (transport.config32(12) as u64) << 32;
        let bad = |e| {
            transport.fail();
            Err(e)
        };
        if size == 0 || !size.is_multiple_of(4096) {
            return bad(VirtioError::BadConfig("window size", size));
        }
        if !start.is_multiple_of(4096) {
            return bad(VirtioError::BadConfig(
                "window start not page aligned",
                start,
            ));
        }
        // The window is addressed through the identity map: it must lie
        // inside what the page tables map.
        match start.checked_add(size) {
            Some(end) if end <= crate::paging::mapped_limit() => {}
            _ => {
                return bad(VirtioError::BadConfig(
                    "window beyond the identity map, start",
                    start,
                ))
            }
        }
        let queue = Virtqueue::new(&transport, 0, 8, false)?;
        if queue.size() < 2 {
            return bad(VirtioError::BadQueue(0));
        }
        let meta = crate::mem::alloc_phys(4096, 4096).ok_or(VirtioError::OutOfMemory)?;
        transport.driver_ok();
        Ok(Self {
            transport,
            queue,
            start,
            size,
            meta,
            flushing: false,
        })
    }

    /// Guest-physical address of the window.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Bytes of the window.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The window, for plain loads and stores.
    pub fn window(&mut self) -> &mut [u8] {
        // SAFETY: `new` checked that [start, start + size) lies inside the
        // identity map; the VMM maps the backing file there as guest memory
        // (not RAM the allocator hands out, which comes from the memory
        // map's RAM ranges). This driver is its only user in the guest, and
        // `&mut self` keeps the borrow unique.
        unsafe { core::slice::from_raw_parts_mut(self.start as *mut u8, self.size as usize) }
    }

    /// Sends a FLUSH (the window's stores before it are ordered before
    /// it). False if one is in flight already.
    pub fn flush(&mut self) -> bool {
        if self.flushing {
            return false;
        }
        // The stores to the window happen before the request is visible.
        fence(Ordering::SeqCst);
        let ret = self.meta + 8;
        // SAFETY: both words lie in the `meta` page this driver owns; no
        // request is in flight, so the device does not touch them.
        unsafe {
            write_volatile(self.meta as *mut u32, REQ_FLUSH);
            write_volatile(ret as *mut u32, RET_PENDING);
        }
        let req = Buf {
            addr: self.meta,
            len: 4,
            device_writes: false,
        };
        let answer = Buf {
            addr: ret,
            len: 4,
            device_writes: true,
        };
        if self.queue.add(&[req, answer]).is_none() {
            return false;
        }
        self.flushing = true;
        self.queue.kick(&self.transport);
        true
    }

    /// The `ret` of the flush in flight once it completed (0 = success).
    pub fn poll(&mut self) -> Option<u32> {
        if !self.flushing {
            return None;
        }
        self.queue.pop_used()?;
        self.flushing = false;
        // SAFETY: `ret` lies in the `meta` page; the device has completed.
        Some(unsafe { read_volatile((self.meta + 8) as *const u32) })
    }
}
