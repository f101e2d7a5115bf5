//! Wiring virtio devices into the machine: a virtio-mmio window and an interrupt
//! line each, ioeventfds for their queue notifications, and the device event loop.

use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use crate::config::{format_mac, MachineConfig};
use crate::devices::block_backend::{
    is_nbd_url, BlockBackend, BlockBackendError, NbdBackend, RawFileBackend,
};
use crate::devices::bus::{Bus, BusDevice, BusError};
use crate::devices::cached_backend::CachedBackend;
use crate::devices::event_loop::{EventLoopError, LoopDevice};
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::pmem::{Pmem, PmemError, PmemWindow};
use crate::devices::virtio::tap::{Tap, TapError};
use crate::devices::virtio::VirtioDevice;
use crate::devices::DeviceInfo;
use crate::layout;
use crate::memory::GuestMemoryMmap;
use crate::persist::VirtioState;
use crate::vstate::vm::{Vm, VmError};

/// Errors while creating virtio devices.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// A disk image cannot be used.
    #[error("disk {index} ({path})")]
    Disk {
        /// Position among the disks.
        index: usize,
        /// Image path.
        path: String,
        /// The cause.
        #[source]
        source: BlockBackendError,
    },
    /// A TAP device cannot be opened or created.
    #[error("network device {index} (TAP {tap})")]
    Tap {
        /// Position among the network devices.
        index: usize,
        /// TAP name.
        tap: String,
        /// The cause.
        #[source]
        source: TapError,
    },
    /// A virtio-pmem backing cannot be used.
    #[error("pmem device {index}")]
    Pmem {
        /// Position among the pmem devices.
        index: usize,
        /// The cause.
        #[source]
        source: PmemError,
    },
    /// KVM refused an irqfd or ioeventfd.
    #[error("wiring {device}")]
    Kvm {
        /// Device name.
        device: String,
        /// The cause.
        #[source]
        source: VmError,
    },
    /// An eventfd could not be created.
    #[error("cannot create eventfds for {0}")]
    EventFd(String, #[source] std::io::Error),
    /// Saved device state that does not fit the device.
    #[error("restoring {0}: {1}")]
    Restore(String, String),
    /// The MMIO window is taken.
    #[error("placing {0} on the MMIO bus")]
    Bus(String, #[source] BusError),
}

/// A virtio device wired into the machine.
pub struct AttachedDevice {
    /// Static description.
    pub info: DeviceInfo,
    /// The device model.
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    /// Queue notification ioeventfds.
    pub queue_events: Vec<EventFd>,
    /// The transport (registers, queues) in front of the device.
    pub transport: Arc<Mutex<MmioTransport>>,
    /// The irqfd (kept open for the VM's lifetime).
    _irq: EventFd,
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

    /// The device's saved state (the machine must be paused).
    pub fn save(&self) -> VirtioState {
        VirtioState {
            name: self.info.name.clone(),
            backend: self.info.backend.clone(),
            transport: self
                .transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .state(),
        }
    }

    /// Makes what the guest wrote to the device's backend without requests
    /// durable ([`VirtioDevice::sync_backend`]).
    pub fn sync_backend(&self) -> std::io::Result<()> {
        self.device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync_backend()
    }

    /// `info` with current counters.
    pub fn info_with_counters(&self) -> DeviceInfo {
        let mut info = self.info.clone();
        {
            let device = self.device.lock().unwrap_or_else(|p| p.into_inner());
            info.counters = device.counters();
            info.queues = device.queue_views();
        }
        // Not under the device's lock: the transport takes it itself.
        info.interrupt_status = Some(
            self.transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .interrupt_status(),
        );
        info
    }
}

/// A device model kept across a reboot: its backend (disk image, NBD
/// connection, TAP) stays open and its counters count on; only its wiring
/// into the VM is made anew ([`reattach_all`]).
pub struct KeptDevice {
    info: DeviceInfo,
    device: Arc<Mutex<dyn VirtioDevice>>,
}

impl AttachedDevice {
    /// The device model, reset as a driver's reset does (queues and
    /// negotiated features gone), to wire into the machine's next VM. The
    /// vCPUs and the device event loop must have stopped.
    pub fn keep(&self) -> KeptDevice {
        self.device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reset();
        KeptDevice {
            info: self.info.clone(),
            device: self.device.clone(),
        }
    }
}

impl AttachedDevice {
    /// Takes the device's wiring out of `vm` (its queue notifications and
    /// interrupt line), for a reboot that keeps the VM and wires the device
    /// in again ([`reattach_all`]): KVM refuses a second ioeventfd on the
    /// same address and value.
    pub fn unwire(&self, vm: &Vm) -> Result<(), AttachError> {
        let kvm_err = |source| AttachError::Kvm {
            device: self.info.name.clone(),
            source,
        };
        let notify = self.info.address + MmioTransport::queue_notify_address_offset();
        for (q, evt) in self.queue_events.iter().enumerate() {
            vm.unregister_mmio_ioevent(evt, notify, q as u32)
                .map_err(kvm_err)?;
        }
        vm.unregister_irqfd(&self._irq, self.info.gsi)
            .map_err(kvm_err)
    }
}

/// Wires devices kept from the machine's previous boot into `vm`, each in
/// the MMIO window and on the interrupt line it had (they are placed by
/// position), behind a new transport: the guest finds them as at a cold
/// boot.
pub fn reattach_all(
    vm: &Vm,
    mem: &GuestMemoryMmap,
    mmio_bus: &mut Bus,
    kept: Vec<KeptDevice>,
) -> Result<Vec<AttachedDevice>, AttachError> {
    let mut wiring = Wiring {
        vm,
        mem,
        mmio_bus,
        saved: None,
        attached: Vec::new(),
    };
    for KeptDevice { info, device } in kept {
        wiring.add(info.name, &info.kind, info.backend, device)?;
    }
    Ok(wiring.attached)
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        MmioTransport::read(self, offset, data)
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        MmioTransport::write(self, offset, data)
    }
}

