//! A split virtqueue (virtio 1.2, 2.7), driver side, polled.

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

use super::mmio::MmioTransport;
use super::VirtioError;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const USED_F_NO_NOTIFY: u16 = 1;
const AVAIL_F_NO_INTERRUPT: u16 = 1;

/// One buffer of a descriptor chain.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    /// The device writes this buffer (else it reads it).
    pub device_writes: bool,
}

pub struct Virtqueue {
    index: u16,
    size: u16,
    /// Descriptor table: 16 bytes per entry.
    desc: u64,
    /// Driver ring: flags, idx, ring[size], used_event (u16 each).
    avail: u64,
    /// Device ring: flags, idx (u16), ring[size] of {id u32, len u32}.
    used: u64,
    free_head: u16,
    num_free: u16,
    next_avail: u16,
    last_used: u16,
    /// VIRTIO_F_EVENT_IDX was negotiated.
    event_idx: bool,
    /// `next_avail` when the device was last notified.
    notified_avail: u16,
}

impl Virtqueue {
    /// Allocates queue `index` with up to `want` entries and hands it to the
    /// device. With `event_idx`, notifications follow the device's
    /// `avail_event`; either way the device is asked not to interrupt (the
    /// guest polls with interrupts off).
    pub fn new(
        transport: &MmioTransport,
        index: u16,
        want: u16,
        event_idx: bool,
    ) -> Result<Self, VirtioError> {
        let max = transport.queue_max(index as u32);
        if max == 0 {
            return Err(VirtioError::BadQueue(index as u32));
        }
        let mut size = want.min(max.min(32768) as u16);
        // A power of two (required of split queues by the spec).
        size = 1 << (15 - size.leading_zeros().min(15));
        let n = size as u64;
        let desc_bytes = 16 * n;
        let avail_bytes = 6 + 2 * n;
        let used_off = (desc_bytes + avail_bytes).next_multiple_of(4);
        let total = used_off + 6 + 8 * n;
        let base = crate::mem::alloc_phys(total, 4096).ok_or(VirtioError::OutOfMemory)?;
        // SAFETY: [base, base + total) is fresh RAM owned by this queue.
        unsafe { core::ptr::write_bytes(base as *mut u8, 0, total as usize) };
        let q = Self {
            index,
            size,
            desc: base,
            avail: base + desc_bytes,
            used: base + used_off,
            free_head: 0,
            num_free: size,
            next_avail: 0,
            last_used: 0,
            event_idx,
            notified_avail: 0,
        };
        for i in 0..size {
            q.set_desc(i, 0, 0, 0, i.wrapping_add(1));
        }
        // SAFETY: avail.flags and used_event lie inside the driver ring.
        unsafe {
            write_volatile(q.avail as *mut u16, AVAIL_F_NO_INTERRUPT);
            // With EVENT_IDX the flag is ignored: ask for an interrupt only
            // when the used index crosses 0x7fff (once per 65536 uses).
            write_volatile((q.avail + 4 + 2 * n) as *mut u16, 0x7fff);
        }
        transport.setup_queue(index as u32, size, q.desc, q.avail, q.used);
        Ok(q)
    }

    pub fn size(&self) -> u16 {
        self.size
    }

    fn set_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * i as u64;
        // SAFETY: i < size, so d is a descriptor inside this queue's table.
        unsafe {
            write_volatile(d as *mut u64, addr);
            write_volatile((d + 8) as *mut u32, len);
            write_volatile((d + 12) as *mut u16, flags);
            write_volatile((d + 14) as *mut u16, next);
        }
    }

    fn desc_flags_next(&self, i: u16) -> (u16, u16) {
        let d = self.desc + 16 * (i % self.size) as u64;
        // SAFETY: the index is reduced modulo size: inside the table.
        unsafe {
            (
                read_volatile((d + 12) as *const u16),
                read_volatile((d + 14) as *const u16),
            )
        }
    }

    /// Makes a descriptor chain of `bufs` available to the device. Returns
    /// its head (the id `pop_used` reports), or `None` when the queue is full.
    pub fn add(&mut self, bufs: &[Buf]) -> Option<u16> {
        if bufs.is_empty() || bufs.len() > self.num_free as usize {
            return None;
        }
        let head = self.free_head;
        let mut i = head;
        for (k, b) in bufs.iter().enumerate() {
            // Free descriptors are linked through `next`: the chain reuses
            // those links.
            let (_, next) = self.desc_flags_next(i);
            let mut flags = if b.device_writes { DESC_F_WRITE } else { 0 };
            if k + 1 < bufs.len() {
                flags |= DESC_F_NEXT;
            }
            self.set_desc(i, b.addr, b.len, flags, next);
            if k + 1 == bufs.len() {
                self.free_head = next;
            }
            i = next;
        }
        self.num_free -= bufs.len() as u16;
        let slot = (self.next_avail % self.size) as u64;
        // SAFETY: the ring slot and idx lie inside this queue's driver ring.
        unsafe {
            write_volatile((self.avail + 4 + 2 * slot) as *mut u16, head);
            fence(Ordering::Release);
            self.next_avail = self.next_avail.wrapping_add(1);
            write_volatile((self.avail + 2) as *mut u16, self.next_avail);
        }
        Some(head)
    }

    /// Notifies the device of new buffers unless it said it does not need
    /// it (EVENT_IDX's `avail_event`, else the NO_NOTIFY flag).
    pub fn kick(&mut self, transport: &MmioTransport) {
        fence(Ordering::SeqCst);
        let new = self.next_avail;
        let old = core::mem::replace(&mut self.notified_avail, new);
        let needed = if self.event_idx {
            // SAFETY: avail_event follows the used ring's elements, inside
            // this queue's device ring.
            let event =
                unsafe { read_volatile((self.used + 4 + 8 * self.size as u64) as *const u16) };
            // The spec's vring_need_event: did `event` fall in [old, new)?
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            // SAFETY: used.flags is the first field of the device ring.
            let flags = unsafe { read_volatile(self.used as *const u16) };
            new != old && flags & USED_F_NO_NOTIFY == 0
        };
        if needed {
            transport.notify(self.index);
        }
    }

    /// Takes one completed chain: its head and the bytes the device wrote.
    pub fn pop_used(&mut self) -> Option<(u16, u32)> {
        // SAFETY: used.idx is inside this queue's device ring.
        let used_idx = unsafe { read_volatile((self.used + 2) as *const u16) };
        if used_idx == self.last_used {
            return None;
        }
        fence(Ordering::Acquire);
        let elem = self.used + 4 + 8 * (self.last_used % self.size) as u64;
        // SAFETY: the element is inside the device ring (index modulo size).
        let (id, len) = unsafe {
            (
                read_volatile(elem as *const u32),
                read_volatile((elem + 4) as *const u32),
            )
        };
        self.last_used = self.last_used.wrapping_add(1);
        let head = (id % self.size as u32) as u16;
        // Return the chain to the free list.
        let mut last = head;
        let mut count = 1;
        loop {
            let (flags, next) = self.desc_flags_next(last);
            if flags & DESC_F_NEXT == 0 || count >= self.size {
                break;
            }
            last = next % self.size;
            count += 1;
        }
        let (flags, _) = self.desc_flags_next(last);
        self.set_desc(last, 0, 0, flags & !DESC_F_NEXT, self.free_head);
        self.free_head = head;
        self.num_free += count;
        Some((head, len))
    }
}
