//! Saved state of a virtio-mmio transport: plain registers and queue
//! positions, and rebuilding a transport from them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tracing::warn;
use virtio_queue::{Queue, QueueState, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{lock, status, MmioError, MmioTransport, FEATURE_EVENT_IDX};
use crate::devices::virtio::{QueueProgress, VirtioDevice};
use crate::memory::GuestMemoryMmap;

/// Saved state of one queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueRegisters {
    /// Largest size the device allows.
    pub max_size: u16,
    /// Size chosen by the driver.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Available ("driver") ring address.
    pub avail_ring: u64,
    /// Used ("device") ring address.
    pub used_ring: u64,
    /// Next available entry the device reads.
    pub next_avail: u16,
    /// Next used entry the device writes.
    pub next_used: u16,
    /// VIRTIO_RING_F_EVENT_IDX in use.
    pub event_idx: bool,
}

/// Saved state of a transport: plain registers, rebuilt with
/// [`MmioTransport::restore`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MmioTransportState {
    /// virtio device ID of the device behind the transport.
    pub device_type: u32,
    /// Device status register.
    pub status: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// Features written by the driver.
    pub driver_features: u64,
    /// QueueSel.
    pub queue_sel: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// Every queue of the device.
    pub queues: Vec<QueueRegisters>,
}

impl MmioTransport {
    /// The transport's registers and queues, for snapshot and migration. The
    /// device must be quiescent (no thread in `queue_notified`).
    pub fn state(&self) -> MmioTransportState {
        let progress = {
            let d = lock(&self.device);
            if d.is_activated() {
                d.queue_progress()
            } else {
                Vec::new()
            }
        };
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let p = progress.get(i).copied().unwrap_or(QueueProgress {
                    next_avail: q.next_avail(),
                    next_used: q.next_used(),
                });
                QueueRegisters {
                    max_size: q.max_size(),
                    size: q.size(),
                    ready: q.ready(),
                    desc_table: q.desc_table(),
                    avail_ring: q.avail_ring(),
                    used_ring: q.used_ring(),
                    next_avail: p.next_avail,
                    next_used: p.next_used,
                    event_idx: self.driver_features & FEATURE_EVENT_IDX != 0,
                }
            })
            .collect();
        MmioTransportState {
            device_type: self.device_type,
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt_status(),
            config_generation: self.config_generation,
            queues,
        }
    }

    /// Rebuilds a transport from saved state in front of a fresh `device` (whose
    /// own state was restored separately). If the driver had set DRIVER_OK, the
    /// device is activated again with the saved queue positions; if the saved
    /// interrupt status is non-zero the interrupt is raised again so that the
    /// guest does not miss it.
    pub fn restore(
        device: Arc<Mutex<dyn VirtioDevice>>,
        mem: GuestMemoryMmap,
        irq: EventFd,
        state: &MmioTransportState,
    ) -> Result<Self, MmioError> {
        let mut t = MmioTransport::new(device, mem, irq);
        if state.device_type != t.device_type {
            return Err(MmioError::DeviceType {
                saved: state.device_type,
                actual: t.device_type,
            });
        }
        if state.queues.len() != t.queues.len() {
            return Err(MmioError::QueueCount {
                saved: state.queues.len(),
                actual: t.queues.len(),
            });
        }
        for (index, (q, saved)) in t.queues.iter_mut().zip(&state.queues).enumerate() {
            if saved.max_size != q.max_size() {
                return Err(MmioError::InvalidQueue {
                    index,
                    reason: format!(
                        "maximum size {} differs from the device's {}",
                        saved.max_size,
                        q.max_size()
                    ),
                });
            }
            *q = Queue::try_from(QueueState {
                max_size: saved.max_size,
                next_avail: saved.next_avail,
                next_used: saved.next_used,
                event_idx_enabled: saved.event_idx,
                size: saved.size,
                ready: saved.ready,
                desc_table: saved.desc_table,
                avail_ring: saved.avail_ring,
                used_ring: saved.used_ring,
            })
            .map_err(|e| MmioError::InvalidQueue {
                index,
                reason: e.to_string(),
            })?;
        }
        t.status = state.status;
        t.device_features_sel = state.device_features_sel;
        t.driver_features_sel = state.driver_features_sel;
        t.driver_features = state.driver_features;
        t.queue_sel = state.queue_sel;
        t.config_generation = state.config_generation;
        t.interrupt
            .status
            .store(state.interrupt_status, Ordering::SeqCst);
        let live = status::DRIVER_OK | status::FEATURES_OK;
        if t.status & live == live && t.status & status::DEVICE_NEEDS_RESET == 0 {
            for (index, q) in t.queues.iter().enumerate() {
                if !q.is_valid(&t.mem) {
                    return Err(MmioError::InvalidQueue {
                        index,
                        reason: "not valid in guest memory".into(),
                    });
                }
            }
            let queues = t
                .queues
                .iter()
                .map(|q| Queue::try_from(q.state()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| MmioError::InvalidQueue {
                    index: 0,
                    reason: e.to_string(),
                })?;
            t.activate_with(queues)
                .map_err(|source| MmioError::Activate {
                    device: t.name.clone(),
                    source,
                })?;
        }
        if state.interrupt_status != 0 {
            if let Err(e) = t.interrupt.irq.write(1) {
                warn!(error = %e, "virtio-mmio: cannot re-raise interrupt after restore");
            }
        }
        Ok(t)
    }
}
