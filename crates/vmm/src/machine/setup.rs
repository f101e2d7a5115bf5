//! Setting up a machine's parts, besides its memory slots: the legacy and
//! virtio devices and their event loop, the kernel and the boot vCPU of a
//! fresh boot, the vCPUs of a restore.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use super::{Machine, MachineError};
use crate::boot;
use crate::config::{MachineConfig, SerialConfig};
use crate::devices::bus::Bus;
use crate::devices::event_loop::{DeviceEventLoop, EventLoopAhead};
use crate::devices::legacy::{
    ExitPort, SerialDevice, EXIT_PORT, I8042, I8042_PORT, SERIAL_GSI, SERIAL_PORT,
};
use crate::devices::serial_output::{SerialOutput, SerialSocket};
use crate::dirty::DirtyTracker;
use crate::memory::GuestMemoryMmap;
use crate::output::OutputGate;
use crate::persist::{self, VmState};
use crate::virtio_devices::{self, AttachedDevice, KeptDevice};
use crate::vstate::cpuid;
use crate::vstate::vcpu::{BootEntry, Vcpu, VcpuThreadAhead};
use crate::vstate::vm::{Vm, VmError};
use crate::vstate::VmEventSink;

/// What a reboot keeps of the machine's previous boot: its device models
/// (disks and TAPs open, reset) and its console's output.
pub(super) struct Kept {
    pub(super) virtio: Vec<KeptDevice>,
    pub(super) serial: SerialOutput,
    pub(super) serial_backend: String,
}

/// What is built besides memory slots, before the vCPUs start.
pub(super) struct Setup {
    pub(super) serial: Arc<Mutex<SerialDevice>>,
    pub(super) serial_backend: String,
    pub(super) virtio: Vec<AttachedDevice>,
    pub(super) event_loop: DeviceEventLoop,
    pub(super) vcpus: Vec<Vcpu>,
    pub(super) io_bus: Arc<Bus>,
    pub(super) mmio_bus: Arc<Bus>,
    /// When the devices (and their event loop) were ready.
    pub(super) devices_done: Instant,
}

