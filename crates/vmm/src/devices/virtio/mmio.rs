//! The virtio-mmio transport, version 2 (virtio spec 1.2, section 4.2.2).
//!
//! One [`MmioTransport`] serves one device window of
//! [`layout::VIRTIO_MMIO_SIZE`](crate::layout::VIRTIO_MMIO_SIZE) bytes. The VMM
//! forwards MMIO exits in that window to [`MmioTransport::read`] /
//! [`MmioTransport::write`], registers the `irq` EventFd given to
//! [`MmioTransport::new`] as a KVM irqfd for the device's GSI, and for each queue
//! `i < num_queues()` registers an ioeventfd at
//! `base + queue_notify_address_offset()` (4 bytes, datamatch `i`) whose
//! readiness it turns into `device.queue_notified(i)`. A QueueNotify write that
//! still reaches [`MmioTransport::write`] is delivered directly.
//!
//! Registers are 32 bits wide and must be accessed with aligned 4-byte accesses;
//! other accesses to them are ignored (writes) or read as zero. The device
//! configuration space at 0x100 accepts any width.
//!
//! Locking: the device's mutex is also held by the event-loop thread while it
//! serves a queue, which includes waiting in the output gate (that may pause
//! the vCPUs). So the hot paths of a vCPU exit — InterruptStatus, InterruptACK,
//! and reads of the configuration space (served from a cache refreshed when the
//! device signals a configuration change) — never take the device's mutex. Only
//! status writes (activation, reset), config writes and QueueNotify writes that
//! bypass the ioeventfd do.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{debug, info, warn};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{Activation, VirtioDevice, VirtioInterrupt, FEATURE_VERSION_1};
use crate::memory::GuestMemoryMmap;

/// "virt" in little endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// The transport version we implement (the modern, non-legacy layout).
pub const MMIO_VERSION: u32 = 2;
/// Vendor ID reported to the driver.
pub const MMIO_VENDOR_ID: u32 = 0;

/// Offset of the QueueNotify register within the device window.
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;
/// Start of the device-specific configuration space.
pub const CONFIG_SPACE_OFFSET: u64 = 0x100;

/// InterruptStatus bit: a queue has new used buffers.
pub const INT_USED_RING: u32 = 1;
/// InterruptStatus bit: the configuration changed (or the device needs a reset).
pub const INT_CONFIG: u32 = 2;

/// Device status bits (virtio spec 2.1).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u32 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u32 = 2;
    /// The driver is ready: queues are live.
    pub const DRIVER_OK: u32 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u32 = 8;
    /// The device hit an error it cannot recover from without a reset.
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u32 = 0x80;
}

/// VIRTIO_RING_F_EVENT_IDX.
const FEATURE_EVENT_IDX: u64 = 1 << 29;

mod reg {
    pub const MAGIC: u64 = 0x00;
    pub const VERSION: u64 = 0x04;
    pub const DEVICE_ID: u64 = 0x08;
    pub const VENDOR_ID: u64 = 0x0c;
    pub const DEVICE_FEATURES: u64 = 0x10;
    pub const DEVICE_FEATURES_SEL: u64 = 0x14;
    pub const DRIVER_FEATURES: u64 = 0x20;
    pub const DRIVER_FEATURES_SEL: u64 = 0x24;
    pub const QUEUE_SEL: u64 = 0x30;
    pub const QUEUE_NUM_MAX: u64 = 0x34;
    pub const QUEUE_NUM: u64 = 0x38;
    pub const QUEUE_READY: u64 = 0x44;
    pub const QUEUE_NOTIFY: u64 = 0x50;
    pub const INTERRUPT_STATUS: u64 = 0x60;
    pub const INTERRUPT_ACK: u64 = 0x64;
    pub const STATUS: u64 = 0x70;
    pub const QUEUE_DESC_LOW: u64 = 0x80;
    pub const QUEUE_DESC_HIGH: u64 = 0x84;
    pub const QUEUE_DRIVER_LOW: u64 = 0x90;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x94;
    pub const QUEUE_DEVICE_LOW: u64 = 0xa0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0xa4;
    pub const SHM_LEN_LOW: u64 = 0xb0;
    pub const SHM_LEN_HIGH: u64 = 0xb4;
    pub const SHM_BASE_LOW: u64 = 0xb8;
    pub const SHM_BASE_HIGH: u64 = 0xbc;
    pub const CONFIG_GENERATION: u64 = 0xfc;
}

