//! virtio-net (device ID 1): one receive and one transmit queue in front of a
//! [`Tap`].
//!
//! No offloads are offered, so every frame crosses whole and checksummed and
//! the 12-byte virtio-net header carries nothing but `num_buffers` = 1 on
//! receive. The transmit queue is the device's output queue (see
//! [`crate::output`]): the event loop serves it through
//! [`VirtioDevice::serve_outputs_until`] once the output gate released the
//! frames the guest had published. Receive runs
//! in `backend_ready` (TAP readable; register [`VirtioDevice::backend_fd`]
//! **edge-triggered**) and in `queue_notified(0)` (new receive buffers): it reads
//! frames until the TAP is empty or the guest has no buffer left; a frame that
//! finds no buffer stays pending until the next `queue_notified(0)` (the TAP
//! then stays readable, hence edge-triggered). Frames that arrive before the
//! driver activated the device are dropped and counted.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use tracing::{debug, info, warn};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::block::request::{RawDesc, MAX_DESCRIPTORS};
use super::tap::{Tap, VNET_HDR_LEN};
use super::{
    read_config_space, Activation, DeviceCounters, PendingOutputs, QueueProgress, QueueView,
    VirtioDevice, VirtioError, VirtioInterrupt, FEATURE_VERSION_1, TYPE_NET,
};
use crate::memory::GuestMemoryMmap;

/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the receive queue.
pub const RX_QUEUE: usize = 0;
/// Index of the transmit queue.
pub const TX_QUEUE: usize = 1;
/// Largest Ethernet frame (with VLAN tag) plus the virtio-net header: 64 KiB
/// frames are only possible with offloads we do not offer, but the bound is
/// cheap.
pub const MAX_FRAME_WITH_HEADER: usize = 65562;
/// Most frames dropped in one call while the device is not activated.
const RX_DRAIN_LIMIT: usize = 4096;
/// Ethernet header length: shorter frames are malformed.
const ETH_HLEN: usize = 14;

/// Feature bits (virtio 1.2, 5.1.3).
pub mod features {
    /// The device has a MAC address in config space.
    pub const MAC: u64 = 1 << 5;
    /// The config space has a link status field.
    pub const STATUS: u64 = 1 << 16;
}

/// Link status bit in config space.
const LINK_UP: u16 = 1;

/// Why a transmit or receive chain was not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// No descriptors.
    #[error("empty descriptor chain")]
    Empty,
    /// More than the queue size.
    #[error("descriptor chain too long")]
    TooLong,
    /// Loop, bad next index or unreadable table.
    #[error("descriptor chain is cut short")]
    Truncated,
    /// A descriptor in the wrong direction.
    #[error("descriptor in the wrong direction")]
    WrongDirection,
    /// A buffer outside guest memory.
    #[error("buffer {addr:#x}+{len} is outside guest memory")]
    OutOfMemory {
        /// Address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// Frame (with header) shorter than a header plus an Ethernet header.
    #[error("frame of {0} bytes is too short")]
    TooShort(usize),
    /// Frame (with header) longer than [`MAX_FRAME_WITH_HEADER`].
    #[error("frame of more than {MAX_FRAME_WITH_HEADER} bytes")]
    TooLarge,
    /// The receive buffer cannot hold the frame.
    #[error("receive buffer of {buffer} bytes is smaller than the {frame}-byte frame")]
    BufferTooSmall {
        /// Buffer bytes.
        buffer: u64,
        /// Frame bytes (with header).
        frame: usize,
    },
    /// Guest memory access failed.
    #[error("guest memory access failed")]
    Memory,
}

/// Checks a chain's shape: every descriptor `writable` or not, inside guest
/// memory, not cut short. Returns the (addr, len) segments.
fn segments(
    mem: &GuestMemoryMmap,
    descs: impl IntoIterator<Item = RawDesc>,
    writable: bool,
) -> Result<Vec<(GuestAddress, u32)>, FrameError> {
    let mut out = Vec::new();
    let mut last = None;
    for d in descs {
        if out.len() >= MAX_DESCRIPTORS {
            return Err(FrameError::TooLong);
        }
        if d.write != writable {
            return Err(FrameError::WrongDirection);
        }
        if !mem.check_range(GuestAddress(d.addr), d.len as usize) {
            return Err(FrameError::OutOfMemory {
                addr: d.addr,
                len: d.len,
            });
        }
        out.push((GuestAddress(d.addr), d.len));
        last = Some(d);
    }
    match last {
        None => Err(FrameError::Empty),
        Some(d) if d.has_next => Err(FrameError::Truncated),
        Some(_) => Ok(out),
    }
}

