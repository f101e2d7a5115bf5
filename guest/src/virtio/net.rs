//! virtio-net driver, polled, as a smoltcp `Device`.
//!
//! Receive buffers (2 KiB each) stay posted on queue 0; frames to send are
//! copied into 2 KiB buffers on queue 1. Notifications are batched: the
//! stack calls `flush` once per poll.

use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

use super::mmio::MmioTransport;
use super::queue::{Buf, Virtqueue};
use super::{VirtioError, F_EVENT_IDX};

const F_MAC: u64 = 1 << 5;
/// struct virtio_net_hdr with num_buffers (VERSION_1 always has it).
const HDR_LEN: usize = 12;
const BUF_LEN: usize = 2048;
const QUEUE_SIZE: u16 = 256;
/// Ethernet frame without FCS.
const MTU: usize = 1514;

struct RxRing {
    queue: Virtqueue,
    bufs: u64,
    /// Buffer index of each posted chain head.
    buf_of_head: [u16; QUEUE_SIZE as usize],
    needs_kick: bool,
}

struct TxRing {
    queue: Virtqueue,
    /// The device's registers again, to kick while waiting for a buffer.
    transport: MmioTransport,
    bufs: u64,
    buf_of_head: [u16; QUEUE_SIZE as usize],
    free: [u16; QUEUE_SIZE as usize],
    nfree: usize,
    needs_kick: bool,
}

pub struct VirtioNet {
    transport: MmioTransport,
    rx: RxRing,
    tx: TxRing,
    mac: [u8; 6],
}

impl RxRing {
    fn post(&mut self, buf: u16) {
        let b = Buf {
            addr: self.bufs + (buf as usize * BUF_LEN) as u64,
            len: BUF_LEN as u32,
            device_writes: true,
        };
        if let Some(head) = self.queue.add(&[b]) {
            self.buf_of_head[head as usize] = buf;
            self.needs_kick = true;
        }
    }
}

impl TxRing {
    fn reclaim(&mut self) {
        while let Some((head, _)) = self.queue.pop_used() {
            self.free[self.nfree] = self.buf_of_head[head as usize];
            self.nfree += 1;
        }
    }
}

impl VirtioNet {
    pub fn new(transport: MmioTransport) -> Result<Self, VirtioError> {
        let features = transport.negotiate(F_MAC | F_EVENT_IDX)?;
        let event_idx = features & F_EVENT_IDX != 0;
        let rxq = Virtqueue::new(&transport, 0, QUEUE_SIZE, event_idx)?;
        let txq = Virtqueue::new(&transport, 1, QUEUE_SIZE, event_idx)?;
        let alloc = |n: u16| {
            crate::mem::alloc_phys(n as u64 * BUF_LEN as u64, 4096).ok_or(VirtioError::OutOfMemory)
        };
        let mac = if features & F_MAC != 0 {
            core::array::from_fn(|i| transport.config8(i))
        } else {
            [0x02, 0x4b, 0x4d, 0x00, 0x00, 0x01] // locally administered
        };
        let mut rx = RxRing {
            bufs: alloc(rxq.size())?,
            queue: rxq,
            buf_of_head: [0; QUEUE_SIZE as usize],
            needs_kick: false,
        };
        let mut tx = TxRing {
            bufs: alloc(txq.size())?,
            buf_of_head: [0; QUEUE_SIZE as usize],
            free: core::array::from_fn(|i| i as u16),
            nfree: txq.size() as usize,
            queue: txq,
            // SAFETY: the same register block as `transport`; both are used
            // from this driver only, one access at a time.
            transport: unsafe { MmioTransport::new(transport.base()) },
            needs_kick: false,
        };
        for i in 0..rx.queue.size() {
            rx.post(i);
        }
        tx.needs_kick = false;
        transport.driver_ok();
        let mut dev = Self {
            transport,
            rx,
            tx,
            mac,
        };
        dev.flush();
        Ok(dev)
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// Notifies the device of buffers posted since the last flush.
    pub fn flush(&mut self) {
        if self.rx.needs_kick {
            self.rx.queue.kick(&self.transport);
            self.rx.needs_kick = false;
        }
        if self.tx.needs_kick {
            self.tx.queue.kick(&self.transport);
            self.tx.needs_kick = false;
        }
    }
}

pub struct RxToken<'a> {
    ring: &'a mut RxRing,
    buf: u16,
    len: usize,
}

pub struct TxToken<'a> {
    ring: &'a mut TxRing,
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F>(self, f: F) -> R
    where
        F: FnOnce(&[u8]) -> R,
    {
        let addr = self.ring.bufs + (self.buf as usize * BUF_LEN) as u64;
        // SAFETY: the device finished writing this buffer (it is in the used
        // ring) and it is not posted again until `f` returns; len was
        // clamped to the buffer size.
        let frame = unsafe { core::slice::from_raw_parts(addr as *const u8, self.len) };
        let r = f(frame.get(HDR_LEN..).unwrap_or(&[]));
        self.ring.post(self.buf);
        r
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F>(self, len: usize, f: F) -> R
    where
        F: FnOnce(&mut [u8]) -> R,
    {
        let len = len.min(BUF_LEN - HDR_LEN);
        // `transmit` checked for a free buffer; `receive` hands out a token
        // without checking, so wait for the device to return one.
        while self.ring.nfree == 0 {
            if self.ring.needs_kick {
                self.ring.queue.kick(&self.ring.transport);
                self.ring.needs_kick = false;
            }
            self.ring.reclaim();
            core::hint::spin_loop();
        }
        self.ring.nfree -= 1;
        let buf = self.ring.free[self.ring.nfree];
        let addr = self.ring.bufs + (buf as usize * BUF_LEN) as u64;
        // SAFETY: the buffer is free (not posted to the device) and owned by
        // this ring; HDR_LEN + len <= BUF_LEN.
        let frame = unsafe { core::slice::from_raw_parts_mut(addr as *mut u8, HDR_LEN + len) };
        frame[..HDR_LEN].fill(0);
        let r = f(&mut frame[HDR_LEN..]);
        let b = Buf {
            addr,
            len: (HDR_LEN + len) as u32,
            device_writes: false,
        };
        match self.ring.queue.add(&[b]) {
            Some(head) => {
                self.ring.buf_of_head[head as usize] = buf;
                self.ring.needs_kick = true;
            }
            None => {
                // Cannot happen: one descriptor per buffer. Drop the frame.
                self.ring.free[self.ring.nfree] = buf;
                self.ring.nfree += 1;
            }
        }
        r
    }
}

impl Device for VirtioNet {
    type RxToken<'a> = RxToken<'a>;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(RxToken<'_>, TxToken<'_>)> {
        let (head, len) = self.rx.queue.pop_used()?;
        let buf = self.rx.buf_of_head[head as usize];
        Some((
            RxToken {
                ring: &mut self.rx,
                buf,
                len: (len as usize).min(BUF_LEN),
            },
            TxToken { ring: &mut self.tx },
        ))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        self.tx.reclaim();
        if self.tx.nfree == 0 {
            // Make sure the device knows about what is queued.
            self.flush();
            return None;
        }
        Some(TxToken { ring: &mut self.tx })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MTU;
        caps
    }
}