/// Errors of the transport.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    /// Saved state belongs to another kind of device.
    #[error("saved transport state is for device type {saved}, device is type {actual}")]
    DeviceType {
        /// Type in the state.
        saved: u32,
        /// Type of the device given to restore.
        actual: u32,
    },
    /// Saved state has a different number of queues.
    #[error("saved transport state has {saved} queues, device has {actual}")]
    QueueCount {
        /// Queues in the state.
        saved: usize,
        /// Queues of the device.
        actual: usize,
    },
    /// A saved queue is inconsistent.
    #[error("saved queue {index} is invalid: {reason}")]
    InvalidQueue {
        /// Queue index.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The device refused to activate with the restored queues.
    #[error("cannot re-activate {device} from saved state")]
    Activate {
        /// Device name.
        device: String,
        /// The cause.
        #[source]
        source: super::VirtioError,
    },
}

/// The interrupt line of one transport: InterruptStatus plus the irqfd.
struct MmioInterrupt {
    status: AtomicU32,
    irq: EventFd,
    /// The device changed its configuration: the transport's cache is stale.
    config_stale: AtomicBool,
}

impl MmioInterrupt {
    fn raise(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irq.write(1) {
            warn!(error = %e, "virtio-mmio: cannot signal irqfd");
        }
    }
}

impl VirtioInterrupt for MmioInterrupt {
    fn signal_used_queue(&self) {
        self.raise(INT_USED_RING);
    }

    fn signal_config_change(&self) {
        self.config_stale.store(true, Ordering::SeqCst);
        self.raise(INT_CONFIG);
    }
}

/// The virtio-mmio v2 register file in front of one device.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemoryMmap,
    interrupt: Arc<MmioInterrupt>,
    name: String,
    device_type: u32,
    device_features: u64,
    queues: Vec<Queue>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    config_generation: u32,
    config_cache: Box<[u8; CONFIG_CACHE_LEN]>,
}

/// Bytes of configuration space served from the transport's cache; accesses
/// beyond go to the device.
const CONFIG_CACHE_LEN: usize = 256;

fn lock<'a>(
    device: &'a Mutex<dyn VirtioDevice + 'static>,
) -> MutexGuard<'a, dyn VirtioDevice + 'static> {
    device.lock().unwrap_or_else(|e| e.into_inner())
}

fn new_queues(max_sizes: &[u16], name: &str) -> Vec<Queue> {
    max_sizes
        .iter()
        .filter_map(|&max| match Queue::new(max) {
            Ok(q) => Some(q),
            Err(e) => {
                // A device bug, not a guest error: the queue is left out and
                // activation will fail with a clear message.
                warn!(device = name, max, error = %e, "invalid queue maximum size");
                None
            }
        })
        .collect()
}

impl MmioTransport {
    /// A transport for `device`, raising interrupts on `irq`.
    pub fn new(device: Arc<Mutex<dyn VirtioDevice>>, mem: GuestMemoryMmap, irq: EventFd) -> Self {
        let mut config_cache = Box::new([0u8; CONFIG_CACHE_LEN]);
        let (name, device_type, device_features, queues) = {
            let d = lock(&device);
            let name = d.name().to_owned();
            let queues = new_queues(d.queue_max_sizes(), &name);
            d.read_config(0, &mut config_cache[..]);
            (name, d.device_type(), d.features(), queues)
        };
        MmioTransport {
            device,
            mem,
            interrupt: Arc::new(MmioInterrupt {
                status: AtomicU32::new(0),
                irq,
                config_stale: AtomicBool::new(false),
            }),
            name,
            device_type,
            device_features,
            queues,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            config_generation: 0,
            config_cache,
        }
    }

    /// The device behind the transport.
    pub fn device(&self) -> Arc<Mutex<dyn VirtioDevice>> {
        self.device.clone()
    }

    /// Offset of QueueNotify in the window: register one ioeventfd there per
    /// queue, 4 bytes wide, with datamatch = queue index.
    pub fn queue_notify_address_offset() -> u64 {
        QUEUE_NOTIFY_OFFSET
    }

    /// Number of queues of the device.
    pub fn num_queues(&self) -> usize {
        self.queues.len()
    }

    /// Current device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Current InterruptStatus register.
    pub fn interrupt_status(&self) -> u32 {
        self.interrupt.status.load(Ordering::SeqCst)
    }

    /// Features the driver accepted (valid once FEATURES_OK is set).
    pub fn acked_features(&self) -> u64 {
        self.driver_features
    }

