//! virtio devices: the virtio-mmio v2 transport and the device models behind it.
//!
//! Threading: the transport's registers are accessed from vCPU threads (MMIO
//! exits); queue notifications arrive on ioeventfds and backend readiness (a TAP
//! fd) on the device's own fd, both served by the VM's device event loop, which
//! calls [`VirtioDevice::queue_notified`] / [`VirtioDevice::backend_ready`]. Every
//! device lives behind a `Mutex`, so one thread at a time touches it.

pub mod block;
pub mod mmio;
pub mod net;
pub mod pmem;
pub mod tap;

use std::os::fd::RawFd;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};

use crate::memory::GuestMemoryMmap;

/// virtio device IDs (virtio spec 1.2, section 5).
pub const TYPE_NET: u32 = 1;
/// virtio device ID of a block device.
pub const TYPE_BLOCK: u32 = 2;
/// virtio device ID of a persistent memory device.
pub const TYPE_PMEM: u32 = 27;

/// VIRTIO_F_VERSION_1: every device we offer is a modern (v1+) device.
pub const FEATURE_VERSION_1: u64 = 1 << 32;

/// Errors of the virtio layer.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// A queue configured by the driver is not usable.
    #[error(
        "queue {index} is not valid (size {size}, addresses outside guest memory or misaligned)"
    )]
    InvalidQueue {
        /// Queue index.
        index: usize,
        /// Configured size.
        size: u16,
    },
    /// The driver activated the device with the wrong number of queues.
    #[error("device needs {expected} queues, driver set up {actual}")]
    QueueCount {
        /// Queues the device has.
        expected: usize,
        /// Queues that are ready.
        actual: usize,
    },
    /// The backend failed (TAP, disk file...).
    #[error("{device} backend: {message}")]
    Backend {
        /// Which device.
        device: String,
        /// What went wrong.
        message: String,
    },
}

/// How a device tells the driver that something happened.
pub trait VirtioInterrupt: Send + Sync {
    /// Used buffers were added to a queue.
    fn signal_used_queue(&self);
    /// The device configuration changed.
    fn signal_config_change(&self);
}

/// Request and byte counters a device exposes as metrics.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Requests or packets completed successfully.
    pub requests: u64,
    /// Bytes read from the backend into the guest.
    pub bytes_in: u64,
    /// Bytes written from the guest to the backend.
    pub bytes_out: u64,
    /// Requests that completed with an error status, or packets dropped.
    pub errors: u64,
    /// Malformed descriptor chains the device rejected.
    pub bad_descriptors: u64,
    /// A disk's warm cache (`--disk …,cache=SIZE`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<crate::devices::disk_cache::CacheCounters>,
    /// Times an NBD disk's connection was lost and made again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reconnects: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How far a device has got in one queue: saved with the transport's state so
/// that a restored device resumes where it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueProgress {
    /// Next available-ring entry the device will read.
    pub next_avail: u16,
    /// Next used-ring entry the device will write.
    pub next_used: u16,
}

impl QueueProgress {
    /// Where the device is in `queue`.
    pub fn of(queue: &Queue) -> Self {
        QueueProgress {
            next_avail: queue.next_avail(),
            next_used: queue.next_used(),
        }
    }
}

/// Reads a device's configuration space `config` at `offset` into `data`;
/// bytes beyond it read as 0.
pub fn read_config_space(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o))
            .copied()
            .unwrap_or(0);
    }
}

/// What a device gets when the driver sets DRIVER_OK.
pub struct Activation {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// One configured, valid queue per [`VirtioDevice::queue_max_sizes`] entry.
    pub queues: Vec<Queue>,
    /// Raises the device's interrupt.
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// Features the driver acknowledged.
    pub acked_features: u64,
}

/// A one-queue device's queue while it is activated.
pub struct ActiveQueue {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The queue.
    pub queue: Queue,
    /// Raises the device's interrupt.
    pub interrupt: Arc<dyn VirtioInterrupt>,
}

impl ActiveQueue {
    /// The queue of a device activated with `active` as the API shows it
    /// ([`VirtioDevice::queue_views`]): none while not activated.
    pub fn views(active: Option<&Self>) -> Vec<QueueView> {
        active
            .map(|a| vec![QueueView::of(&a.queue, &a.mem)])
            .unwrap_or_default()
    }

    /// Where such a device is in its queue ([`VirtioDevice::queue_progress`]).
    pub fn progress(active: Option<&Self>) -> Vec<QueueProgress> {
        active
            .map(|a| vec![QueueProgress::of(&a.queue)])
            .unwrap_or_default()
    }
}

impl Activation {
    /// Takes the activation's queues, checked: exactly `N`, each valid in
    /// guest memory.
    pub fn take_queues<const N: usize>(&mut self) -> Result<[Queue; N], VirtioError> {
        let queues: [Queue; N] =
            std::mem::take(&mut self.queues)
                .try_into()
                .map_err(|q: Vec<Queue>| VirtioError::QueueCount {
                    expected: N,
                    actual: q.len(),
                })?;
        for (index, q) in queues.iter().enumerate() {
            if !q.is_valid(&self.mem) {
                return Err(VirtioError::InvalidQueue {
                    index,
                    size: q.size(),
                });
            }
        }
        Ok(queues)
    }
}