impl Machine {
    /// Everything but the memory slots: legacy and virtio devices, the kernel
    /// and its boot structures, the vCPUs (created, not started).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn setup_devices_kernel_vcpus(
        config: &MachineConfig,
        vm: &Vm,
        guest_memory: &GuestMemoryMmap,
        events: &VmEventSink,
        gate: Arc<dyn OutputGate>,
        saved: Option<&VmState>,
        taps: Vec<std::fs::File>,
        kept: Option<Kept>,
        start_paused: bool,
        event_loop_ahead: Option<EventLoopAhead>,
        kept_vcpus: Vec<Vcpu>,
    ) -> Result<Setup, MachineError> {
        let (kept_serial, kept_virtio) = match kept {
            Some(k) => (Some((k.serial, k.serial_backend)), Some(k.virtio)),
            None => (None, None),
        };
        // Legacy devices.
        let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(MachineError::EventFd)?;
        vm.register_irqfd(&serial_irq, SERIAL_GSI)?;
        let (serial_out, serial_backend) = match kept_serial {
            Some(kept) => kept,
            None => open_serial(&config.serial)?,
        };
        let serial = match saved {
            None => SerialDevice::new(serial_irq, serial_out, gate.clone()),
            Some(s) => {
                SerialDevice::from_state(serial_irq, serial_out, &(&s.serial).into(), gate.clone())
                    .map_err(MachineError::InvalidState)?
            }
        };
        let serial = Arc::new(Mutex::new(serial));
        let mut io_bus = Bus::new();
        io_bus.insert(serial.clone(), SERIAL_PORT, 8)?;
        io_bus.insert(
            Arc::new(Mutex::new(I8042::new(events.clone()))),
            I8042_PORT,
            5,
        )?;
        io_bus.insert(
            Arc::new(Mutex::new(ExitPort::new(events.clone()))),
            EXIT_PORT,
            4,
        )?;
        io_bus.insert(
            Arc::new(Mutex::new(crate::acpi::PowerPorts::new(events.clone()))),
            u64::from(crate::acpi::SLEEP_CONTROL_PORT),
            crate::acpi::POWER_PORTS_LEN,
        )?;

        // virtio devices.
        let mut mmio_bus = Bus::new();
        let virtio = match kept_virtio {
            Some(kept) => virtio_devices::reattach_all(vm, guest_memory, &mut mmio_bus, kept)?,
            None => virtio_devices::attach_all(
                config,
                vm,
                guest_memory,
                &mut mmio_bus,
                saved.map(|s| s.virtio.as_slice()),
                taps,
            )?,
        };
        let mut cmdline = config.cmdline.clone();
        for d in &virtio {
            cmdline.push_str(&format!(
                " virtio_mmio.device=4K@{:#x}:{}",
                d.info.address, d.info.gsi
            ));
        }
        let event_loop_ahead = match event_loop_ahead {
            Some(a) => a,
            None => EventLoopAhead::spawn()?,
        };
        let event_loop = DeviceEventLoop::start_on(
            event_loop_ahead,
            virtio
                .iter()
                .map(|d| d.loop_device())
                .collect::<Result<_, _>>()?,
            gate,
            start_paused,
        )?;
        let devices_done = Instant::now();

        let vcpus = match saved {
            None => {
                let descs: Vec<crate::acpi::VirtioMmioDesc> = virtio
                    .iter()
                    .map(|d| crate::acpi::VirtioMmioDesc {
                        base: d.info.address,
                        size: crate::layout::VIRTIO_MMIO_SIZE,
                        gsi: d.info.gsi,
                    })
                    .collect();
                Self::boot_fresh(config, vm, guest_memory, cmdline.trim(), &descs, kept_vcpus)?
            }
            // Restored by restore_vcpus.
            Some(_) => Vec::new(),
        };
        Ok(Setup {
            serial,
            serial_backend,
            virtio,
            event_loop,
            vcpus,
            io_bus: Arc::new(io_bus),
            mmio_bus: Arc::new(mmio_bus),
            devices_done,
        })
    }

    /// Writes each vCPU's saved registers of `state` into the vCPU made
    /// ahead (or a new one), and pairs it with its thread made ahead, if
    /// there is one.
    pub(super) fn restore_vcpus(
        vm: &kvm_ioctls::VmFd,
        state: &VmState,
        vcpus_ahead: Vec<Vcpu>,
        threads_ahead: Vec<VcpuThreadAhead>,
        dirty: &Arc<DirtyTracker>,
    ) -> Result<Vec<(Vcpu, Option<VcpuThreadAhead>)>, MachineError> {
        let ahead = vcpus_ahead.len();
        if ahead > 0 && ahead != state.vcpus.len() {
            return Err(MachineError::InvalidState(format!(
                "the state has {} vCPUs, this VM was prepared with {ahead}",
                state.vcpus.len()
            )));
        }
        let mut ahead: Vec<Option<Vcpu>> = vcpus_ahead.into_iter().map(Some).collect();
        let mut threads: Vec<Option<VcpuThreadAhead>> =
            threads_ahead.into_iter().map(Some).collect();
        let mut restoring = Vec::with_capacity(state.vcpus.len());
        for vs in &state.vcpus {
            let made = ahead.get_mut(usize::from(vs.index)).and_then(Option::take);
            let mut vcpu = match made {
                Some(v) => v,
                None if ahead.is_empty() => Vcpu::new(vm, vs.index)?,
                None => {
                    return Err(MachineError::InvalidState(format!(
                        "vCPU index {} is out of range or repeated",
                        vs.index
                    )))
                }
            };
            let in_place = vcpu.take_in_place();
            if !vcpu.dirty_ring_attached() {
                dirty.attach_vcpu(&mut vcpu)?;
            }
            let thread = threads
                .iter_mut()
                .find(|t| t.as_ref().is_some_and(|t| t.index() == vs.index))
                .and_then(Option::take);
            persist::vcpu::restore(vcpu.fd(), vs, in_place.as_ref())
                .map_err(MachineError::VcpuState)?;
            restoring.push((vcpu, thread));
        }
        Ok(restoring)
    }

    /// Loads the kernel and creates the vCPUs in their boot state, or uses
    /// the `kept` ones of a reboot (already in their power-on state, see
    /// [`super::reset`]).
    fn boot_fresh(
        config: &MachineConfig,
        vm: &Vm,
        guest_memory: &GuestMemoryMmap,
        cmdline: &str,
        virtio: &[crate::acpi::VirtioMmioDesc],
        kept: Vec<Vcpu>,
    ) -> Result<Vec<Vcpu>, MachineError> {
        let boot_entry = if boot::bzimage::is_bzimage(&config.kernel).unwrap_or(false) {
            let rsdp = crate::acpi::create_acpi_tables(guest_memory, config.vcpus, virtio)?;
            let bz = boot::bzimage::load(
                guest_memory,
                config.memory_bytes,
                &boot::bzimage::BzImageSpec {
                    kernel: &config.kernel,
                    initramfs: config.initramfs.as_deref(),
                    cmdline: config.cmdline.trim(),
                    rsdp: Some(rsdp.0),
                },
            )?;
            BootEntry::Linux64 {
                entry: bz.entry_64,
                boot_params: bz.zero_page,
                page_tables: bz.page_tables,
                gdt: bz.gdt,
            }
        } else {
            let pvh = boot::pvh::load(
                guest_memory,
                config.memory_bytes,
                &boot::pvh::PvhBootSpec {
                    kernel: &config.kernel,
                    initramfs: config.initramfs.as_deref(),
                    cmdline,
                    rsdp: None,
                },
            )?;
            BootEntry::Pvh {
                entry: pvh.entry,
                start_info: pvh.start_info,
            }
        };
        if !kept.is_empty() {
            if let Some(boot) = kept.first() {
                boot.set_boot_state(boot_entry)?;
            }
            return Ok(kept);
        }
        let mut base_cpuid = None;
        let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
        for i in 0..config.vcpus {
            let vcpu = configured_vcpu(vm, i, config.vcpus, &mut base_cpuid)?;
            if i == 0 {
                vcpu.set_boot_state(boot_entry)?;
            }
            vcpus.push(vcpu);
        }
        Ok(vcpus)
    }
}