    /// Handles a guest read of `data.len()` bytes at `offset` in the window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.read_config(offset - CONFIG_SPACE_OFFSET, data);
            return;
        }
        let value = if data.len() == 4 && offset.is_multiple_of(4) {
            self.read_register(offset)
        } else {
            debug!(device = %self.name, offset, len = data.len(), "virtio-mmio: bad read size");
            0
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(4);
        data[..n].copy_from_slice(&bytes[..n]);
        data[n..].fill(0);
    }

    /// Handles a guest write of `data` at `offset` in the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            let mut d = lock(&self.device);
            d.write_config(offset - CONFIG_SPACE_OFFSET, data);
            d.read_config(0, &mut self.config_cache[..]);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            debug!(device = %self.name, offset, len = data.len(), "virtio-mmio: bad write size");
            return;
        };
        if !offset.is_multiple_of(4) {
            return;
        }
        self.write_register(offset, u32::from_le_bytes(bytes));
    }

    fn read_config(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if self.interrupt.config_stale.load(Ordering::SeqCst) {
            // Refresh if the device is idle; otherwise serve the old bytes
            // and try again on the next read.
            if let Ok(d) = self.device.try_lock() {
                self.interrupt.config_stale.store(false, Ordering::SeqCst);
                d.read_config(0, &mut self.config_cache[..]);
                self.config_generation = self.config_generation.wrapping_add(1);
            }
        }
        let cached = usize::try_from(offset)
            .ok()
            .and_then(|start| Some((start, start.checked_add(data.len())?)))
            .and_then(|(start, end)| self.config_cache.get(start..end));
        match cached {
            Some(bytes) => data.copy_from_slice(bytes),
            None => lock(&self.device).read_config(offset, data),
        }
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    fn read_register(&self, offset: u64) -> u32 {
        match offset {
            reg::MAGIC => MMIO_MAGIC,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device_type,
            reg::VENDOR_ID => MMIO_VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device_features as u32,
                1 => (self.device_features >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt_status(),
            reg::STATUS => self.status,
            // No shared memory regions: their length reads as -1.
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH => u32::MAX,
            reg::SHM_BASE_LOW | reg::SHM_BASE_HIGH => u32::MAX,
            reg::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    /// Whether the driver may still change the queue registers.
    fn queue_setup_allowed(&self) -> bool {
        self.status & (status::DRIVER_OK | status::FAILED) == 0
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = value,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            reg::DRIVER_FEATURES => {
                if self.status & status::DRIVER == 0 || self.status & status::FEATURES_OK != 0 {
                    debug!(device = %self.name, "virtio-mmio: feature write outside negotiation");
                    return;
                }
                match self.driver_features_sel {
                    0 => {
                        self.driver_features =
                            (self.driver_features & !0xffff_ffff) | u64::from(value)
                    }
                    1 => {
                        self.driver_features =
                            (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
                    }
                    _ => {}
                }
            }
            reg::QUEUE_SEL => self.queue_sel = value,
            reg::QUEUE_NOTIFY => self.queue_notify(value),
            reg::INTERRUPT_ACK => {
                self.interrupt.status.fetch_and(!value, Ordering::SeqCst);
            }
            reg::STATUS => self.write_status(value),
            reg::QUEUE_NUM
            | reg::QUEUE_READY
            | reg::QUEUE_DESC_LOW
            | reg::QUEUE_DESC_HIGH
            | reg::QUEUE_DRIVER_LOW
            | reg::QUEUE_DRIVER_HIGH
            | reg::QUEUE_DEVICE_LOW
            | reg::QUEUE_DEVICE_HIGH => self.write_queue_register(offset, value),
            _ => debug!(device = %self.name, offset, "virtio-mmio: write to unknown register"),
        }
    }

    fn write_queue_register(&mut self, offset: u64, value: u32) {
        if !self.queue_setup_allowed() {
            debug!(device = %self.name, offset, "virtio-mmio: queue write while live");
            return;
        }
        let Some(q) = self.queues.get_mut(self.queue_sel as usize) else {
            return;
        };
        // The spec forbids changing a ready queue's layout; only QueueReady may
        // be written then.
        if q.ready() && offset != reg::QUEUE_READY {
            return;
        }
        match offset {
            reg::QUEUE_NUM => match u16::try_from(value) {
                Ok(size) => q.set_size(size),
                Err(_) => debug!(device = %self.name, value, "virtio-mmio: queue size too large"),
            },
            reg::QUEUE_READY => q.set_ready(value == 1),
            reg::QUEUE_DESC_LOW => q.set_desc_table_address(Some(value), None),
            reg::QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(value)),
            reg::QUEUE_DRIVER_LOW => q.set_avail_ring_address(Some(value), None),
            reg::QUEUE_DRIVER_HIGH => q.set_avail_ring_address(None, Some(value)),
            reg::QUEUE_DEVICE_LOW => q.set_used_ring_address(Some(value), None),
            reg::QUEUE_DEVICE_HIGH => q.set_used_ring_address(None, Some(value)),
            _ => {}
        }
    }

    fn queue_notify(&mut self, value: u32) {
        let index = value as usize;
        if index >= self.queues.len() {
            debug!(device = %self.name, index, "virtio-mmio: notify of unknown queue");
            return;
        }
        let mut device = lock(&self.device);
        if device.is_activated() {
            device.queue_notified(index);
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        // The driver only ever adds bits (clearing happens through reset);
        // DEVICE_NEEDS_RESET is ours, the driver may or may not echo it.
        let driver_bits = old & !status::DEVICE_NEEDS_RESET;
        if value & driver_bits != driver_bits {
            debug!(device = %self.name, old, new = value, "virtio-mmio: driver cleared status bits");
            return;
        }
        let added = value & !old;
        let mut new = value & !status::DEVICE_NEEDS_RESET | (old & status::DEVICE_NEEDS_RESET);
        if added & status::FEATURES_OK != 0 && !self.features_acceptable() {
            // Leaving FEATURES_OK clear tells the driver negotiation failed.
            new &= !status::FEATURES_OK;
        }
        if added & status::DRIVER_OK != 0 {
            if new & status::FEATURES_OK == 0 {
                warn!(device = %self.name, "virtio-mmio: DRIVER_OK without FEATURES_OK");
                new |= status::DEVICE_NEEDS_RESET;
            } else {
                self.status = new;
                self.activate();
                return;
            }
        }
        if added & status::FAILED != 0 {
            info!(device = %self.name, "virtio driver reported failure");
        }
        self.status = new;
    }

    fn features_acceptable(&self) -> bool {
        let extra = self.driver_features & !self.device_features;
        if self.driver_features & FEATURE_VERSION_1 == 0 {
            warn!(device = %self.name, "virtio-mmio: driver did not accept VIRTIO_F_VERSION_1");
            false
        } else if extra != 0 {
            warn!(device = %self.name, extra, "virtio-mmio: driver accepted features not offered");
            false
        } else {
            true
        }
    }

    /// Checks the queues and hands them to the device (status already has DRIVER_OK).
    fn activate(&mut self) {
        let event_idx = self.driver_features & FEATURE_EVENT_IDX != 0;
        let invalid = self
            .queues
            .iter()
            .position(|q| !q.ready() || !q.is_valid(&self.mem));
        if let Some(index) = invalid {
            warn!(device = %self.name, index, "virtio-mmio: queue not ready or invalid at DRIVER_OK");
            self.needs_reset();
            return;
        }
        let queues = self
            .queues
            .iter()
            .map(|q| {
                let mut state = q.state();
                state.event_idx_enabled = event_idx;
                Queue::try_from(state)
            })
            .collect::<Result<Vec<_>, _>>();
        let queues = match queues {
            Ok(q) => q,
            Err(e) => {
                warn!(device = %self.name, error = %e, "virtio-mmio: cannot copy queues");
                self.needs_reset();
                return;
            }
        };
        if let Err(e) = self.activate_with(queues) {
            warn!(device = %self.name, error = %e, "virtio-mmio: activation failed");
            self.needs_reset();
            return;
        }
        info!(device = %self.name, features = self.driver_features, "virtio device activated");
    }

    fn activate_with(&self, queues: Vec<Queue>) -> Result<(), super::VirtioError> {
        let interrupt: Arc<dyn VirtioInterrupt> = self.interrupt.clone();
        lock(&self.device).activate(Activation {
            mem: self.mem.clone(),
            queues,
            interrupt,
            acked_features: self.driver_features,
        })
    }

    fn needs_reset(&mut self) {
        self.status |= status::DEVICE_NEEDS_RESET;
        if self.status & status::DRIVER_OK != 0 {
            self.config_generation = self.config_generation.wrapping_add(1);
            self.interrupt.signal_config_change();
        }
    }

    fn reset(&mut self) {
        {
            let mut d = lock(&self.device);
            if d.is_activated() || self.status != 0 {
                info!(device = %self.name, "virtio device reset by driver");
            }
            d.reset();
            d.read_config(0, &mut self.config_cache[..]);
        }
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.interrupt.status.store(0, Ordering::SeqCst);
    }
}

mod state;

pub use state::{MmioTransportState, QueueRegisters};

#[cfg(test)]
mod tests;