/// Creates every disk, network and pmem device of `config`, in that order,
/// each in its own virtio-mmio window with its own GSI (a pmem device's
/// memory window, too: [`layout::pmem_windows`]).
pub fn attach_all(
    config: &MachineConfig,
    vm: &Vm,
    mem: &GuestMemoryMmap,
    mmio_bus: &mut Bus,
    saved: Option<&[VirtioState]>,
    handover_taps: Vec<std::fs::File>,
) -> Result<Vec<AttachedDevice>, AttachError> {
    let mut handover_taps = handover_taps.into_iter();
    let mut wiring = Wiring {
        vm,
        mem,
        mmio_bus,
        saved,
        attached: Vec::new(),
    };
    for (i, disk) in config.disks.iter().enumerate() {
        let path = disk.path.to_string_lossy();
        let err = |source| AttachError::Disk {
            index: i,
            path: path.to_string(),
            source,
        };
        let mut backend: Box<dyn BlockBackend> = if is_nbd_url(&path) {
            Box::new(NbdBackend::connect(&path, disk.read_only).map_err(err)?)
        } else {
            Box::new(RawFileBackend::open(&disk.path, disk.read_only).map_err(err)?)
        };
        let name = format!("block{i}");
        if let Some(capacity) = disk.cache_bytes {
            // A new cache is an empty one: a restored, migrated or
            // failed-over VM starts cold (docs/warm-cache.md).
            backend = Box::new(
                CachedBackend::new(backend, &name, capacity)
                    .map_err(|source| err(BlockBackendError::Cache { source }))?,
            );
        }
        let device: Arc<Mutex<dyn VirtioDevice>> =
            Arc::new(Mutex::new(Block::new(name.clone(), backend)));
        let backend = format!(
            "{}{}{}",
            disk.path.display(),
            if disk.read_only { " (read-only)" } else { "" },
            match disk.cache_bytes {
                Some(c) => format!(" (cache {})", crate::config::format_size(c)),
                None => String::new(),
            }
        );
        wiring.add(name, "virtio-blk", backend, device)?;
    }
    for (i, net) in config.nets.iter().enumerate() {
        let tap = match handover_taps.next() {
            Some(file) => Tap::from_file(file),
            None => Tap::open(&net.tap, true),
        }
        .map_err(|source| AttachError::Tap {
            index: i,
            tap: net.tap.clone(),
            source,
        })?;
        let mac = net.mac_address();
        let name = format!("net{i}");
        let device: Arc<Mutex<dyn VirtioDevice>> =
            Arc::new(Mutex::new(Net::new(name.clone(), tap, mac)));
        let backend = format!("tap:{} mac:{}", net.tap, format_mac(mac));
        wiring.add(name, "virtio-net", backend, device)?;
    }
    let pmem_err = |index| move |source| AttachError::Pmem { index, source };
    let sizes = config
        .pmem
        .iter()
        .enumerate()
        .map(|(i, p)| PmemWindow::probe(&p.path).map_err(pmem_err(i)))
        .collect::<Result<Vec<_>, _>>()?;
    let windows = layout::pmem_windows(config.memory_bytes, &sizes);
    for (i, (p, guest)) in config.pmem.iter().zip(windows).enumerate() {
        let window = PmemWindow::open(vm, &p.path, guest).map_err(pmem_err(i))?;
        let name = format!("pmem{i}");
        let backend = format!(
            "{} ({} at {guest:#x})",
            p.path.display(),
            crate::config::format_size(window.size())
        );
        let device: Arc<Mutex<dyn VirtioDevice>> =
            Arc::new(Mutex::new(Pmem::new(name.clone(), window)));
        wiring.add(name, "virtio-pmem", backend, device)?;
    }
    Ok(wiring.attached)
}

