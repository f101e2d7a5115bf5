//! Wiring virtio devices into the machine: a virtio-mmio window and an interrupt
//! line each, ioeventfds for their queue notifications, and the device event loop.

use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use crate::config::MachineConfig;
use crate::devices::bus::Bus;
use crate::devices::event_loop::{EventLoopError, LoopDevice};
use crate::devices::virtio::VirtioDevice;
use crate::machine::DeviceInfo;
use crate::memory::GuestMemoryMmap;
use crate::output::OutputGate;
use crate::vstate::vm::Vm;

/// Errors while creating virtio devices.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// Not built yet.
    #[error("{0} devices are not supported yet")]
    Unsupported(&'static str),
}

/// A virtio device wired into the machine.
pub struct AttachedDevice {
    /// Static description.
    pub info: DeviceInfo,
    /// The device model.
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    /// Queue notification ioeventfds.
    pub queue_events: Vec<EventFd>,
}

impl AttachedDevice {
    /// What the event loop needs.
    pub fn loop_device(&self) -> Result<LoopDevice, EventLoopError> {
        Ok(LoopDevice {
            device: self.device.clone(),
            queue_events: self
                .queue_events
                .iter()
                .map(|e| e.try_clone())
                .collect::<Result<_, _>>()
                .map_err(EventLoopError::Setup)?,
        })
    }

    /// `info` with current counters.
    pub fn info_with_counters(&self) -> DeviceInfo {
        let mut info = self.info.clone();
        info.counters = self
            .device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .counters();
        info
    }
}

/// Creates every disk and network device of `config`.
pub fn attach_all(
    config: &MachineConfig,
    _vm: &Vm,
    _mem: &GuestMemoryMmap,
    _mmio_bus: &mut Bus,
    _gate: Arc<dyn OutputGate>,
) -> Result<Vec<AttachedDevice>, AttachError> {
    if !config.disks.is_empty() {
        return Err(AttachError::Unsupported("disk"));
    }
    if !config.nets.is_empty() {
        return Err(AttachError::Unsupported("network"));
    }
    Ok(Vec::new())
}