/// Gathers a transmit chain (header + frame, all device-readable) into `buf`
/// and returns its length. Pure: reads guest memory only.
pub fn gather_tx_frame(
    mem: &GuestMemoryMmap,
    descs: impl IntoIterator<Item = RawDesc>,
    buf: &mut Vec<u8>,
) -> Result<usize, FrameError> {
    let segs = segments(mem, descs, false)?;
    let total: u64 = segs.iter().map(|s| u64::from(s.1)).sum();
    if total > MAX_FRAME_WITH_HEADER as u64 {
        return Err(FrameError::TooLarge);
    }
    let total = total as usize;
    if total < VNET_HDR_LEN + ETH_HLEN {
        return Err(FrameError::TooShort(total));
    }
    buf.clear();
    buf.resize(total, 0);
    let mut off = 0;
    for (addr, len) in segs {
        let len = len as usize;
        mem.read_slice(&mut buf[off..off + len], addr)
            .map_err(|_| FrameError::Memory)?;
        off += len;
    }
    Ok(total)
}

/// Scatters a received `frame` (header included) into a receive chain (all
/// device-writable). Returns the bytes written.
pub fn scatter_rx_frame(
    mem: &GuestMemoryMmap,
    descs: impl IntoIterator<Item = RawDesc>,
    frame: &[u8],
) -> Result<u32, FrameError> {
    let segs = segments(mem, descs, true)?;
    let total: u64 = segs.iter().map(|s| u64::from(s.1)).sum();
    if total < frame.len() as u64 {
        return Err(FrameError::BufferTooSmall {
            buffer: total,
            frame: frame.len(),
        });
    }
    let mut off = 0;
    for (addr, len) in segs {
        if off == frame.len() {
            break;
        }
        let n = (len as usize).min(frame.len() - off);
        mem.write_slice(&frame[off..off + n], addr)
            .map_err(|_| FrameError::Memory)?;
        off += n;
    }
    u32::try_from(frame.len()).map_err(|_| FrameError::TooLarge)
}

struct ActiveQueues {
    mem: GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
    interrupt: Arc<dyn VirtioInterrupt>,
}

/// A virtio-net device.
pub struct Net {
    name: String,
    tap: Tap,
    config: [u8; 10],
    active: Option<ActiveQueues>,
    counters: DeviceCounters,
    /// Frame read from the TAP that still needs a receive buffer.
    rx_frame: Vec<u8>,
    rx_pending: Option<usize>,
    tx_buf: Vec<u8>,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("name", &self.name)
            .field("tap", &self.tap.name())
            .field("activated", &self.active.is_some())
            .finish()
    }
}

impl Net {
    /// A network device named `name`, with MAC address `mac`, on `tap`.
    pub fn new(name: impl Into<String>, tap: Tap, mac: [u8; 6]) -> Self {
        let mut config = [0u8; 10];
        config[..6].copy_from_slice(&mac);
        config[6..8].copy_from_slice(&LINK_UP.to_le_bytes());
        config[8..10].copy_from_slice(&1u16.to_le_bytes());
        Net {
            name: name.into(),
            tap,
            config,
            active: None,
            counters: DeviceCounters::default(),
            rx_frame: vec![0; MAX_FRAME_WITH_HEADER],
            rx_pending: None,
            tx_buf: Vec::new(),
        }
    }

    /// The TAP interface's name.
    pub fn tap_name(&self) -> &str {
        self.tap.name()
    }

    /// Whether a received frame is waiting for a guest buffer.
    pub fn rx_pending(&self) -> bool {
        self.rx_pending.is_some()
    }

    /// Transmits the frames before avail index `limit` (all of them for
    /// `None`); returns how many chains were served.
    fn process_tx(&mut self, limit: Option<u16>) -> u16 {
        let Some(mut a) = self.active.take() else {
            return 0;
        };
        let mut used_any = false;
        let mut served = 0u16;
        while limit != Some(a.tx.next_avail()) {
            let Some(chain) = a.tx.pop_descriptor_chain(&a.mem) else {
                break;
            };
            served = served.wrapping_add(1);
            let head = chain.head_index();
            match gather_tx_frame(&a.mem, chain.map(RawDesc::from), &mut self.tx_buf) {
                Ok(len) => self.transmit(len),
                Err(e) => {
                    debug!(device = %self.name, error = %e, "virtio-net: rejected tx chain");
                    self.counters.bad_descriptors += 1;
                }
            }
            if let Err(e) = a.tx.add_used(&a.mem, head, 0) {
                debug!(device = %self.name, error = %e, "virtio-net: cannot add used tx entry");
                self.counters.bad_descriptors += 1;
            }
            used_any = true;
        }
        if used_any && a.tx.needs_notification(&a.mem).unwrap_or(true) {
            a.interrupt.signal_used_queue();
        }
        self.active = Some(a);
        served
    }

    fn transmit(&mut self, len: usize) {
        // No offloads were negotiated: whatever the guest put in the header, the
        // TAP must not act on it.
        self.tx_buf[..VNET_HDR_LEN].fill(0);
        let frame_len = len - VNET_HDR_LEN;
        match self.tap.write(&self.tx_buf[..len]) {
            Ok(_) => {
                self.counters.requests += 1;
                self.counters.bytes_out += frame_len as u64;
            }
            Err(e) => {
                debug!(device = %self.name, error = %e, "virtio-net: TAP write failed, frame dropped");
                self.counters.errors += 1;
            }
        }
    }