/// What [`attach_all`] wires each device into, and the devices so far:
/// the next one gets the next MMIO window and interrupt line.
struct Wiring<'a> {
    vm: &'a Vm,
    mem: &'a GuestMemoryMmap,
    mmio_bus: &'a mut Bus,
    /// The transports' saved states, when the devices are restored.
    saved: Option<&'a [VirtioState]>,
    attached: Vec<AttachedDevice>,
}

impl Wiring<'_> {
    /// Gives `device` the next MMIO window and interrupt line, its
    /// notification eventfds and, when restoring, its transport's state.
    fn add(
        &mut self,
        name: String,
        kind: &str,
        backend: String,
        device: Arc<Mutex<dyn VirtioDevice>>,
    ) -> Result<(), AttachError> {
        let saved = match self.saved {
            None => None,
            Some(states) => Some(
                states
                    .iter()
                    .find(|s| s.name == name)
                    .map(|s| &s.transport)
                    .ok_or_else(|| AttachError::Restore(name.clone(), "no saved state".into()))?,
            ),
        };
        let index = self.attached.len();
        let base = layout::virtio_mmio_base(index);
        let gsi = layout::VIRTIO_IRQ_BASE + index as u32;
        let evt_err = |e| AttachError::EventFd(name.clone(), e);
        let kvm_err = |source| AttachError::Kvm {
            device: name.clone(),
            source,
        };
        let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(evt_err)?;
        self.vm.register_irqfd(&irq, gsi).map_err(kvm_err)?;
        let irq_copy = irq.try_clone().map_err(evt_err)?;
        let transport = match saved {
            None => MmioTransport::new(device.clone(), self.mem.clone(), irq_copy),
            Some(state) => {
                MmioTransport::restore(device.clone(), self.mem.clone(), irq_copy, state)
                    .map_err(|e| AttachError::Restore(name.clone(), e.to_string()))?
            }
        };
        let queues = transport.num_queues();
        let mut queue_events = Vec::with_capacity(queues);
        for q in 0..queues {
            let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(evt_err)?;
            self.vm
                .register_mmio_ioevent(
                    &evt,
                    base + MmioTransport::queue_notify_address_offset(),
                    q as u32,
                )
                .map_err(kvm_err)?;
            queue_events.push(evt);
        }
        let transport = Arc::new(Mutex::new(transport));
        self.mmio_bus
            .insert(transport.clone(), base, layout::VIRTIO_MMIO_SIZE)
            .map_err(|e| AttachError::Bus(name.clone(), e))?;
        tracing::debug!(device = %name, base = format_args!("{base:#x}"), gsi, "virtio device attached");
        self.attached.push(AttachedDevice {
            info: DeviceInfo {
                name,
                kind: kind.into(),
                address: base,
                gsi,
                backend,
                counters: Default::default(),
                queues: Vec::new(),
                interrupt_status: None,
            },
            device,
            queue_events,
            transport,
            _irq: irq,
        });
        Ok(())
    }
}