/// Creates vCPU `index` of `vcpus` and configures it as a boot does
/// ([`Vcpu::configure`]); `base` is the machine's CPUID, asked of KVM with
/// the first vCPU (the timing leaf needs one for the TSC rate).
pub(super) fn configured_vcpu(
    vm: &Vm,
    index: u8,
    vcpus: u8,
    base: &mut Option<kvm_bindings::CpuId>,
) -> Result<Vcpu, MachineError> {
    let vcpu = Vcpu::new(vm.fd(), index)?;
    let base =
        match base {
            Some(b) => b,
            None => base.insert(cpuid::base(vm.kvm(), vcpu.tsc_khz()).map_err(|source| {
                VmError::Kvm {
                    what: "KVM_GET_SUPPORTED_CPUID",
                    source,
                }
            })?),
        };
    vcpu.configure(base, vcpus)?;
    Ok(vcpu)
}

fn open_serial(cfg: &SerialConfig) -> Result<(SerialOutput, String), MachineError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| MachineError::Serial { path, source }
    };
    Ok(match cfg {
        SerialConfig::Null => (SerialOutput::Null, "null".into()),
        SerialConfig::Stdout => (SerialOutput::Stdout, "stdout".into()),
        SerialConfig::File(p) => (
            SerialOutput::File(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(err(p))?,
            ),
            format!("file:{}", p.display()),
        ),
        SerialConfig::Socket(p) => (
            SerialOutput::Socket(SerialSocket::bind(p).map_err(err(p))?),
            format!("socket:{}", p.display()),
        ),
    })
}