    /// Before the driver is ready, frames have nowhere to go: drop them (as a
    /// NIC without a driver does) rather than leave the TAP readable.
    fn drop_rx_frames(&mut self) {
        for _ in 0..RX_DRAIN_LIMIT {
            match self.tap.read(&mut self.rx_frame) {
                Ok(_) => self.counters.errors += 1,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }

    /// Moves frames from the TAP into receive buffers until one side runs dry.
    fn process_rx(&mut self) {
        let Some(mut a) = self.active.take() else {
            self.drop_rx_frames();
            return;
        };
        let mut used_any = false;
        loop {
            let len = match self.rx_pending {
                Some(len) => len,
                None => match self.tap.read(&mut self.rx_frame) {
                    Ok(len) if len < VNET_HDR_LEN + ETH_HLEN => {
                        self.counters.errors += 1;
                        continue;
                    }
                    Ok(len) => {
                        // Only num_buffers means anything without offloads.
                        self.rx_frame[..VNET_HDR_LEN - 2].fill(0);
                        self.rx_frame[VNET_HDR_LEN - 2..VNET_HDR_LEN]
                            .copy_from_slice(&1u16.to_le_bytes());
                        self.rx_pending = Some(len);
                        len
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        warn!(device = %self.name, error = %e, "virtio-net: TAP read failed");
                        self.counters.errors += 1;
                        break;
                    }
                },
            };
            let Some(chain) = a.rx.pop_descriptor_chain(&a.mem) else {
                // No buffer: keep the frame for the next queue_notified(0).
                break;
            };
            let head = chain.head_index();
            match scatter_rx_frame(&a.mem, chain.map(RawDesc::from), &self.rx_frame[..len]) {
                Ok(written) => {
                    self.rx_pending = None;
                    self.counters.requests += 1;
                    self.counters.bytes_in += (len - VNET_HDR_LEN) as u64;
                    if let Err(e) = a.rx.add_used(&a.mem, head, written) {
                        debug!(device = %self.name, error = %e, "virtio-net: cannot add used rx entry");
                    }
                    used_any = true;
                }
                Err(FrameError::BufferTooSmall { buffer, frame }) => {
                    // The frame cannot be delivered: drop it, keep the buffer.
                    debug!(device = %self.name, buffer, frame, "virtio-net: rx frame larger than buffer, dropped");
                    self.rx_pending = None;
                    self.counters.errors += 1;
                    a.rx.go_to_previous_position();
                }
                Err(e) => {
                    // A malformed buffer: return it unused, the frame waits for the next.
                    debug!(device = %self.name, error = %e, "virtio-net: rejected rx chain");
                    self.counters.bad_descriptors += 1;
                    if a.rx.add_used(&a.mem, head, 0).is_ok() {
                        used_any = true;
                    }
                }
            }
        }
        if used_any && a.rx.needs_notification(&a.mem).unwrap_or(true) {
            a.interrupt.signal_used_queue();
        }
        self.active = Some(a);
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        FEATURE_VERSION_1 | features::MAC | features::STATUS
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config, offset, data);
    }

    fn activate(&mut self, mut activation: Activation) -> Result<(), VirtioError> {
        let [rx, tx] = activation.take_queues()?;
        let Activation {
            mem,
            interrupt,
            acked_features,
            ..
        } = activation;
        info!(device = %self.name, tap = %self.tap.name(), features = acked_features, "virtio-net activated");
        self.active = Some(ActiveQueues {
            mem,
            rx,
            tx,
            interrupt,
        });
        Ok(())
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn queue_notified(&mut self, index: usize) {
        match index {
            RX_QUEUE => self.process_rx(),
            TX_QUEUE => {
                self.process_tx(None);
            }
            _ => {}
        }
    }

    fn output_queue(&self) -> Option<usize> {
        Some(TX_QUEUE)
    }

    fn pending_outputs(&self) -> Option<PendingOutputs> {
        let a = self.active.as_ref()?;
        PendingOutputs::of(&a.tx, &a.mem)
    }

    fn serve_outputs_until(&mut self, limit: u16) -> u16 {
        self.process_tx(Some(limit))
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.tap.as_raw_fd())
    }

    fn backend_ready(&mut self) {
        self.process_rx();
    }

    fn release_backend(&mut self) -> std::io::Result<Option<std::fs::File>> {
        self.tap.take_file().map(Some)
    }

    fn reset(&mut self) {
        self.active = None;
        self.rx_pending = None;
    }

    fn counters(&self) -> DeviceCounters {
        self.counters.clone()
    }

    fn queue_views(&self) -> Vec<QueueView> {
        self.active
            .as_ref()
            .map(|a| vec![QueueView::of(&a.rx, &a.mem), QueueView::of(&a.tx, &a.mem)])
            .unwrap_or_default()
    }

    fn queue_progress(&self) -> Vec<QueueProgress> {
        self.active
            .as_ref()
            .map(|a| {
                [&a.rx, &a.tx]
                    .iter()
                    .map(|q| QueueProgress::of(q))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
