//! Whole-VM state as plain, versioned data: every vCPU, the in-kernel irqchip,
//! PIT and clock, and every device. Saved from a paused machine, restored into
//! a fresh one built around the same guest memory (warm restart, zero-copy
//! migration) or a copy of it (snapshot/restore, live migration).

pub mod format;
pub mod image_index;
pub mod memory_image;
pub mod snapshot;
pub mod vcpu;

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::config::MachineConfig;
use crate::devices::virtio::mmio::MmioTransportState;
pub use vcpu::VcpuState;

/// Errors saving or restoring VM-wide KVM state.
#[derive(Debug, thiserror::Error)]
pub enum VmStateError {
    /// A KVM VM ioctl failed.
    #[error("KVM {what} failed")]
    Kvm {
        /// The operation.
        what: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// In-kernel devices and the clock.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KvmVmState {
    /// PIC master, PIC slave, IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    /// The PIT.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmStateError {
    move |source| VmStateError::Kvm { what, source }
}

const CHIPS: [u32; 3] = [
    KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQCHIP_IOAPIC,
];

impl KvmVmState {
    /// Reads the VM's in-kernel state (vCPUs paused).
    pub fn save(vm: &VmFd) -> Result<Self, VmStateError> {
        let mut irqchips = Vec::with_capacity(CHIPS.len());
        for chip in CHIPS {
            let mut c = kvm_irqchip {
                chip_id: chip,
                ..Default::default()
            };
            vm.get_irqchip(&mut c).map_err(kvm_err("KVM_GET_IRQCHIP"))?;
            irqchips.push(c);
        }
        Ok(KvmVmState {
            irqchips,
            pit: vm.get_pit2().map_err(kvm_err("KVM_GET_PIT2"))?,
            clock: vm.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))?,
        })
    }

    /// Writes the state into a fresh VM (before its vCPUs run).
    pub fn restore(&self, vm: &VmFd) -> Result<(), VmStateError> {
        vm.set_pit2(&self.pit).map_err(kvm_err("KVM_SET_PIT2"))?;
        let clock = kvm_clock_data {
            clock: self.clock.clock,
            ..Default::default()
        };
        vm.set_clock(&clock).map_err(kvm_err("KVM_SET_CLOCK"))?;
        for chip in &self.irqchips {
            vm.set_irqchip(chip).map_err(kvm_err("KVM_SET_IRQCHIP"))?;
        }
        Ok(())
    }
}

/// The 16550's registers (vm-superio's `SerialState`, as plain data).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialStateData {
    /// Divisor latch low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch high byte.
    pub baud_divisor_high: u8,
    /// IER.
    pub interrupt_enable: u8,
    /// IIR.
    pub interrupt_identification: u8,
    /// LCR.
    pub line_control: u8,
    /// LSR.
    pub line_status: u8,
    /// MCR.
    pub modem_control: u8,
    /// MSR.
    pub modem_status: u8,
    /// SCR.
    pub scratch: u8,
    /// Received bytes not yet read.
    pub in_buffer: Vec<u8>,
}

impl From<vm_superio::serial::SerialState> for SerialStateData {
    fn from(s: vm_superio::serial::SerialState) -> Self {
        SerialStateData {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialStateData> for vm_superio::serial::SerialState {
    fn from(s: &SerialStateData) -> Self {
        vm_superio::serial::SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// One virtio device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VirtioState {
    /// Device name ("block0", "net0").
    pub name: String,
    /// Backend identity (image path, TAP name) at save time.
    pub backend: String,
    /// Transport registers and queue positions.
    pub transport: MmioTransportState,
}

/// Where guest memory was when the state was saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryState {
    /// Size in bytes.
    pub size: u64,
    /// Backing at save time.
    pub backing: crate::memory::MemoryBacking,
}

/// The whole VM, minus guest memory contents.
#[derive(Debug, Serialize, Deserialize)]
pub struct VmState {
    /// kemari version that wrote the state.
    pub kemari_version: String,
    /// Milliseconds since the Unix epoch at save time.
    pub saved_at_ms: u64,
    /// The guest's uptime at save time, ms (none in a state written
    /// before kemari carried it: the uptime then counts from the restore).
    #[serde(default)]
    pub guest_uptime_ms: Option<u64>,
    /// The machine's configuration.
    pub config: MachineConfig,
    /// Guest memory.
    pub memory: MemoryState,
    /// In-kernel devices and clock.
    pub kvm: KvmVmState,
    /// Every vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// COM1.
    pub serial: SerialStateData,
    /// virtio devices, in attach order.
    pub virtio: Vec<VirtioState>,
}

impl VmState {
    /// Checks the state's own consistency before anything is built from it.
    pub fn validate(&self) -> Result<(), String> {
        self.config.validate().map_err(|e| e.to_string())?;
        if self.memory.size != self.config.memory_bytes {
            return Err(format!(
                "memory size {} differs from the configuration's {}",
                self.memory.size, self.config.memory_bytes
            ));
        }
        if self.vcpus.len() != usize::from(self.config.vcpus) {
            return Err(format!(
                "{} vCPU states for {} vCPUs",
                self.vcpus.len(),
                self.config.vcpus
            ));
        }
        if self
            .vcpus
            .iter()
            .enumerate()
            .any(|(i, v)| usize::from(v.index) != i)
        {
            return Err("vCPU states out of order".into());
        }
        if self.kvm.irqchips.len() != CHIPS.len() {
            return Err("irqchip state incomplete".into());
        }
        let devices = self.config.disks.len() + self.config.nets.len() + self.config.pmem.len();
        if self.virtio.len() != devices {
            return Err(format!(
                "{} virtio device states for {devices} configured devices",
                self.virtio.len()
            ));
        }
        Ok(())
    }
}

/// Creates (or truncates) `path` for writing, readable and writable by its
/// owner only — 0600 whatever the umask, and whatever mode an earlier file
/// had: the state and memory of a VM hold the guest's secrets.
pub fn create_private(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(file)
}

/// Writes `bytes` as `path` (0600) through a temporary file renamed into
/// place, so that a crash never leaves a half-written file; synced first if
/// `durable`.
pub fn write_private(path: &std::path::Path, bytes: &[u8], durable: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let mut file = create_private(&tmp)?;
    file.write_all(bytes)?;
    if durable {
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// `e`, or, if it says a file is missing, "not found: " and what to do.
pub fn explain_missing(e: std::io::Error, what_to_do: &str) -> std::io::Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        std::io::Error::new(e.kind(), format!("not found: {what_to_do}"))
    } else {
        e
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