/// One queue as the API shows it (`kemarictl devices`): where the device is
/// and what the guest has published. Requests that stay `waiting` while the
/// device is idle mean a lost notification.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueView {
    /// Next available-ring entry the device will read.
    pub next_avail: u16,
    /// Next used-ring entry the device will write.
    pub next_used: u16,
    /// The avail index the guest has published (None: unreadable ring).
    pub avail_idx: Option<u16>,
    /// Requests published and not yet taken by the device.
    pub waiting: u16,
}

impl QueueView {
    /// `queue` now, reading the guest's avail index from `mem`.
    pub fn of(queue: &Queue, mem: &GuestMemoryMmap) -> Self {
        let avail_idx = queue
            .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
            .ok()
            .map(|w| w.0);
        QueueView {
            next_avail: queue.next_avail(),
            next_used: queue.next_used(),
            avail_idx,
            waiting: avail_idx.map_or(0, |a| a.wrapping_sub(queue.next_avail())),
        }
    }
}

/// Requests waiting on a device's output queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingOutputs {
    /// The guest's avail index: serve up to here.
    pub limit: u16,
    /// Requests between the device's next avail index and `limit`.
    pub requests: u16,
}

impl PendingOutputs {
    /// What waits on `queue`, if anything (a broken ring reads as nothing).
    pub fn of(queue: &Queue, mem: &GuestMemoryMmap) -> Option<Self> {
        let avail = queue
            .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
            .ok()?
            .0;
        let requests = avail.wrapping_sub(queue.next_avail());
        // More than the queue holds means a corrupt index: serving will stop
        // at the first chain that cannot be popped.
        (requests != 0).then_some(PendingOutputs {
            limit: avail,
            requests: requests.min(queue.size()),
        })
    }
}

/// A virtio device model, independent of the transport.
pub trait VirtioDevice: Send {
    /// virtio device ID ([`TYPE_NET`], [`TYPE_BLOCK`], ...).
    fn device_type(&self) -> u32;
    /// Human-readable name for logs and the API ("block0", "net0").
    fn name(&self) -> &str;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered to the driver (must include [`FEATURE_VERSION_1`]).
    fn features(&self) -> u64;
    /// Reads the device-specific configuration space. Out-of-range bytes read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device-specific configuration space. Default: ignored.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver set DRIVER_OK: start serving the queues.
    fn activate(&mut self, activation: Activation) -> Result<(), VirtioError>;
    /// Whether [`activate`](Self::activate) has run since the last reset.
    fn is_activated(&self) -> bool;
    /// The driver notified queue `index` (it added available buffers). The
    /// event loop does not call this for the [output queue](Self::output_queue).
    fn queue_notified(&mut self, index: usize);
    /// The queue whose requests leave the VM (see [`crate::output`]), if any.
    fn output_queue(&self) -> Option<usize> {
        None
    }
    /// While activated: the avail index the guest has published on the output
    /// queue and how many requests wait before it, if any wait.
    fn pending_outputs(&self) -> Option<PendingOutputs> {
        None
    }
    /// Serves the output queue's requests up to avail index `limit` (not
    /// beyond, whatever the guest added since); returns how many were served.
    fn serve_outputs_until(&mut self, _limit: u16) -> u16 {
        0
    }
    /// An fd the event loop should watch for readability (e.g. the TAP device).
    fn backend_fd(&self) -> Option<RawFd> {
        None
    }
    /// [`backend_fd`](Self::backend_fd) is readable.
    fn backend_ready(&mut self) {}
    /// Lets go of the backend (closes a disk image or NBD connection, gives up
    /// a TAP queue) so that the VM's next VMM can open it while this process
    /// is still exiting; returns the TAP's fd, if the device had one, to hand
    /// over or close. Only for a device paused for good: it serves no request
    /// afterwards.
    fn release_backend(&mut self) -> std::io::Result<Option<std::fs::File>> {
        Ok(None)
    }
    /// Makes what the guest wrote durable in the backend, for a saved state
    /// that another VMM will open the backend from (only devices whose data
    /// the guest writes without requests, virtio-pmem, have anything to do).
    fn sync_backend(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    /// The driver reset the device: drop the queues, go back to the initial state.
    fn reset(&mut self);
    /// Request counters for the metrics API.
    fn counters(&self) -> DeviceCounters;
    /// Progress in each queue while activated (one entry per queue); empty when
    /// not activated or not tracked.
    fn queue_progress(&self) -> Vec<QueueProgress> {
        Vec::new()
    }
    /// Each queue as the API shows it, while activated (empty otherwise).
    fn queue_views(&self) -> Vec<QueueView> {
        Vec::new()
    }
}
